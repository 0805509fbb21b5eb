"""torchrun flags fastcomm-run used to accept and ignore: each now does what torchrun 2.13 does,
or a value it cannot honour is one usage error line (exit 2) before any worker starts.

Every check runs the real launcher (``python -m fastcomm.launch``) as a process, except the
refused values after the first: those go through its ``main`` in the test's process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from fastcomm.launch.cli import main
from fastcomm.launch.workers import BOOTSTRAP

from ._util import clean_env, finish, run, script, start

pytestmark = pytest.mark.timeout(120)

HAS_CUDA = torch.cuda.is_available()

# (flags, the flag and value the one error line names, what else it says)
REFUSED = [
    (["--logs-specs", "custom"], "--logs-specs 'custom'", "no torchrun.logs_specs plugin"),
    (["--event-log-handler", "scuba"], "--event-log-handler 'scuba'", "torch registers only"),
    (["--duplicate-stdout-filters", "loss"], "--duplicate-stdout-filters 'loss'", "add --tee 1"),
    (["-t", "1", "--duplicate_stderr_filters", "w"], "--duplicate-stderr-filters 'w'", "--tee 2"),
    (["--start_method", "exec"], "--start-method", "invalid choice"),
    (["--run-path", "-m"], "--run-path", "contradicts --module"),
    (["--rdzv-conf", "store_type=file"], "store_type=file", "TCP store"),
    (["--node-rank", "1"], "--node-rank", "must be in [0, 1), got 1"),
    (["--numa-binding", "anywhere"], "--numa-binding", "invalid choice: 'anywhere'"),
]
if not HAS_CUDA:  # with CUDA it binds (test_numa_binding_matches_torch)
    REFUSED.append((["--numa-binding", "node"], "--numa-binding node", "CUDA is not available"))


def _events(stderr: str) -> list[dict]:
    return [json.loads(line) for line in stderr.splitlines() if line.startswith('{"name"')]


def _one_error_line(flags, named, message, returncode, stderr) -> None:
    errors = [line for line in stderr.splitlines() if "error:" in line]
    assert returncode == 2, (flags, stderr)
    assert len(errors) == 1 and named in errors[0] and message in errors[0], (flags, errors)
    assert "Traceback" not in stderr


def test_refused_values_are_one_usage_error_line(tmp_path, capsys):
    """The first through the real launcher process, the others through its ``main`` here (the
    same parser and checks, without an interpreter each); none starts its worker."""
    marker = tmp_path / "started"
    path = script(tmp_path, "train.py", f"open({str(marker)!r}, 'w').close()\n")
    (flags, named, message), *others = REFUSED
    result = finish(start([*flags, path], tmp_path), timeout=60)
    _one_error_line(flags, named, message, result.returncode, result.stderr)
    for flags, named, message in others:
        returncode = main([*flags, str(path)])
        _one_error_line(flags, named, message, returncode, capsys.readouterr().err)
    assert not marker.exists()


def test_default_values_run_silently(tmp_path):
    """torchrun's defaults, spelled out (both spellings), change nothing and print nothing."""
    path = script(tmp_path, "train.py", "print('ran', flush=True)\n")
    result = run(
        [
            "--start-method", "spawn",
            "--event_log_handler", "null",
            "--duplicate-stdout-filters", "",
            "--duplicate_stderr_filters", "",
            "--node-rank", "0",
            "--master-addr", "127.0.0.1",
            "--rdzv-conf", "store_type=tcp",
            path,
        ],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "[rank 0]: ran\n" and result.stderr == ""


def test_run_path_wins_over_no_python_and_console_events(tmp_path):
    """--run-path runs the script through Python even with --no-python (as torchrun); the
    console handler logs torchrun's events of a successful job as JSON lines."""
    path = script(tmp_path, "train.py", "import os\nprint('pid', os.getpid(), flush=True)\n")
    os.chmod(path, 0o644)  # not executable: --no-python alone could not run it
    result = run(
        ["--run-path", "--no-python", "--event-log-handler", "console", "--rdzv-id", "j1", path],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    pid = result.stdout.split()[-1]
    events = _events(result.stderr)
    names = [(e["source"], e["name"].rsplit(".", 1)[1]) for e in events]
    assert names == [
        ("AGENT", "RENDEZVOUS"),
        ("AGENT", "ASSIGN_WORKER_RANKS"),
        ("WORKER", "START"),
        ("WORKER", "SUCCEEDED"),
        ("AGENT", "SUCCEEDED"),
    ], result.stderr
    md = events[3]["metadata"]
    assert (md["worker_id"], md["global_rank"], md["state"], md["role"]) == (
        pid, 0, "SUCCEEDED", "default"
    )
    assert md["rdzv_backend"] == "c10d" and md["raw_error"] is None
    assert json.loads(md["metadata"])["local_rank"] == [0]
    assert events[0]["metadata"]["duration_ms"] >= 0


def test_duplicate_filters_and_failure_events(tmp_path):
    """Tee'd lines of shown ranks that hold a filter land, prefixed, in filtered_*.log (one
    file per attempt, torchrun's names); a failed job's events: FAILED with the exit code and
    error file, TERMINATED for the worker the agent stopped, the agent SUCCEEDED."""
    path = script(
        tmp_path,
        "train.py",
        """
        import os, sys, time
        rank = os.environ["RANK"]
        print(f"loss=1 r{rank}", flush=True)
        print(f"a,b r{rank}", flush=True)
        print("other", flush=True)
        print(f"warn r{rank}", file=sys.stderr, flush=True)
        print("plain", file=sys.stderr, flush=True)
        if rank == "1":
            raise RuntimeError("boom")
        time.sleep(30)
        """,
    )
    logs = tmp_path / "logs"
    result = run(
        [
            "--nproc-per-node", "2",
            "--tee", "3",
            "--local-ranks-filter", "0",
            "--log-dir", logs,
            "--duplicate-stdout-filters", "loss,a,,b",
            "--duplicate-stderr-filters", "warn",
            "--event-log-handler", "console",
            "--shutdown-timeout", "5",
            path,
        ],
        tmp_path,
    )
    assert result.returncode == 1, result.stderr
    (attempt,) = logs.glob("*/attempt_0")
    filtered = (attempt / "filtered_stdout.log").read_text()
    assert filtered == "[rank 0]: loss=1 r0\n[rank 0]: a,b r0\n"
    assert (attempt / "filtered_stderr.log").read_text() == "[rank 0]: warn r0\n"
    events = _events(result.stderr)
    ends = {
        e["metadata"]["global_rank"]: e
        for e in events
        if e["source"] == "WORKER" and not e["name"].endswith("START")
    }
    failed, stopped = ends[1]["metadata"], ends[0]["metadata"]
    assert failed["state"] == "FAILED" and json.loads(failed["metadata"])["exit_code"] == [1]
    assert "boom" in failed["raw_error"]
    assert stopped["state"] == "TERMINATED" and stopped["raw_error"] is None
    assert events[-1]["source"] == "AGENT" and events[-1]["metadata"]["state"] == "SUCCEEDED"


def test_flags_unused_by_the_rendezvous_warn_as_torchrun(tmp_path):
    """--node-rank with c10d, --master-* with c10d, an unknown --rdzv-conf key: the job runs;
    one warning line names each."""
    path = script(tmp_path, "train.py", "print('ran', flush=True)\n")
    result = run(
        [
            "--rdzv-backend", "c10d",
            "--node-rank", "1",
            "--master-addr", "10.9.8.7",
            "--master-port", "29999",
            "--rdzv-conf", "heartbeat_timeout=5",
            path,
        ],
        tmp_path,
    )
    assert result.returncode == 0 and result.stdout == "[rank 0]: ran\n", result.stderr
    warnings = [line for line in result.stderr.splitlines() if "warning:" in line]
    for needle in (
        "--node-rank 1",
        "--master-addr 10.9.8.7",
        "--master-port 29999",
        "'heartbeat_timeout'",
    ):
        assert sum(needle in line for line in warnings) == 1, (needle, result.stderr)
    assert len(warnings) == 4, result.stderr


def test_bootstrap_binds_the_worker_to_its_cpus(tmp_path):
    """What --numa-binding hands each worker: ``--cpus LIST`` binds it (and what it starts)
    before the script runs, as ``numactl --physcpubind`` under torchrun."""
    allowed = sorted(os.sched_getaffinity(0))
    cpus = f"{allowed[0]}" if len(allowed) == 1 else f"{allowed[0]},{allowed[-1]}"
    path = script(tmp_path, "aff.py", "import os\nprint(sorted(os.sched_getaffinity(0)))\n")
    for mode in ([], ["--exec"]):
        target = [sys.executable, path] if mode else [path]
        out = subprocess.run(
            [sys.executable, BOOTSTRAP, *mode, "--cpus", cpus, "--", *target],
            capture_output=True, text=True, timeout=30, env=clean_env(),
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == str(sorted({allowed[0], allowed[-1]}))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["node", "exclusive"])
def test_numa_binding_matches_torch(tmp_path, mode):
    """Each worker runs on exactly the CPUs torch's own NUMA binding picks for its GPU."""
    from torch.numa.binding import AffinityMode, NumaOptions, _get_logical_cpus_to_bind_to

    nproc = min(torch.cuda.device_count(), 2)
    path = script(
        tmp_path,
        "aff.py",
        "import os\nprint(os.environ['LOCAL_RANK'], sorted(os.sched_getaffinity(0)), flush=True)\n",
    )
    result = run(["--numa-binding", mode, "--nproc-per-node", str(nproc), path], tmp_path)
    assert result.returncode == 0, result.stderr
    got = {}
    for line in result.stdout.splitlines():
        local_rank, cpus = line.split(": ", 1)[1].split(" ", 1)
        got[int(local_rank)] = set(json.loads(cpus))
    options = NumaOptions(affinity_mode=AffinityMode(mode))
    want = {r: _get_logical_cpus_to_bind_to(gpu_index=r, numa_options=options)
            for r in range(nproc)}
    assert got == want
