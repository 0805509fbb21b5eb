"""``--start-method forkserver`` (the default): the Python workers of a script that names torch
are forked from one server per agent that imported torch ahead (``forkserver.py``); each is a
worker as a new interpreter would be (its own session, environment, argv, stdin, output,
exit status), the server lasts across rounds, and nothing outlives the job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from fastcomm.launch.forkserver import ForkServer
from fastcomm.launch.workers import BOOTSTRAP

from ._util import clean_env, finish, run, script, spares_left, start, wait_files, wait_gone

pytestmark = pytest.mark.timeout(120)

# What a worker sees at its first line (before it imports torch itself); argv: the out folder,
# then "fail" to make rank 1 exit 3 in round 0, or "hold" to wait for a file named "end".
PROBE = """
import os, sys, time
warm = "torch" in sys.modules
import numpy, torch
out = sys.argv[1]
rank, round_ = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
with open(os.path.join(out, f"w{rank}_{round_}.json"), "w") as fh:
    json_text = __import__("json").dumps({
        "warm": warm, "pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0),
        "argv": sys.argv, "path0": sys.path[0], "name": __name__,
        "stdin": os.readlink("/proc/self/fd/0"), "rank": rank,
        "threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS"),
        "draw": float(numpy.random.rand()),
        "unbuffered": sys.stdout.write_through,
        "parent_of_parent": int(open(f"/proc/{os.getppid()}/stat", "rb").read()
                                .rsplit(b")", 1)[1].split()[1]),
        "parent_argv": [a.decode() for a in open(f"/proc/{os.getppid()}/cmdline", "rb")
                        .read().split(b"\\0") if a],
        "stdout_raw": type(sys.stdout.buffer).__name__,
        "utf8": sys.flags.utf8_mode,
    })
    fh.write(json_text)
print(f"hello from {rank}", flush=True)
if sys.argv[2:] == ["fail"] and rank == "1" and round_ == "0":
    sys.exit(3)
if sys.argv[2:] == ["hold"]:
    while not os.path.exists(os.path.join(out, "end")):
        time.sleep(0.05)
