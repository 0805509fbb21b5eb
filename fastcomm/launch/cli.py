"""Command-line entry point of ``fastcomm-run``."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print("usage: fastcomm-run [options] script [args...]", file=sys.stderr)
    return 2
