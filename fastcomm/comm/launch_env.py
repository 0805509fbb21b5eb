"""Who started this process, and where its rank sits: torchrun, srun, MPICH or Open MPI.

:func:`detect` reads the rank layout from the first launcher whose variables are present, in
this order: torchrun's (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, also set
by ``fastcomm-run``), srun's (``SLURM_PROCID`` ...), MPICH's (``PMI_RANK`` ...), Open MPI's
(``OMPI_COMM_WORLD_RANK`` ...). ``MASTER_ADDR``/``MASTER_PORT`` win over anything derived.
:func:`export_torchrun_env` writes torchrun's variables from another launcher's, so code that
reads them (torch's ``env://`` rendezvous behind ``init_process_group``) runs unchanged;
``import fastcomm`` calls it. No torch import: the launcher and the tests read this cheaply.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "LaunchEnv", "LaunchEnvError", "detect", "export_torchrun_env", "expand_hostlist",
    "expand_tasks_per_node", "missing_master", "read_master", "slurm_port",
]

logger = logging.getLogger("fastcomm")

TORCHRUN_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT")

SLURM_PORT_BASE = 20000
SLURM_PORT_SPAN = 40000


# what export_torchrun_env wrote into os.environ (with the launcher's own rank variable), and
# the layout it came from: detect() answers with that layout, its launcher named in messages,
# while the variables are unchanged
_EXPORTED: tuple[dict[str, str], LaunchEnv] | None = None
_RANK_KEY = {"srun": "SLURM_PROCID", "mpiexec (MPICH)": "PMI_RANK",
             "mpiexec (Open MPI)": "OMPI_COMM_WORLD_RANK"}


class LaunchEnvError(ValueError):
    """The launcher's variables are malformed or describe a layout that cannot be right."""


@dataclass(frozen=True, slots=True)
class LaunchEnv:
    """This process's place in the job, as its launcher's variables say."""

    launcher: str
    """``torchrun``, ``srun``, ``mpiexec (MPICH)``, ``mpiexec (Open MPI)`` or ``none``."""
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int | None
    """``None`` where the launcher does not say (then every rank is taken to be local)."""
    master_addr: str | None
    master_port: int | None
    source: str
    """The variables read, for messages: ``SLURM_PROCID=1, SLURM_NTASKS=4``."""

    def problem(self) -> str | None:
        """Why this layout cannot be right on its own, or ``None``."""
        if not 0 <= self.rank < self.world_size:
            return f"rank {self.rank} is outside a world of {self.world_size}"
        if self.local_world_size is None:
            return None
        if not 0 <= self.local_rank < self.local_world_size:
            return (f"local rank {self.local_rank} is outside its host's "
                    f"{self.local_world_size} local rank(s)")
        if self.local_world_size > self.world_size:
            return (f"{self.local_world_size} local rank(s) on one host but a world of "
                    f"{self.world_size}")
        return None

    def check(self) -> None:
        """Raises :class:`LaunchEnvError` naming the variables when :meth:`problem` finds one."""
        why = self.problem()
        if why is not None:
            raise LaunchEnvError(f"{self.launcher} layout cannot be right: {why} ({self.source})")

    def describe(self) -> str:
        """``srun: rank 1 of 4, local rank 1 of 2 (SLURM_PROCID=1, ...)``."""
        local = "?" if self.local_world_size is None else self.local_world_size
        return (f"{self.launcher}: rank {self.rank} of {self.world_size}, local rank "
                f"{self.local_rank} of {local} ({self.source})")

    def torchrun_env(self) -> dict[str, str]:
        """torchrun's variables for this layout (the master only where known)."""
        env = {
            "RANK": str(self.rank), "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
        }
        if self.local_world_size is not None:
            env["LOCAL_WORLD_SIZE"] = str(self.local_world_size)
        if self.master_addr is not None:
            env["MASTER_ADDR"] = self.master_addr
        if self.master_port is not None:
            env["MASTER_PORT"] = str(self.master_port)
        return env


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int | None:
    value = env.get(name, "").strip()
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise LaunchEnvError(f"environment variable {name}={value!r} is not an integer") from None


