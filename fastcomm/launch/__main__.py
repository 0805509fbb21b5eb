"""``python -m fastcomm.launch``: the same as the ``fastcomm-run`` console script."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
