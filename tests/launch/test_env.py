"""The workers' environment (and argv / sys.path[0]) equals what torchrun 2.x gives them.

Both launchers run the same worker, from the same parent environment, with the same flags;
every variable of the two worker environments is compared. Values that legitimately differ
are compared by form only:

* ``MASTER_PORT``: a port either way; fastcomm-run serves a fresh worker store on a new free
  port every round (torchrun reuses one -- the cause of its failed restarts), so with the
  static backend it is not ``--master-port`` (which fastcomm-run uses for rendezvous only);
* ``TORCHELASTIC_RUN_ID``: a fresh uuid4 with ``--standalone`` (equal otherwise);
* ``TORCHELASTIC_ERROR_FILE``: a per-run temporary path ending ``attempt_0/<local_rank>/
  error.json`` in both.

Two variables are fastcomm-run's own: ``FASTCOMM_JOB_SECRET``, the random per-job secret (64
hex digits) that signs the values workers read back from the store, and
``FASTCOMM_FLIGHT_DIR``, where the workers' flight records go (``attempt_0/flight`` of the run's
folder) for the launcher's hang report.
"""

from __future__ import annotations

import json
import os
import re

import pytest

from tests.harness import free_port

from ._util import TORCHRUN, clean_env, run, script

pytestmark = pytest.mark.timeout(90)

DUMP = """
    import json, os, sys
    out = sys.argv[1]
    record = {"env": dict(os.environ), "argv": sys.argv, "path0": sys.path[0],
              "name": __name__, "file": os.path.abspath(__file__)}
    with open(os.path.join(out, "env_%s.json" % os.environ["LOCAL_RANK"]), "w") as fh:
        json.dump(record, fh)
"""

UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _launch(cmd, flags, target, args, tmp_path, name, env):
    out = tmp_path / name
    out.mkdir()
    result = run([*flags, target, str(out), *args], tmp_path, env=env, timeout=60, cmd=cmd)
    assert result.returncode == 0, f"{name}: {result.stdout}\n{result.stderr}"
    return {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in out.glob("env_*.json")}


def _compare(ours, theirs, *, standalone):
    assert sorted(ours) == sorted(theirs)
    for local_rank in theirs:
        a, b = ours[local_rank], theirs[local_rank]
        # argv[1] is each launcher's own output directory
        assert a["argv"][:1] + a["argv"][2:] == b["argv"][:1] + b["argv"][2:]
        assert a["path0"] == b["path0"]
        assert a["name"] == b["name"] == "__main__" and a["file"] == b["file"]
        env_a, env_b = dict(a["env"]), b["env"]
        assert re.fullmatch(r"[0-9a-f]{64}", env_a.pop("FASTCOMM_JOB_SECRET"))
        assert env_a.pop("FASTCOMM_FLIGHT_DIR").endswith(os.path.join("attempt_0", "flight"))
        assert sorted(env_a) == sorted(env_b), (
            f"only fastcomm-run: {sorted(set(env_a) - set(env_b))}, "
            f"only torchrun: {sorted(set(env_b) - set(env_a))}"
        )
        by_form = {"MASTER_PORT", "TORCHELASTIC_ERROR_FILE"}
        if standalone:
            by_form.add("TORCHELASTIC_RUN_ID")
            assert UUID.fullmatch(env_a["TORCHELASTIC_RUN_ID"])
            assert UUID.fullmatch(env_b["TORCHELASTIC_RUN_ID"])
        for key in sorted(set(env_b) - by_form):
            assert env_a[key] == env_b[key], f"{key}: {env_a[key]!r} != torchrun {env_b[key]!r}"
        assert 0 < int(env_a["MASTER_PORT"]) < 65536 and 0 < int(env_b["MASTER_PORT"]) < 65536
        suffix = f"/attempt_0/{local_rank}/error.json"
        assert env_a["TORCHELASTIC_ERROR_FILE"].endswith(suffix)
        assert env_b["TORCHELASTIC_ERROR_FILE"].endswith(suffix)


def test_env_equals_torchrun_standalone_script(tmp_path):
    path = script(tmp_path, "dump_env.py", DUMP)
    flags = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "2", "--role", "trainer"]
    env = clean_env()
    ours = _launch(None, flags, str(path.name), ["--lr", "0.1"], tmp_path, "ours", env)
    theirs = _launch(TORCHRUN, flags, str(path.name), ["--lr", "0.1"], tmp_path, "theirs", env)
    _compare(ours, theirs, standalone=True)
    e = ours[1]["env"]
    assert (e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]) == (
        "1",
        "1",
        "2",
        "2",
    )
    assert (e["GROUP_RANK"], e["GROUP_WORLD_SIZE"], e["ROLE_RANK"], e["ROLE_WORLD_SIZE"]) == (
        "0",
        "1",
        "1",
        "2",
    )
    assert (e["ROLE_NAME"], e["TORCHELASTIC_RESTART_COUNT"], e["TORCHELASTIC_MAX_RESTARTS"]) == (
        "trainer",
        "0",
        "2",
    )
    assert e["OMP_NUM_THREADS"] == "1" and e["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert ours[1]["argv"] == ["dump_env.py", str(tmp_path / "ours"), "--lr", "0.1"]


def test_env_equals_torchrun_static_module(tmp_path):
    """Static backend (--master-port), -m module, a single worker (so no OMP_NUM_THREADS),
    PET_* flags from the environment."""
    script(tmp_path, "dumpmod.py", DUMP)
    port = free_port()
    flags = ["--nnodes", "1", "--master-addr", "127.0.0.1", "--master-port", str(port), "-m"]
    env = clean_env(PET_MAX_RESTARTS="1")
    ours = _launch(None, flags, "dumpmod", [], tmp_path, "ours", env)
    theirs = _launch(TORCHRUN, flags, "dumpmod", [], tmp_path, "theirs", env)
    _compare(ours, theirs, standalone=False)
    e = ours[0]["env"]
    assert "OMP_NUM_THREADS" not in e and e["TORCHELASTIC_MAX_RESTARTS"] == "1"
    assert (e["TORCHELASTIC_RUN_ID"], e["MASTER_ADDR"]) == ("none", "127.0.0.1")
    assert ours[0]["argv"][0] == str(tmp_path / "dumpmod.py")