"""


def _reports(tmp_path, pattern: str = "w*.json") -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(tmp_path.glob(pattern))}


def _cmdline(pid: int) -> list[bytes]:
    with open(f"/proc/{pid}/cmdline", "rb") as fh:
        return fh.read().split(b"\0")


def test_workers_are_forked_warm_and_each_is_its_own_worker(tmp_path):
    """Rank 1 fails in round 0; round 1 runs. Every worker started with torch imported, as the
    child of one server (the same in both rounds), leading its own session, with its own rank,
    argv, ``sys.path[0]``, ``/dev/null`` stdin and numpy seed; its output is prefixed and tee'd;
    its exit status 3 is the one the report names."""
    path = script(tmp_path, "probe.py", PROBE)
    logs = tmp_path / "logs"
    proc = start(["--nproc-per-node", "2", "--max-restarts", "1", "--tee", "1", "--log-dir",
                  logs, path, tmp_path, "fail"], tmp_path, clean_env())
    result = finish(proc)
    assert result.returncode == 0, result.stderr
    assert "exit code 3" in result.stderr and "restarting" in result.stderr, result.stderr
    reports = _reports(tmp_path)
    assert sorted(reports) == ["w0_0", "w0_1", "w1_0", "w1_1"]
    servers = {r["ppid"] for r in reports.values()}
    assert len(servers) == 1  # one server, lasting across the rounds
    # forked from the agent (which imported torch already), titled as a spawned server is
    for r in reports.values():
        assert r["parent_of_parent"] == proc.pid
        assert r["parent_argv"][1:4] == ["-u", BOOTSTRAP, "--server"], r["parent_argv"]
    for name, r in reports.items():
        assert r["warm"], name
        assert r["sid"] == r["pid"], name  # a session (and process group) of its own
        assert r["argv"] == [str(path), str(tmp_path), "fail"] and r["name"] == "__main__"
        assert r["path0"] == str(tmp_path) and r["stdin"] == "/dev/null"
        assert r["omp"] == "1" and r["threads"] == 1
        assert r["unbuffered"] and r["stdout_raw"] == "FileIO", r  # as ``python -u``'s
    assert len({r["draw"] for r in reports.values()}) == 4  # numpy reseeded in each
    assert result.stdout.count("[rank 0]: hello from 0") == 2
    assert next(logs.glob("*/attempt_1/1/stdout.log")).read_text() == "hello from 1\n"
    assert not wait_gone(list(servers))


def test_an_agent_in_the_c_locale_still_forks_its_server(tmp_path):
    """In the C locale (a container's, often) Python turns UTF-8 mode on by itself, as a spawned
    server would: the server is forked from the agent all the same, and the worker is in UTF-8
    mode as a new interpreter would be."""
    site, marks = tmp_path / "site", tmp_path / "marks"
    site.mkdir()
    marks.mkdir()
    (site / "sitecustomize.py").write_text(  # the agent marks each child it forks
        "import os\n"
        "if b'fastcomm.launch' in open('/proc/self/cmdline', 'rb').read().split(b'\\0'):\n"
        f"    os.register_at_fork(after_in_child=lambda: open(os.path.join({str(marks)!r}, "
        "str(os.getpid())), 'w').close())\n")
    path = script(tmp_path, "probe.py", PROBE)
    env = {**clean_env(), "LANG": "C", "LC_ALL": "C"}
    env.pop("PYTHONUTF8", None)
    env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [env.get("PYTHONPATH")])])
    proc = start(["--nproc-per-node", "1", path, tmp_path], tmp_path, env)
    result = finish(proc)
    assert result.returncode == 0, result.stderr
    report = _reports(tmp_path)["w0_0"]
    assert report["parent_of_parent"] == proc.pid, report
    assert str(report["ppid"]) in os.listdir(marks), report  # the server: forked, not spawned
    assert report["warm"] and report["utf8"] == 1, report


def test_spawn_starts_new_interpreters(tmp_path):
    """``--start-method spawn``: each worker is a new interpreter, the agent's child."""
    path = script(tmp_path, "probe.py", PROBE)
    proc = start(["--start-method", "spawn", "--nproc-per-node", "2", path, tmp_path],
                 tmp_path, clean_env())
    result = finish(proc)
    assert result.returncode == 0, result.stderr
    reports = _reports(tmp_path)
    assert [r["warm"] for r in reports.values()] == [False, False]
    assert {r["ppid"] for r in reports.values()} == {proc.pid}


def test_a_script_that_does_not_name_torch_is_not_forked(tmp_path):
    """Nothing worth importing ahead: no server starts, the workers are new interpreters."""
    path = script(tmp_path, "plain.py", """
        import os, sys
        print(os.getppid(), flush=True)
    """)
    proc = start(["--nproc-per-node", "2", path], tmp_path, clean_env())
    result = finish(proc)
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == [f"[rank {r}]: {proc.pid}" for r in (0, 1)]


def test_a_lost_agent_takes_the_server_and_its_workers_down(tmp_path):
    """The agent SIGKILLed: the server sees its socket close and exits; the workers see their
    parent gone and end their process groups."""
    path = script(tmp_path, "probe.py", PROBE)
    proc = start(["--nproc-per-node", "2", path, tmp_path, "x", "hold"], tmp_path, clean_env())
    try:
        wait_files(tmp_path, "w*_0.json", 2, proc=proc, written=True, timeout=90)
        reports = _reports(tmp_path)
        server = next(iter(reports.values()))["ppid"]
        assert b"--server" in _cmdline(server)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert not wait_gone([server, *(r["pid"] for r in reports.values())], timeout=10)
    assert not spares_left(cwd=tmp_path)


def test_the_server_applies_the_workers_thread_count(tmp_path):
    """A worker whose ``OMP_NUM_THREADS`` differs from the server's import-time one gets it
    through ``torch.set_num_threads``; a failed import-time guess never leaks across."""
    path = script(tmp_path, "threads.py", """
        import os, sys, torch
        with open(sys.argv[1], "w") as fh:
            fh.write(str(torch.get_num_threads()))
    """)
    base = clean_env(OMP_NUM_THREADS="1")
    server = ForkServer([sys.executable, "-u", BOOTSTRAP, "--", str(path)], BOOTSTRAP, base)
    null = os.open(os.devnull, os.O_RDWR)
    try:
        assert server.wait_ready()
        procs = []
        for threads in ("1", "2"):
            env = {**base, "OMP_NUM_THREADS": threads}
            out = tmp_path / f"t{threads}"
            procs.append((server.spawn(["--", str(path), str(out)], env, (null, null, null),
                                       None, None), out, threads))
        for forked, out, threads in procs:
            assert forked.wait(timeout=60) == 0
            assert out.read_text() == threads
        failing = server.spawn(["--", str(tmp_path / "missing.py")], base, (null, null, null),
                               None, None)
        assert failing.wait(timeout=60) != 0  # the worker's own status, as Popen gives it
    finally:
        os.close(null)
        server.close()
    assert server.proc.poll() is not None
    with pytest.raises(subprocess.TimeoutExpired):
        type(failing)(server, os.getpid(), None, None).wait(timeout=0.05)


def test_a_forked_worker_exits_as_an_interpreter_would(tmp_path):
    """Its exit skips the teardown of the server's modules, not its own: a non-daemon thread is
    waited for, ``atexit`` callbacks run, a file left open is flushed, ``sys.exit(text)``
    prints the text and exits 1 -- as a new interpreter's exit does (a dead weak proxy among
    its objects included)."""
    path = script(tmp_path, "ends.py", """
        import atexit, os, sys, threading, time, torch, weakref
        out, rank = sys.argv[1], os.environ["RANK"]
        class Gone:
            pass
        dead = [weakref.proxy(Gone())]  # a proxy whose object is gone (the exit walks it)
        left_open = open(os.path.join(out, f"open_{rank}"), "w")
        left_open.write("written, never closed")
        atexit.register(lambda: open(os.path.join(out, f"atexit_{rank}"), "w").close())
        def late():
            time.sleep(0.5)
            open(os.path.join(out, f"thread_{rank}"), "w").close()
        threading.Thread(target=late).start()
        if rank == "1":  # once rank 0 flushed (else the launcher stops it: rank 1 fails)
            first, deadline = os.path.join(out, "open_0"), time.monotonic() + 20
            while time.monotonic() < deadline and not (
                    os.path.exists(first) and os.path.getsize(first)):
                time.sleep(0.02)
            sys.exit("rank 1 says goodbye")
    """)
    result = run(["--nproc-per-node", "2", path, tmp_path], tmp_path, env=clean_env())
    assert result.returncode == 1, result.stderr
    assert "rank 1 says goodbye" in result.stderr
    assert "exit code 1" in result.stderr and "exit code 0" not in result.stderr
    for rank in (0, 1):
        assert (tmp_path / f"open_{rank}").read_text() == "written, never closed"
        assert (tmp_path / f"atexit_{rank}").exists() and (tmp_path / f"thread_{rank}").exists()


@pytest.mark.parametrize("started", ["forked-from-the-agent", "own-interpreter"])
def test_a_server_that_does_not_start_leaves_new_interpreters(tmp_path, started):
    """The server dies before it is ready (here a ``sitecustomize`` ends it; on a GPU node,
    CUDA initialized by an import): one warning, and the workers start as new interpreters.
    The server is forked from the agent by default, and started as an interpreter of its own
    when the workers' interpreter is another (``PYTHON_EXEC``, here a wrapper script)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os, sys\n"
        "if '--server' in sys.argv:\n    os._exit(3)\n"
        "if b'fastcomm.launch' in open('/proc/self/cmdline', 'rb').read().split(b'\\0'):\n"
        "    # the agent: the server it forks dies at once\n"
        "    os.register_at_fork(after_in_child=lambda: os._exit(3))\n")
    path = script(tmp_path, "probe.py", PROBE)
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [env.get("PYTHONPATH")])])
    if started == "own-interpreter":
        wrapper = tmp_path / "python-wrapper"
        wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
        wrapper.chmod(0o755)
        env["PYTHON_EXEC"] = str(wrapper)
    proc = start(["--nproc-per-node", "2", path, tmp_path], tmp_path, env)
    result = finish(proc)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("the fork server did not start") == 1, result.stderr
    reports = _reports(tmp_path)
    assert [r["warm"] for r in reports.values()] == [False, False]
    assert {r["ppid"] for r in reports.values()} == {proc.pid}


def test_a_forked_server_title_fits_the_agents_command_line():
    """The server forked from the agent shows a spawned server's command line where the
    agent's leaves room for it, else the same with the names shortened (never longer than the
    room: a command line cannot grow)."""
    from fastcomm.launch import forkserver

    start, end = forkserver._cmdline_area()
    room = end - start
    assert room >= len(b"python\0-u\0_bootstrap.py\0--server\0004\0")  # pytest's own is long
    fits = ["/p", "-u", "/b/_bootstrap.py", "--server", "4"]
    assert forkserver._title(fits) == fits
    long = ["/" + "p" * room, "-u", "/b/_bootstrap.py", "--server", "4"]
    assert forkserver._title(long) == ["python", "-u", "_bootstrap.py", "--server", "4"]
    longer = ["/" + "p" * room, "-u", "/" + "b" * room + "/_bootstrap.py", "--server", "4"]
    assert forkserver._title(longer) == ["python", "-u", "_bootstrap.py", "--server", "4"]
