"""What the workers of a round are given: their environment, their specs, their folders.

The environment is torchrun's: the agent's own, plus ``OMP_NUM_THREADS=1`` (several workers),
the job secret, Gloo's interface (several nodes) and, per worker, the rank variables of the
round (with the etcd backend, ``FASTCOMM_STORE``: the round's store in etcd). Logs and error
files go under ``--log-dir``, else a temporary folder removed at exit.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import sys
import tempfile
from collections.abc import Callable

from fastcomm import settings

from .config import LaunchConfig, read_job_secret, std_for
from .errors import LaunchError, UsageError
from .forkserver import ForkServer
from .net import interface_of
from .rendezvous import RoundInfo
from .workers import BOOTSTRAP, WorkerSpec, line_prefix, pid_namespace, start_time

__all__ = ["RunDirs", "base_env", "fork_server", "job_secret", "worker_specs"]

Log = Callable[[str], None]


def job_secret(cfg: LaunchConfig, log: Log) -> bytes | None:
    """The secret signing the stores' values: the configured one, else a random one for a
    single node; a job of several nodes without one runs unsigned, and ``log`` says so."""
    secret = cfg.job_secret
    if secret is None:
        try:
            secret, _ = read_job_secret(cfg.job_secret_file, os.environ)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    if secret is None and cfg.max_nodes == 1:
        secret = secrets.token_bytes(32)
    elif secret is None:
        log(
            f"no job secret (--job-secret-file, ${settings.JOB_SECRET.name} or "
            f"${settings.JOB_SECRET_FILE.name}): store values are checked JSON but unsigned, "
            "so any process that reaches the stores' ports can forge them"
        )
    return secret


def base_env(cfg: LaunchConfig, log: Log, info: Log) -> tuple[dict[str, str], bytes | None]:
    """The workers' base environment (the agent's, plus what torchrun adds to its own) and the
    job secret it hands them (see ``job_secret``)."""
    env = dict(os.environ)
    if cfg.nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
        info("setting OMP_NUM_THREADS=1 for each worker (set it to override)")
        env["OMP_NUM_THREADS"] = "1"
    env["TORCHELASTIC_SIGNALS_TO_HANDLE"] = ",".join(cfg.signals_to_handle)
    if cfg.recover == "in-process":  # fastcomm DDP in the workers shrinks in place
        env[settings.RECOVER.name] = "in-process"
    secret = job_secret(cfg, log)
    env.pop(settings.JOB_SECRET_FILE.name, None)
    if secret is None:
        env.pop(settings.JOB_SECRET.name, None)
    else:
        env[settings.JOB_SECRET.name] = secret.hex()
    return env, secret


def set_gloo_interface(env: dict[str, str], cfg: LaunchConfig, listen: str, log: Log,
                       info: Log) -> None:
    """Has the workers' Gloo (fastcomm's and torch's) use the interface of ``listen``
    (``--local-addr``, or the address that routes to the rendezvous host) in a job of
    several nodes, unless ``GLOO_SOCKET_IFNAME`` is set already: by default Gloo binds
    the address the hostname resolves to, loopback under a Debian ``/etc/hosts``."""
    if cfg.max_nodes == 1 or env.get("GLOO_SOCKET_IFNAME"):
        return
    name = interface_of(listen)
    if name is None:
        log(f"no interface holds {listen}; Gloo picks its own (set GLOO_SOCKET_IFNAME)")
        return
    env["GLOO_SOCKET_IFNAME"] = name
    info(f"workers' Gloo uses interface {name} ({listen})")


def _rank_env(cfg: LaunchConfig, info: RoundInfo, local_rank: int, error_file: str
              ) -> dict[str, str]:
    """torchrun's per-worker variables for ``local_rank`` in round ``info``."""
    role_base, role_world = info.role_ranks(cfg.role)
    env = dict(
        RANK=str(info.rank_offset + local_rank),
        GROUP_RANK=str(info.group_rank),
        ROLE_RANK=str(role_base + local_rank),
        ROLE_NAME=cfg.role,
        LOCAL_WORLD_SIZE=str(cfg.nproc_per_node),
        WORLD_SIZE=str(info.world_size),
        GROUP_WORLD_SIZE=str(info.group_world_size),
        ROLE_WORLD_SIZE=str(role_world),
        MASTER_ADDR=info.master_addr,
        MASTER_PORT=str(info.master_port),
        TORCHELASTIC_RESTART_COUNT=str(info.restart_count),
        TORCHELASTIC_MAX_RESTARTS=str(cfg.max_restarts),
        TORCHELASTIC_RUN_ID=cfg.run_id,
        TORCHELASTIC_USE_AGENT_STORE="True",
        TORCH_NCCL_ASYNC_ERROR_HANDLING=os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        TORCHELASTIC_ERROR_FILE=error_file,
        LOCAL_RANK=str(local_rank),
    )
    if info.store_url is not None:
        # the job's store is in etcd: fastcomm.init() and (once fastcomm is imported) torch's
        # env:// take it from FASTCOMM_STORE; torch's env:// without fastcomm has worker rank 0
        # serve MASTER_ADDR:MASTER_PORT itself, as under torchrun's etcd backend
        env[settings.STORE.name] = info.store_url
        env["TORCHELASTIC_USE_AGENT_STORE"] = "False"
    if cfg.virtual_local_rank:
        env["LOCAL_RANK"] = "0"
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible else None
        if devices is not None and local_rank >= len(devices):
            raise LaunchError(f"local rank {local_rank} exceeds CUDA_VISIBLE_DEVICES={visible}")
        env["CUDA_VISIBLE_DEVICES"] = devices[local_rank].strip() if devices else str(local_rank)
    return env


