"""Worker-side wrapper the agent starts every worker through (standard library only).

The agent runs ``python -u <this file> [--module] [--cpus LIST] -- TARGET ARGS...``; this wrapper
binds the CPUs (``--cpus``, ``--numa-binding``), runs the target with ``runpy`` as
``__main__`` with the ``sys.argv``/``sys.path[0]`` of ``python TARGET ARGS``, records an
uncaught exception to ``$TORCHELASTIC_ERROR_FILE`` in torch's ``@record`` format (exit 1), and
SIGKILLs the worker's process group when the agent is gone. ``--exec`` (``--no-python``) sets
``PR_SET_PDEATHSIG`` and ``exec``s the program. ``--spare``: a warm spare (``spare.py``)
imports torch and fastcomm first, then reads the rest from stdin; ``--server FD``: the fork
server (``forkserver.py``) imports them once and forks each worker. Details: docs/launch.md.

It is run by path, not as ``-m fastcomm.launch._bootstrap``, so the worker does not import
the fastcomm package (nor torch) before the user's code does (a spare does, by design).
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and sys.path[0] and os.path.abspath(sys.path[0]) == _HERE:
    del sys.path[0]  # fastcomm/launch/ must not shadow the user's top-level modules

import json  # noqa: E402
import signal  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

_POLL_S = 0.2


def _settings():
    """``fastcomm/settings.py`` (standard library only), loaded by path: the names of fastcomm's
    variables without importing the fastcomm package, nor torch, before the user's code does."""
    import importlib.util

    path = os.path.join(os.path.dirname(_HERE), "settings.py")
    spec = importlib.util.spec_from_file_location("_fastcomm_settings", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _set_pdeathsig(sig: int) -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:  # pragma: no cover - best effort
        pass


def _kill_own_group() -> None:
    try:
        if os.getpgrp() == os.getpid():  # the agent made us a session/group leader
            os.killpg(os.getpgrp(), signal.SIGKILL)
    finally:
        os.kill(os.getpid(), signal.SIGKILL)


def _watch(agent_pid: int) -> None:
    while True:
        time.sleep(_POLL_S)
        if os.getppid() != agent_pid:
            try:
                sys.stderr.write("[fastcomm-run] the agent is gone; worker exiting\n")
                sys.stderr.flush()
            except Exception:
                pass  # stderr is gone with the agent; exiting is what matters
            _kill_own_group()


def _check_agent(agent_pid: int | None) -> None:
    if agent_pid is not None and os.getppid() != agent_pid:
        sys.stderr.write("[fastcomm-run] the agent exited before this worker started\n")
        sys.exit(1)


def _trim(tb):
    """Drops this wrapper's and runpy's frames from the front of a traceback."""
    here = os.path.abspath(__file__)
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if os.path.abspath(name) == here or "runpy" in os.path.basename(name):
            tb = tb.tb_next
            continue
        break
    return tb


def _record(exc: BaseException, tb) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):  # the script recorded it itself (torch @record)
        return
    now = time.time()
    data = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(type(exc), exc, tb)),
                "timestamp": str(int(now)),
                "fastcomm_time": repr(now),
            },
        }
    }
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as fh:
            json.dump(data, fh)
        os.replace(tmp, path)
    except OSError as err:
        sys.stderr.write(f"[fastcomm-run] could not write the error file {path}: {err}\n")


def _bind_cpus(text: str) -> None:
    cpus = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    try:
        os.sched_setaffinity(0, cpus)
    except (AttributeError, OSError) as err:
        sys.stderr.write(f"[fastcomm-run] --numa-binding: cannot bind to CPUs {text}: {err}\n")
        sys.exit(1)


def _run_python(module: bool, target: str, args: list) -> None:
    import runpy

    sys.argv = [target, *args]
    if not getattr(sys.flags, "safe_path", False):  # python -P / PYTHONSAFEPATH
        sys.path.insert(0, os.getcwd() if module else os.path.dirname(os.path.realpath(target)))
    if module:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(target, run_name="__main__")


#: What a spare imports while it waits (a failing import is left to the worker's own).
SPARE_IMPORTS = ("torch", "torch._dynamo", "torch.optim", "fastcomm", "fastcomm.ddp")


def _import_warm() -> None:
    """Imports :data:`SPARE_IMPORTS` with the garbage collector off: its passes over the
    objects the imports make cost a fifth of their time (3.5 s against 2.8 s of CPU here)."""
    import gc
    import importlib

    gc.disable()
    try:
        for name in SPARE_IMPORTS:
            try:
                importlib.import_module(name)
            except Exception:  # the worker's own import reports it, where it matters
                pass
    finally:
        gc.enable()


