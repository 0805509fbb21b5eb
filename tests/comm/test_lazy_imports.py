"""Importing the store (or the top package) must not load a communicator or Triton."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# Modules the launcher must not pay for when it only needs a store.
HEAVY_PREFIXES = (
    "fastcomm.comm.shm",
    "fastcomm.comm.pg",
    "fastcomm.comm.hier",
    "fastcomm.comm.nccl",
    "fastcomm.comm.world",
    "fastcomm.ddp",
    "fastcomm.kernels",
    "triton",
)


def loaded_after(statement: str) -> list[str]:
    """Runs ``statement`` in a fresh interpreter and returns the modules it left loaded."""
    code = f"{statement}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ.copy(),
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("statement", ["import fastcomm.comm.store", "import fastcomm"])
def test_import_loads_no_backend(statement):
    heavy = [m for m in loaded_after(statement) if m.startswith(HEAVY_PREFIXES)]
    assert heavy == [], f"{statement!r} loaded {heavy}"


def test_lazy_names_resolve_to_their_modules():
    modules = loaded_after(
        "import fastcomm, fastcomm.comm as c\n"
        "assert fastcomm.init is c.init and c.ShmCommunicator.__module__.startswith("
        "'fastcomm.comm.shm')\n"
        "assert set(fastcomm.__all__) <= set(dir(fastcomm))\n"
        "assert set(c.__all__) <= set(dir(c))"
    )
    assert "fastcomm.comm.world" in modules and "fastcomm.comm.shm.communicator" in modules


def test_unknown_name_raises_attribute_error():
    import fastcomm.comm

    with pytest.raises(AttributeError, match="no_such_name"):
        fastcomm.comm.no_such_name  # noqa: B018