def fork_server(cfg: LaunchConfig, env: dict[str, str]) -> ForkServer | None:
    """The fork server the Python workers start from (``--start-method forkserver``, the
    default), started at once so that its imports overlap the rendezvous; ``None`` where every
    worker starts as a new interpreter: ``spawn``, ``--no-python``, ``--numa-binding``, or a
    script whose text names neither torch nor fastcomm (nothing worth importing ahead)."""
    if cfg.start_method == "spawn":
        return None
    cmd = _command(cfg, 0)
    path = _module_file(cfg.entrypoint) if cfg.module else cfg.entrypoint
    if not ForkServer.usable(cmd, BOOTSTRAP) or not _names_torch(path):
        return None
    return ForkServer(cmd, BOOTSTRAP, env)


def _names_torch(path: str | None) -> bool:
    """Whether the source at `path` names torch or fastcomm (``None``: not known, so yes)."""
    if path is None:
        return True
    try:
        with open(path, "rb") as fh:
            text = fh.read(1 << 20)
    except OSError:
        return False  # the worker reports it
    return b"torch" in text or b"fastcomm" in text


def _module_file(name: str) -> str | None:
    """The source file ``python -m name`` runs, found without importing anything (``None``:
    not a source file found on the path)."""
    from importlib.machinery import PathFinder

    search = [os.getcwd(), *sys.path]
    parts = name.split(".")
    for i, part in enumerate(parts):
        spec = PathFinder.find_spec(part, search)
        if spec is None:
            return None
        if i == len(parts) - 1:
            if spec.submodule_search_locations:  # a package runs its __main__
                return _module_file_in(spec.submodule_search_locations)
            return spec.origin
        search = list(spec.submodule_search_locations or [])
    return None


def _module_file_in(locations) -> str | None:
    from importlib.machinery import PathFinder

    spec = PathFinder.find_spec("__main__", list(locations))
    return None if spec is None else spec.origin


def _command(cfg: LaunchConfig, local_rank: int) -> list[str]:
    """The worker's command line: the bootstrap, then the entrypoint and its arguments."""
    if cfg.no_python:
        base_cmd, mode = [cfg.python, BOOTSTRAP], ["--exec"]
    else:
        base_cmd, mode = [cfg.python, "-u", BOOTSTRAP], ["--module"] if cfg.module else []
    cpus = [] if cfg.worker_cpus is None else ["--cpus", cfg.worker_cpus[local_rank]]
    return [*base_cmd, *mode, *cpus, "--", cfg.entrypoint, *cfg.args]