def _first(env: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    for name in names:
        if env.get(name, "").strip():
            return name, env[name].strip()
    return None


def read_master(env: Mapping[str, str]) -> tuple[str | None, int | None]:
    """``(MASTER_ADDR, MASTER_PORT)``, each ``None`` where unset."""
    return env.get("MASTER_ADDR") or None, _int(env, "MASTER_PORT")


def _shown(env: Mapping[str, str], names: tuple[str, ...]) -> str:
    return ", ".join(f"{n}={env[n]}" for n in names if n in env)


def _torchrun(env: Mapping[str, str]) -> LaunchEnv:
    world = _int(env, "WORLD_SIZE", 1)
    rank = _int(env, "RANK", 0 if world == 1 else None)
    if rank is None:
        raise LaunchEnvError(
            f"environment variable RANK is not set but WORLD_SIZE={world} (launch with "
            "fastcomm-run, torchrun, srun or mpiexec)"
        )
    addr, port = read_master(env)
    return LaunchEnv(
        "torchrun", rank, world, _int(env, "LOCAL_RANK", 0), _int(env, "LOCAL_WORLD_SIZE"),
        addr, port, _shown(env, TORCHRUN_KEYS[:4]),
    )


def _srun(env: Mapping[str, str]) -> LaunchEnv:
    """srun's task: the step's variables where present, else the job's."""
    names = ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_LOCALID",
             "SLURM_NODEID", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
             "SLURM_NTASKS_PER_NODE", "SLURM_STEP_ID")
    rank = _int(env, "SLURM_PROCID")
    count = _first(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
    world = _int(env, count[0])
    per_node = _first(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
                      "SLURM_NTASKS_PER_NODE")
    local_world = None
    if per_node is not None:
        counts = expand_tasks_per_node(per_node[1])
        node = _int(env, "SLURM_NODEID", 0 if len(counts) == 1 else None)
        if node is None:
            raise LaunchEnvError(
                f"{per_node[0]}={per_node[1]} lists several nodes but SLURM_NODEID is not set"
            )
        if not 0 <= node < len(counts):
            raise LaunchEnvError(
                f"SLURM_NODEID={node} is outside {per_node[0]}={per_node[1]} "
                f"({len(counts)} node(s))"
            )
        local_world = counts[node]
    addr, port = read_master(env)
    if addr is None:
        nodes = _first(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
        if nodes is not None:
            addr = expand_hostlist(nodes[1])[0]
    if port is None:
        job = _int(env, "SLURM_JOB_ID", _int(env, "SLURM_JOBID"))
        if job is not None:
            port = slurm_port(job, _int(env, "SLURM_STEP_ID", _int(env, "SLURM_STEPID", 0)))
    return LaunchEnv(
        "srun", rank, world, _int(env, "SLURM_LOCALID", 0), local_world, addr, port,
        _shown(env, names),
    )


def _mpi(env: Mapping[str, str], launcher: str, names: tuple[str, str, str, str]) -> LaunchEnv:
    rank_name, size_name, local_name, local_size_name = names
    world = _int(env, size_name, 1)
    local_world = _int(env, local_size_name)
    addr, port = read_master(env)
    if addr is None and local_world is not None and local_world == world:
        addr = "127.0.0.1"  # every rank on this host: loopback is the one address all share
    return LaunchEnv(
        launcher, _int(env, rank_name), world, _int(env, local_name, 0), local_world, addr,
        port, _shown(env, names),
    )


MPICH_KEYS = ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
OPENMPI_KEYS = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE")


def detect(env: Mapping[str, str] | None = None) -> LaunchEnv:
    """This process's layout from its launcher's variables (see the module docstring).

    Args:
        env: the environment to read (default ``os.environ``).

    Raises:
        LaunchEnvError: a variable is not an integer, a list does not parse, or ``RANK`` is
            missing where ``WORLD_SIZE`` > 1.
    """
    if env is None:
        env = os.environ
        if _EXPORTED is not None and all(env.get(k) == v for k, v in _EXPORTED[0].items()):
            return _EXPORTED[1]
    if "RANK" in env or "WORLD_SIZE" in env:
        return _torchrun(env)
    if env.get("SLURM_PROCID", "").strip() and _first(
        env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"
    ):
        return _srun(env)
    if env.get("OMPI_COMM_WORLD_RANK", "").strip():
        return _mpi(env, "mpiexec (Open MPI)", OPENMPI_KEYS)
    if env.get("PMI_RANK", "").strip() and env.get("PMI_SIZE", "").strip():
        return _mpi(env, "mpiexec (MPICH)", MPICH_KEYS)
    local_rank = _int(env, "LOCAL_RANK", 0)
    addr, port = read_master(env)
    return LaunchEnv("none", 0, 1, local_rank, _int(env, "LOCAL_WORLD_SIZE"), addr, port, "")


def missing_master(launch: LaunchEnv) -> str | None:
    """Why a multi-rank job cannot find its rendezvous, or ``None`` when it can."""
    if launch.world_size == 1 or (launch.master_addr and launch.master_port is not None):
        return None
    missing = [n for n, v in (("MASTER_ADDR", launch.master_addr),
                              ("MASTER_PORT", launch.master_port)) if v is None]
    how = {
        "srun": "srun derives them from SLURM_JOB_NODELIST and SLURM_JOB_ID",
        "torchrun": "fastcomm-run and torchrun set them",
    }.get(launch.launcher, "set them for every rank, e.g. `MASTER_ADDR=host0 MASTER_PORT=29500 "
                           "mpiexec -n 4 python train.py` (Open MPI: add `-x MASTER_ADDR -x "
                           "MASTER_PORT`)")
    return (f"{launch.describe()}: {' and '.join(missing)} not set, so the ranks cannot find "
            f"the rendezvous store; {how}")


def export_torchrun_env(env: os._Environ | dict | None = None) -> LaunchEnv | None:
    """Writes torchrun's variables from srun's, MPICH's or Open MPI's where torchrun's are
    absent, keeping every variable already set; returns the layout exported, or ``None``.

    Malformed variables export nothing here: ``fastcomm.init()`` raises on them.
    """
    global _EXPORTED
    process = env is None
    env = os.environ if env is None else env
    try:
        launch = detect(env)
    except LaunchEnvError:
        return None  # fastcomm.init() and the torch backend raise it with the rank's context
    if launch.launcher in ("torchrun", "none"):
        return None
    for key, value in launch.torchrun_env().items():
        env.setdefault(key, value)
    if process:
        own = _RANK_KEY[launch.launcher]
        _EXPORTED = ({own: env[own], **{k: env[k] for k in TORCHRUN_KEYS if k in env}}, launch)
    if launch.launcher == "srun" and not (env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")):
        logger.warning(
            "fastcomm: SLURM_NTASKS=%s but no SLURM_STEP_ID: this process was not started by "
            "srun (a batch script?), yet fastcomm waits for %d ranks; start it with `srun "
            "python ...`", env.get("SLURM_NTASKS", "?"), launch.world_size,
        )
    return launch


def slurm_port(job_id: int, step_id: int = 0) -> int:
    """The rendezvous port of a SLURM job step when ``MASTER_PORT`` is unset: one number every
    task derives alike, different for the steps of one job."""
    return SLURM_PORT_BASE + (job_id * 16 + step_id) % SLURM_PORT_SPAN


_TASKS = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def expand_tasks_per_node(text: str) -> list[int]:
    """SLURM's compressed task counts per node: ``2(x3),1`` -> ``[2, 2, 2, 1]``.

    Raises:
        LaunchEnvError: an item is neither ``N`` nor ``N(xM)``.
    """
    counts: list[int] = []
    for item in text.split(","):
        m = _TASKS.match(item.strip())
        if m is None:
            raise LaunchEnvError(
                f"task count list {text!r}: {item!r} is neither N nor N(xM), e.g. 2(x3),1"
            )
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def _split_top(text: str) -> list[str]:
    """``a[1-2],b`` -> ``["a[1-2]", "b"]``: commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _expand_range(item: str, text: str) -> list[str]:
    """``01-03`` -> ``["01", "02", "03"]`` (zero padding kept), ``7`` -> ``["7"]``."""
    lo, sep, hi = item.partition("-")
    if not lo.isdigit() or (sep and not hi.isdigit()):
        raise LaunchEnvError(f"host list {text!r}: {item!r} is not N or N-M inside brackets")
    if not sep:
        return [lo]
    if int(hi) < int(lo):
        raise LaunchEnvError(f"host list {text!r}: range {item!r} runs backwards")
    width = len(lo)
    return [str(n).zfill(width) for n in range(int(lo), int(hi) + 1)]


def _expand_one(name: str, text: str) -> list[str]:
    """One host pattern, every bracket group expanded: ``r[1-2]n[1,3]`` -> 4 names."""
    open_at = name.find("[")
    if open_at < 0:
        if "]" in name:
            raise LaunchEnvError(f"host list {text!r}: unbalanced ']' in {name!r}")
        return [name]
    close_at = name.find("]", open_at)
    if close_at < 0:
        raise LaunchEnvError(f"host list {text!r}: unbalanced '[' in {name!r}")
    head, body, tail = name[:open_at], name[open_at + 1:close_at], name[close_at + 1:]
    numbers = [n for item in body.split(",") for n in _expand_range(item.strip(), text)]
    return [head + n + rest for n in numbers for rest in _expand_one(tail, text)]


def expand_hostlist(text: str) -> list[str]:
    """SLURM's compressed host list: ``node[01-04,07]`` -> ``node01 ... node04, node07``.

    Several bracket groups (``rack[1-2]-n[1-2]``) and several patterns (``a[1-2],b``) expand
    in order.

    Raises:
        LaunchEnvError: unbalanced brackets, a range that is not ``N-M``, or an empty list.
    """
    hosts = [h for part in _split_top(text.strip()) if part
             for h in _expand_one(part.strip(), text)]
    if not hosts:
        raise LaunchEnvError(f"host list {text!r} names no host")
    return hosts
