"""The worker bootstrap (error files without opting in, faithful argv/sys.path) and the
failure report, without an agent."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fastcomm.launch.errors import Failure, format_report, read_error_file, root_cause
from fastcomm.launch.workers import BOOTSTRAP
from fastcomm.settings import LAUNCH_AGENT_PID

from ._util import clean_env, script

pytestmark = pytest.mark.timeout(30)


def bootstrap(tmp_path, *args, error_file=None, cwd=None):
    env = clean_env(**{LAUNCH_AGENT_PID.name: str(os.getpid())})
    if error_file is not None:
        env["TORCHELASTIC_ERROR_FILE"] = str(error_file)
    return subprocess.run(
        [sys.executable, "-u", BOOTSTRAP, *map(str, args)],
        cwd=cwd or tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=20,
    )


def test_uncaught_exception_is_recorded_like_torch_record(tmp_path):
    path = script(
        tmp_path,
        "boom.py",
        """
        def inner():
            raise KeyError("missing shard")
        inner()
    """,
    )
    error_file = tmp_path / "err" / "error.json"
    result = bootstrap(tmp_path, "--", path, error_file=error_file)
    assert result.returncode == 1
    # stderr: exactly what plain python prints
    plain = subprocess.run([sys.executable, str(path)], capture_output=True, text=True)
    assert result.stderr == plain.stderr
    data = json.loads(error_file.read_text())
    assert data["message"]["message"] == "KeyError: 'missing shard'"
    extra = data["message"]["extraInfo"]
    assert int(extra["timestamp"]) > 0
    assert extra["py_callstack"] == plain.stderr
    message, trace, stamp = read_error_file(str(error_file))
    assert message == "KeyError: 'missing shard'" and trace == plain.stderr and stamp > 0


def test_existing_error_file_is_kept_and_exit_codes_pass_through(tmp_path):
    error_file = tmp_path / "error.json"
    error_file.write_text('{"message": "written by the script"}')
    path = script(tmp_path, "boom.py", "raise RuntimeError('x')\n")
    assert bootstrap(tmp_path, "--", path, error_file=error_file).returncode == 1
    assert error_file.read_text() == '{"message": "written by the script"}'
    for code, expected in (("3", 3), ("0", 0), ("'bye'", 1)):
        error_file = tmp_path / f"error_{expected}.json"
        path = script(tmp_path, "quit.py", f"import sys; sys.exit({code})\n")
        assert bootstrap(tmp_path, "--", path, error_file=error_file).returncode == expected
        assert not error_file.exists()


def test_script_and_module_see_plain_python_argv_and_path(tmp_path):
    body = """
        import json, os, sys
        print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "name": __name__,
                          "pid_env": os.environ.get("FASTCOMM_LAUNCH_AGENT_PID")}))
        launch = os.path.join("fastcomm", "launch")
        assert not any(p.rstrip(os.sep).endswith(launch) for p in sys.path), sys.path
    """
    sub = tmp_path / "sub"
    sub.mkdir()
    path = script(sub, "show.py", body)
    script(tmp_path, "showmod.py", body)
    for args, plain in (
        (["--", "sub/show.py", "a", "--b"], [sys.executable, "sub/show.py", "a", "--b"]),
        (["--module", "--", "showmod", "x"], [sys.executable, "-m", "showmod", "x"]),
    ):
        ours = bootstrap(tmp_path, *args)
        theirs = subprocess.run(
            plain, cwd=tmp_path, capture_output=True, text=True, env=clean_env()
        )
        assert ours.returncode == theirs.returncode == 0, ours.stderr + theirs.stderr
        a, b = json.loads(ours.stdout), json.loads(theirs.stdout)
        assert a["pid_env"] is None  # the bootstrap's private variable is gone
        assert (a["argv"], a["path0"], a["name"]) == (b["argv"], b["path0"], b["name"])
    assert path.exists()


def test_exec_mode_runs_a_program(tmp_path):
    assert bootstrap(tmp_path, "--exec", "--", "sh", "-c", "exit 5").returncode == 5
    missing = bootstrap(tmp_path, "--exec", "--", "/no/such/program")
    assert missing.returncode == 127 and "cannot execute" in missing.stderr


def test_reads_error_files_written_by_torch(tmp_path, monkeypatch):
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    error_file = tmp_path / "torch_error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    try:
        raise ValueError("from torch's handler")
    except ValueError as exc:
        ErrorHandler().record_exception(exc)
    message, trace, stamp = read_error_file(str(error_file))
    assert message == "ValueError: from torch's handler"
    assert "Traceback" in trace and stamp > 0
    assert read_error_file(str(tmp_path / "absent.json")) == (None, None, None)


def test_report_names_the_first_failure_as_root_cause():
    late = Failure(
        rank=0,
        local_rank=0,
        group_rank=0,
        host="n0",
        pid=11,
        exitcode=1,
        timestamp=200.0,
        message="RuntimeError: connection closed by peer",
        traceback="Traceback (most recent call last):\nRuntimeError: closed\n",
    )
    first = Failure(
        rank=3, local_rank=1, group_rank=1, host="n1", pid=12, exitcode=-6, timestamp=100.0
    )
    assert root_cause([late, first]) is first
    report = format_report("train.py", [late, first], restarts=2, max_restarts=2)
    head, rest = report.split("Root Cause (the failure the others follow from):")
    cause, after = rest.split("Followed by")
    assert "train.py FAILED (restarts used: 2 of 2)" in head
    assert "Root cause: rank 3 (local_rank 1, host n1) was killed by signal 6" in head
    assert "[0]:" in after and "RuntimeError: closed" in after
    assert "rank      : 3 (local_rank: 1, group_rank: 1" in cause
    assert "host      : n1" in cause and "exitcode  : -6 (pid: 12)  (SIGABRT)" in cause
    assert "Signal 6 (SIGABRT) received by PID 12" in cause