def serve_forked(fd: int, env: dict) -> None:
    """The server forked from the agent itself (``forkserver._fork_here``), torch imported
    there already: takes the round's environment ``env``, then serves as ``--server FD`` does;
    in each forked worker, runs it to its end. Never returns."""
    imported_env = dict(os.environ)  # what torch (OpenMP's pool) was imported in
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [os.path.abspath(__file__), "--server", str(fd)]
    argv = _serve(fd, imported_env)  # returns in each forked worker only
    try:
        _start(argv, forked=True)
    except SystemExit as exc:  # before the target ran (the agent is gone, a bad command)
        _exit_forked(_status(exc.code))


def _serve(fd: int, imported_env: dict | None = None) -> list:
    """``--server FD`` (``fastcomm/launch/forkserver.py``): imports :data:`SPARE_IMPORTS`, then
    forks one worker per request read from the socket ``fd`` and reports it started and, once
    reaped, its exit status. Returns the request's arguments in each forked worker (never in the
    server, which exits when the agent closes its end). ``imported_env``: the environment
    torch was imported in (default: this one)."""
    import gc
    import select
    import socket
    import warnings

    _import_warm()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # no forked child could use CUDA
        sys.stderr.write("[fastcomm-run] CUDA was initialized while importing; not forking\n")
        os._exit(1)  # the agent starts the workers as new interpreters
    gc.collect()
    gc.freeze()  # the workers' collections skip the server's objects (and copy no page of them)
    if imported_env is None:
        imported_env = dict(os.environ)
    sock = socket.socket(fileno=fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    pending, fds = b"", []

    def send(msg: dict) -> None:
        try:
            sock.sendall((json.dumps(msg) + "\n").encode())
        except OSError:
            os._exit(0)  # the agent is gone: so are we (the workers watch us)

    send({"ready": os.getpid()})
    while True:
        ready = select.select([sock, wake_r], [], [])[0]
        if wake_r in ready:
            try:
                while os.read(wake_r, 512):
                    pass
            except BlockingIOError:
                pass  # drained
            _reap(send)
        if sock not in ready:
            continue
        data, new_fds, _, _ = socket.recv_fds(sock, 1 << 16, 3)
        if not data:
            os._exit(0)  # the agent closed its end
        pending, fds = pending + data, fds + new_fds
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            job, mine, fds = json.loads(line), fds[:3], fds[3:]
            led_r, led_w = os.pipe()
            with warnings.catch_warnings():  # 3.12+: "multi-threaded, fork() may deadlock"
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
            if pid == 0:  # the worker
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for own in (led_r, wake_r, wake_w):
                    os.close(own)
                sock.close()
                os.setsid()
                os.close(led_w)  # the server may report it started: it leads its session
                for target, source in enumerate(mine):
                    os.dup2(source, target)
                for source in mine:
                    if source > 2:
                        os.close(source)
                _become(job["env"], imported_env)
                return list(job["args"])
            os.close(led_w)
            os.read(led_r, 1)  # end of file once the worker called setsid (or died)
            os.close(led_r)
            for source in mine:
                os.close(source)
            send({"started": pid})


def _reap(send) -> None:
    """Reports every exited worker (its status as ``Popen.returncode`` gives it)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _become(env: dict, imported_env: dict) -> None:
    """A forked worker takes its own environment; what torch and numpy took from the server's
    at import is set again where it differs (OpenMP's pool size, numpy's global seed)."""
    os.environ.clear()
    os.environ.update(env)
    torch = sys.modules.get("torch")
    threads = env.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0 \
            and threads != imported_env.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(threads))
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()  # as a new interpreter's: from the OS, not the server's copy


def _spare() -> list:
    """``--spare`` (``fastcomm/launch/spare.py``): imports :data:`SPARE_IMPORTS`, then waits for
    one JSON line on stdin -- the worker's arguments and environment -- and returns the
    arguments; exits quietly at end of input (not needed: the agent is done or gone)."""
    # read at once, so that the agent's write never waits for the imports (a pipe holds 64 KiB)
    box = []
    reader = threading.Thread(target=lambda: box.append(sys.stdin.buffer.readline()),
                              name="fastcomm-spare-stdin", daemon=True)
    reader.start()
    _import_warm()
    reader.join()
    line = box[0]
    if not line:
        sys.exit(0)
    job = json.loads(line)
    os.environ.clear()
    os.environ.update(job["env"])
    null = os.open(os.devnull, os.O_RDONLY)  # a worker's stdin, as the agent starts the others
    os.dup2(null, 0)
    os.close(null)
    return list(job["args"])


def main() -> None:
    """Parses ``[--spare] | [--server FD] | [--module|--exec] [--cpus LIST] -- TARGET ARGS...``;
    runs the target as above (``--spare``: the rest comes on stdin; ``--server``: each forked
    worker's comes on the socket)."""
    argv = sys.argv[1:]
    forked = len(argv) == 2 and argv[0] == "--server"
    if argv == ["--spare"]:
        argv = _spare()
    elif forked:
        argv = _serve(int(argv[1]))
    _start(argv, forked)


def _start(argv: list, forked: bool) -> None:
    """Runs ``[--module|--exec] [--cpus LIST] -- TARGET ARGS...`` (a forked worker: to its end,
    then :func:`_exit_forked`)."""
    try:
        split = argv.index("--")
    except ValueError:
        sys.stderr.write("usage: _bootstrap.py [--module|--exec] [--cpus LIST] -- TARGET ...\n")
        sys.exit(2)
    opts, target, args = argv[:split], argv[split + 1], argv[split + 2 :]
    if "--cpus" in opts:
        _bind_cpus(opts[opts.index("--cpus") + 1])
    pid_text = os.environ.pop(_settings().LAUNCH_AGENT_PID.name, "")
    agent_pid = int(pid_text) if pid_text.isdigit() else None
    if "--exec" in opts:
        _set_pdeathsig(signal.SIGKILL)
        _check_agent(agent_pid)
        try:
            os.execvp(target, [target, *args])
        except OSError as err:
            sys.stderr.write(f"[fastcomm-run] cannot execute {target!r}: {err}\n")
            sys.exit(127)
    _check_agent(agent_pid)
    if agent_pid is not None:
        threading.Thread(
            target=_watch, args=(agent_pid,), name="fastcomm-agent-watch", daemon=True
        ).start()
    if not forked:
        _run_to_end("--module" in opts, target, args)
        return
    try:
        _run_to_end("--module" in opts, target, args)
        code = 0
    except SystemExit as exc:
        code = _status(exc.code)
    _exit_forked(code)


def _run_to_end(module: bool, target: str, args: list) -> None:
    """Runs the target; an uncaught exception is printed, recorded, and exits 1."""
    try:
        _run_python(module, target, args)
    except SystemExit:
        raise
    except Exception as exc:  # what torch's @record records
        tb = _trim(exc.__traceback__)
        exc.__traceback__ = tb  # the default hook prints the exception's own traceback
        sys.excepthook(type(exc), exc, tb)
        try:
            sys.stderr.flush()
        except Exception:
            pass  # stderr is closed: nothing left to report to
        # Last: the agent treats the file's appearance as this worker's failure (and may stop
        # it while the interpreter tears down).
        _record(exc, tb)
        sys.exit(1)


def _status(code) -> int:
    """The exit status ``sys.exit(code)`` gives (a non-integer is printed; status 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        sys.stderr.write(f"{code}\n")
    except Exception:
        pass  # stderr is closed: the status still says it
    return 1


def _exit_forked(code: int) -> None:
    """A forked worker's exit: what the interpreter's exit does for the worker's own state --
    wait for its non-daemon threads, run its ``atexit`` callbacks, flush the files it left
    open, collect its garbage, flush the standard streams -- then ``os._exit``. The modules the
    server imported are not torn down: that costs about a second per worker and copies every
    page shared with the server (and the server froze them: ``gc.freeze``)."""
    import atexit
    import gc
    import io

    try:
        threading._shutdown()  # what the interpreter's exit waits for first
        atexit._run_exitfuncs()
        # Flushed before the collection: a file in a reference cycle may have its raw file
        # closed before its buffer is written when the cycle is collected.
        writers = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)
        for obj in gc.get_objects():  # the worker's own objects: the server's are frozen
            if issubclass(type(obj), writers):  # type(): a dead weak proxy raises on isinstance
                try:
                    if not obj.closed:
                        obj.flush()
                except Exception:
                    pass  # a broken pipe or a closed fd: nothing to keep
        gc.collect()  # the worker's garbage, and its finalizers
    except BaseException:  # as an interpreter's exit: printed, the status kept
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass  # closed: nothing left to write
        os._exit(code)


if __name__ == "__main__":
    main()
