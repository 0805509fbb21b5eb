"""Helpers of the launcher tests: run ``python -m fastcomm.launch`` as a real process on
127.0.0.1, write worker scripts into ``tmp_path``, check processes are gone."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LAUNCH = [sys.executable, "-m", "fastcomm.launch"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without launcher variables, with fastcomm importable."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PET_", "TORCHELASTIC_", "FASTCOMM_LAUNCH"))
        and k
        not in (
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "LOCAL_WORLD_SIZE",
            "GROUP_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
            "OMP_NUM_THREADS",
            "ROLE_RANK",
            "ROLE_NAME",
            "ROLE_WORLD_SIZE",
            "GROUP_WORLD_SIZE",
            "LOGLEVEL",
        )
    }
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + path if path else "")
    env.update(extra)
    return env


def start(
    args: list[str],
    cwd: Path,
    env: dict[str, str] | None = None,
    cmd: list[str] | None = None,
    err_file: Path | None = None,
) -> subprocess.Popen:
    """Starts the launcher; its stderr goes to ``err_file`` where given (read while it runs:
    :func:`wait_output`), else to a pipe; :func:`finish` returns it either way."""
    stderr = open(err_file, "w") if err_file is not None else subprocess.PIPE  # noqa: SIM115
    try:
        proc = subprocess.Popen(
            [*(cmd or LAUNCH), *map(str, args)],
            cwd=cwd,
            env=env or clean_env(),
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    finally:
        if err_file is not None:
            stderr.close()
    proc.err_file = err_file
    return proc


def _stderr(proc: subprocess.Popen, piped: str | None) -> str:
    err_file = getattr(proc, "err_file", None)
    return err_file.read_text() if err_file is not None else piped or ""


def finish(proc: subprocess.Popen, timeout: float = 60) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the launcher stops its workers and removes its folder
        try:
            out, err = proc.communicate(timeout=40)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        err = _stderr(proc, err)
        raise AssertionError(f"launcher timed out\nstdout:\n{out}\nstderr:\n{err}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, _stderr(proc, err))


def wait_output(proc: subprocess.Popen, text: str, timeout: float = 60.0) -> None:
    """Waits until the stderr of `proc` (started with ``err_file``) holds `text`; raises
    naming it, with the log's tail, once `proc` exited or `timeout` s passed without it."""
    start_time = time.monotonic()
    while text not in proc.err_file.read_text():
        waited = time.monotonic() - start_time
        if proc.poll() is not None or waited > timeout:
            how = f"exited {proc.returncode}" if proc.poll() is not None else "still runs"
            raise AssertionError(f"launcher {how} after {waited:.1f} s without {text!r} in its "
                                 f"output:\n{proc.err_file.read_text()[-3000:]}")
        time.sleep(0.05)


def run(
    args: list[str],
    cwd: Path,
    env: dict[str, str] | None = None,
    timeout: float = 60,
    cmd: list[str] | None = None,
) -> subprocess.CompletedProcess:
    return finish(start(args, cwd, env, cmd), timeout)


def script(directory: Path, name: str, body: str) -> Path:
    path = directory / name
    path.write_text(textwrap.dedent(body).lstrip())
    return path


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, left unreaped by a non-reaping init, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def wait_gone(pids: list[int], timeout: float = 5.0) -> list[int]:
    """Waits for ``pids`` to exit; returns those still alive after ``timeout``."""
    deadline = time.monotonic() + timeout
    left = [p for p in pids if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if alive(p)]
    return left


def wait_files(
    directory: Path,
    pattern: str,
    count: int,
    timeout: float = 30.0,
    proc: subprocess.Popen | None = None,
    written: bool = False,
) -> list[Path]:
    """At least ``count`` files matching ``pattern``; ``written``: each not empty (a worker
    opens a file it writes, a pid say, before it writes it; a marker file stays empty)."""
    deadline = time.monotonic() + timeout
    while True:
        found = sorted(f for f in directory.glob(pattern) if not written or f.stat().st_size)
        if len(found) >= count:
            return found
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"launcher exited {proc.returncode} early\n{out}\n{err}")
        if time.monotonic() > deadline:
            raise AssertionError(f"only {len(found)} of {count} {pattern} in {directory}")
        time.sleep(0.05)


def kill_all(pids: list[int]) -> None:
    """Test cleanup: SIGKILL the given pids that are still alive (best effort)."""
    import signal

    for pid in pids:
        if alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


# A training script a launcher other than fastcomm-run starts (mpiexec, srun): torch's backend
# through env://, fastcomm.init() on its store, an all_reduce on each, a few DDP steps; each
# rank writes its result to the file argv[1] names with "%d" for its rank (two ranks' lines
# on one shared stdout may interleave).
LAUNCHED_DDP = """
import hashlib, json, os, socket, sys
import torch
import torch.distributed as dist
import fastcomm
from fastcomm.ddp import DDP

assert "RANK" in os.environ  # the launcher's own variables, exported by import fastcomm
dist.init_process_group("fastcomm")
t = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(t)
comm = fastcomm.init(timeout=60)  # on torch's store
u = torch.tensor([comm.rank + 1.0])
comm.all_reduce(u)
torch.manual_seed(0)
model = DDP(torch.nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    opt.zero_grad()
    model(torch.full((8, 16), float(comm.rank + step))).square().mean().backward()
    opt.step()
weights = torch.cat([p.detach().flatten() for p in model.parameters()])
with open(sys.argv[1] % comm.rank, "w") as f:
    json.dump({
        "host": socket.gethostname(), "rank": comm.rank, "size": comm.size,
        "backend": comm.backend, "torch_sum": t.item(), "fastcomm_sum": u.item(),
        "weights": hashlib.sha256(weights.numpy().tobytes()).hexdigest(),
        "env": {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                           "LOCAL_WORLD_SIZE", "MASTER_ADDR")},
    }, f)
fastcomm.shutdown()
dist.destroy_process_group()
"""


def spares_left(parent: int | None = None, cwd: Path | None = None,
                kinds: tuple[str, ...] = ("--spare", "--server")) -> list[int]:
    """The pids of this checkout's warm interpreters running, of `kinds`: spare workers and
    fork servers (``_bootstrap.py --spare``, ``--server``); only `parent`'s children, where
    given; only those working in `cwd`, a job's folder, where given (other tests' jobs may have
    their own at the same time)."""
    from fastcomm.launch.workers import BOOTSTRAP

    name = os.path.basename(BOOTSTRAP).encode()
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                argv = fh.read().split(b"\0")
        except OSError:
            continue
        # a forked server shows the bootstrap's name alone where the agent's command line
        # left no room for its path
        ours = BOOTSTRAP.encode() in argv or name in argv
        if ours and any(kind.encode() in argv for kind in kinds):
            if parent is not None and _parent(entry) != parent:
                continue
            if cwd is not None and _cwd(entry) != Path(cwd).resolve():
                continue
            found.append(int(entry))
    return found


def _cwd(pid: str) -> Path | None:
    try:
        return Path(os.readlink(f"/proc/{pid}/cwd")).resolve()
    except OSError:
        return None


def _parent(pid: str) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return None
