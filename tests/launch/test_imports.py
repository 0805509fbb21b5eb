"""The launcher needs only the store of fastcomm.comm: importing the agent loads no backend."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from ._util import REPO, clean_env

pytestmark = pytest.mark.timeout(60)

#: Module name prefixes the agent must not import: the communicator backends, DDP, kernels.
BACKEND_PREFIXES = (
    "fastcomm.comm.shm",
    "fastcomm.comm._shm",
    "fastcomm.comm.nccl",
    "fastcomm.ddp",
    "fastcomm.kernels",
    "triton",
)


def test_agent_imports_no_backend():
    code = textwrap.dedent(
        f"""
        import sys
        import fastcomm.launch.agent
        assert "fastcomm.comm.store" in sys.modules, "the agent no longer imports the store?"
        prefixes = {BACKEND_PREFIXES!r}
        loaded = sorted(m for m in sys.modules if m.startswith(prefixes))
        print("\\n".join(loaded))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert proc.returncode == 0, proc.stderr
    loaded = proc.stdout.split()
    assert loaded == [], f"importing fastcomm.launch.agent loaded {loaded}"