def worker_specs(cfg: LaunchConfig, info: RoundInfo, env: dict[str, str], attempt: str
                 ) -> list[WorkerSpec]:
    """The specs of this node's workers in round ``info``, on base environment ``env``, with
    their logs and error files under the folder ``attempt``."""
    specs = []
    for local_rank in range(cfg.nproc_per_node):
        rank = info.rank_offset + local_rank
        log_dir = os.path.join(attempt, str(local_rank))
        error_file = os.path.join(log_dir, "error.json")
        shown = cfg.local_ranks_filter is None or local_rank in cfg.local_ranks_filter
        specs.append(
            WorkerSpec(
                local_rank=local_rank,
                rank=rank,
                cmd=_command(cfg, local_rank),
                env={**env, **_rank_env(cfg, info, local_rank, error_file),
                     # the flight recorder's dumps and hang report (fastcomm.trace)
                     settings.FLIGHT_DIR.name: settings.FLIGHT_DIR.get(env)
                     or os.path.join(attempt, "flight")},
                log_dir=log_dir,
                error_file=error_file,
                console_prefix=(
                    line_prefix(cfg.line_prefix_template, rank, local_rank, cfg.role)
                    if shown
                    else None
                ),
                redirect=std_for(cfg.redirects, local_rank),
                tee=std_for(cfg.tee, local_rank),
            )
        )
    return specs


def _any_std(spec) -> bool:
    return any(spec.values()) if isinstance(spec, dict) else bool(spec)


class RunDirs:
    """The folder of this run's attempts: under ``--log-dir``, else a temporary one that is
    removed at exit (unless it holds logs asked for by ``--redirects``/``--tee``).

    Args:
        cfg: the launch configuration.
        log: where to say where the logs go (``log(message, always=...)``).
    """

    def __init__(self, cfg: LaunchConfig, log: Callable[..., None]) -> None:
        self.cfg = cfg
        self.log = log
        self._base_dir: str | None = None
        self._run_dir: str | None = None

    @property
    def temporary(self) -> bool:
        """Whether the folder is removed at exit (a report must not point into it)."""
        return self._base_dir is not None

    def attempt(self, round_: int) -> str:
        """The folder of round ``round_``'s logs and error files."""
        return os.path.join(self.root(), f"attempt_{round_}")

    def root(self) -> str:
        """The folder of this run's attempts, made when the first workers start (so a launch
        that fails before leaves nothing behind)."""
        if self._run_dir is None:
            cfg = self.cfg
            try:
                if cfg.log_dir:
                    os.makedirs(cfg.log_dir, exist_ok=True)
                    prefix = cfg.run_id.replace(os.sep, "_") + "_"
                    self._run_dir = tempfile.mkdtemp(prefix=prefix, dir=cfg.log_dir)
                    self.log(f"logs and error files under {self._run_dir}", always=False)
                else:
                    sweep_stale_folders()
                    self._base_dir = tempfile.mkdtemp(prefix=_temp_prefix())
                    self._run_dir = self._base_dir
                    if _any_std(cfg.redirects) or _any_std(cfg.tee):
                        self.log(f"worker logs under {self._run_dir} (no --log-dir given)")
                        self._base_dir = None  # keep the logs the user asked for
            except OSError as exc:
                where = f"--log-dir {cfg.log_dir!r}" if cfg.log_dir else "the temporary folder"
                raise UsageError(f"cannot create a folder in {where}: {exc.strerror}") from None
        return self._run_dir

    def cleanup(self) -> None:
        """Removes the temporary folder of error files, whatever the outcome (the failure
        report carries their contents)."""
        if self._base_dir is not None:
            shutil.rmtree(self._base_dir, ignore_errors=True)
        self._base_dir = None


#: A launcher's temporary folder: ``fastcomm_launch_<pid namespace>-<pid>-<start time>_<random>``
TEMP_PATTERN = re.compile(r"fastcomm_launch_(\d+)-(\d+)-(\d+)_\w+")


def _temp_prefix() -> str:
    pid = os.getpid()
    return f"fastcomm_launch_{pid_namespace()}-{pid}-{start_time(pid) or 0}_"


def sweep_stale_folders(tmp: str | None = None) -> list[str]:
    """Removes the temporary folders that launchers killed without cleaning up (SIGKILL) left
    in ``tmp`` (default: the temporary directory); returns their paths.

    A folder is removed only when it is this user's, its launcher ran in this PID namespace and
    its pid now runs nothing or another process (a different start time).
    """
    tmp = tmp or tempfile.gettempdir()
    namespace, removed = pid_namespace(), []
    try:
        names = os.listdir(tmp)
    except OSError:
        return removed
    for name in names:
        match = TEMP_PATTERN.fullmatch(name)
        if match is None or not namespace or int(match[1]) != namespace or not int(match[3]):
            continue
        path = os.path.join(tmp, name)
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
        except OSError:
            continue
        if start_time(int(match[2])) != int(match[3]):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
