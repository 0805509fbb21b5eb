"""The launcher's configuration (``LaunchConfig``) and the parsers of torchrun's flag syntaxes.

Everything here is plain Python (no torch import), so the command line is validated, and a
usage error reported, before anything starts.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

from fastcomm import settings

__all__ = [
    "LaunchConfig",
    "parse_nnodes",
    "parse_endpoint",
    "parse_rdzv_conf",
    "parse_std",
    "std_for",
    "read_job_secret",
    "check_seconds",
    "RDZV_CONF_KEYS",
    "RECOVER_MODES",
    "EVENT_LOG_HANDLERS",
    "RDZV_BACKENDS",
    "ETCD_DEFAULT_PORT",
    "parse_filters",
    "parse_etcd_endpoints",
]

#: The longest interval or timeout accepted (a year): ``inf`` or ``1e300`` seconds would only
#: overflow ``time.sleep``/``timedelta`` once the job runs.
MAX_SECONDS = 365 * 24 * 3600.0

#: The most workers one agent starts: past it a typo (``--nproc-per-node 100000000``) would fork
#: until the host runs out of memory or pids before anything reports it.
MAX_NPROC_PER_NODE = 4096

MIN_SECRET_BYTES = 16

# Std values of --redirects / --tee, as torch's ``Std``: which streams go to a file.
STD_NONE, STD_OUT, STD_ERR, STD_ALL = 0, 1, 2, 3

#: ``--rdzv-conf`` keys fastcomm-run understands (others are accepted with a warning, as torch's
#: handlers ignore keys they do not know; ``store_type`` other than ``tcp`` is refused).
RDZV_CONF_KEYS = {
    "join_timeout": "seconds an agent waits for a round to gather enough nodes (600)",
    "last_call_timeout": "seconds a round stays open for more nodes once MIN joined (30)",
    "close_timeout": "seconds the store host waits for the others at exit (30)",
    "read_timeout": "seconds one store operation may take (60)",
    "timeout": "alias of join_timeout (static backend spelling)",
    "is_host": "whether this agent serves the rendezvous store (auto)",
    "keep_alive_interval": "seconds between agent heartbeats (5)",
    "keep_alive_max_attempt": "missed heartbeats before a node is declared lost (3)",
    "store_type": "the rendezvous store: tcp only (torch's file store is refused)",
}

#: ``--rdzv-backend`` names: ``etcd-v2`` (torchrun's name) is read as ``etcd``.
RDZV_BACKENDS = ("static", "c10d", "etcd")
RDZV_ALIASES = {"etcd-v2": "etcd"}

#: etcd's client port, where an ``--rdzv-endpoint`` of the etcd backend names none.
ETCD_DEFAULT_PORT = 2379

#: ``--recover`` modes: today's restart of every worker, or the survivors going on in place.
RECOVER_MODES = ("restart", "in-process")

#: ``--start-method``: Python workers forked from the fork server (``fork`` is the same here: a
#: worker cannot fork from the agent's threads), or each a new interpreter (``spawn``).
START_METHODS = ("forkserver", "fork", "spawn")

#: ``--event-log-handler`` names: torch registers these three (``console`` logs every event as a
#: JSON line on stderr; the other two drop them); no other can be registered from a command line.
EVENT_LOG_HANDLERS = ("null", "console", "dynamic_rendezvous")

_CPU_LIST = re.compile(r"\d+(-\d+)?(,\d+(-\d+)?)*")

_TRUE = {"1", "true", "t", "yes", "y", "on"}
_FALSE = {"0", "false", "f", "no", "n", "off"}


def parse_nnodes(value: str) -> tuple[int, int]:
    """``"N"`` or ``"MIN:MAX"`` -> ``(min_nodes, max_nodes)``; raises ``ValueError``."""
    parts = str(value).strip().split(":")
    try:
        if len(parts) == 1:
            low = high = int(parts[0])
        elif len(parts) == 2:
            low, high = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise ValueError(f"--nnodes must be N or MIN:MAX, got {value!r}") from None
    if low < 1:
        raise ValueError(f"--nnodes: the minimum number of nodes must be >= 1, got {value!r}")
    if low > high:
        raise ValueError(f"--nnodes: MIN must be <= MAX, got {value!r} ({low} > {high})")
    return low, high


def parse_endpoint(value: str, default_port: int | None = None) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` for IPv6; the port may be left out if ``default_port``)."""
    text = str(value).strip()
    match = re.fullmatch(r"\[([^\]]+)\](?::(\d+))?|([^:\[\]]+)(?::(\d+))?", text)
    if not match:
        raise ValueError(f"rendezvous endpoint must be host:port, got {value!r}")
    host = match.group(1) or match.group(3)
    port_text = match.group(2) or match.group(4)
    if port_text is None:
        if default_port is None:
            raise ValueError(f"rendezvous endpoint {value!r} has no port (use host:port)")
        port = default_port
    else:
        port = int(port_text)
    if not 0 <= port < 65536:
        raise ValueError(f"rendezvous endpoint port must be in [0, 65535], got {port}")
    return host, port


def parse_etcd_endpoints(value: str) -> tuple[str, ...]:
    """``--rdzv-endpoint`` of the etcd backend: ``host[:port][,host[:port]...]`` (port 2379 where
    none is given) as a tuple of ``host:port``, duplicates dropped.

    Raises:
        ValueError: an empty list, or an item that is not ``host[:port]``.
    """
    items = [item.strip() for item in str(value or "").split(",")]
    if not any(items):
        raise ValueError(
            "--rdzv-backend etcd needs --rdzv-endpoint host:port[,host:port...] (the etcd "
            "members' client addresses)"
        )
    endpoints = []
    for item in items:
        text = item.removeprefix("http://").rstrip("/")
        if item.startswith("https://"):
            raise ValueError(f"--rdzv-endpoint {item!r}: TLS is not supported (use http://)")
        try:
            host, port = parse_endpoint(text, default_port=ETCD_DEFAULT_PORT)
        except ValueError:
            raise ValueError(
                f"--rdzv-endpoint {value!r}: {item!r} is not host:port (an etcd member's "
                "client address)"
            ) from None
        if port == 0:
            raise ValueError(f"--rdzv-endpoint {value!r}: {item!r} has port 0")
        endpoints.append(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    return tuple(dict.fromkeys(endpoints))


def parse_rdzv_conf(value: str) -> dict[str, str]:
    """``"k1=v1,k2=v2"`` -> dict (torch's syntax: every key needs a non-empty value)."""
    conf: dict[str, str] = {}
    text = (value or "").strip()
    if not text:
        return conf
    for item in text.split(","):
        key, sep, val = item.partition("=")
        key, val = key.strip(), val.strip()
        if not key or not sep or not val:
            raise ValueError(
                f"--rdzv-conf must be <key1>=<value1>,...,<keyN>=<valueN>, got {value!r}"
            )
        conf[key] = val
    return conf


def parse_std(value: str) -> int | dict[int, int]:
    """torchrun's ``--redirects``/``--tee`` syntax: ``0..3`` or ``LOCAL_RANK:V,...``."""
    text = str(value).strip()
    if re.fullmatch(r"[0-3]", text):
        return int(text)
    if re.fullmatch(r"\d+:[0-3](,\d+:[0-3])*", text):
        return {int(k): int(v) for k, v in (m.split(":") for m in text.split(","))}
    raise ValueError(
        f"{value!r} is neither 0-3 (0 none, 1 stdout, 2 stderr, 3 both) nor a mapping "
        "LOCAL_RANK:VALUE,... (e.g. 0:3,1:1)"
    )


def parse_filters(value: str) -> tuple[str, ...]:
    """torchrun's ``--duplicate-*-filters`` syntax: ``"a,b"`` -> ``("a", "b")``, ``",,"`` escapes
    a comma. Empty items are dropped (torch would match every line with them)."""
    items = str(value or "").replace(",,", "\0").split(",")
    return tuple(item.replace("\0", ",") for item in items if item)


def std_for(spec: int | dict[int, int], local_rank: int) -> int:
    """The Std value ``spec`` gives ``local_rank``."""
    if isinstance(spec, dict):
        return spec.get(local_rank, STD_NONE)
    return spec


def check_seconds(name: str, value: float) -> float:
    """``value`` if it is a number of seconds in ``(0, MAX_SECONDS]``.

    Raises:
        ValueError: naming ``name``: not a number, not finite (``inf``, ``nan``), zero or
            negative, or longer than a year.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number of seconds, got {value!r}")
    if not math.isfinite(value) or not 0 < value <= MAX_SECONDS:
        raise ValueError(
            f"{name} must be a finite number of seconds in (0, {MAX_SECONDS:.0f}], got {value}"
        )
    return float(value)


def conf_float(conf: dict[str, str], key: str, default: float) -> float:
    """The positive number ``conf[key]`` of ``--rdzv-conf``, or ``default`` if absent.

    Raises:
        ValueError: the value is not a positive, finite number (at most a year).
    """
    if key not in conf:
        return default
    try:
        value = float(conf[key])
    except ValueError:
        raise ValueError(f"--rdzv-conf {key} must be a number, got {conf[key]!r}") from None
    return check_seconds(f"--rdzv-conf {key}", value)


def read_job_secret(path: str | None, environ: Mapping[str, str]) -> tuple[bytes | None, str]:
    """The job secret: the file ``path`` (``--job-secret-file``), else ``$FASTCOMM_JOB_SECRET``
    (hex), else the file ``$FASTCOMM_JOB_SECRET_FILE``; the same rules as the workers' store.

    Returns:
        ``(secret, where it came from)``; ``(None, "")`` when none is given.

    Raises:
        ValueError: the file cannot be read, the variable is not hex, or the secret is shorter
            than 16 bytes.
    """
    from_env = None if path is not None else settings.JOB_SECRET.get(environ)
    if path is None and from_env is None:
        path = settings.JOB_SECRET_FILE.get(environ)
        flag = settings.JOB_SECRET_FILE.name
    else:
        flag = "--job-secret-file"
    if path is not None:
        try:
            with open(path, "rb") as fh:
                secret = fh.read().strip()
        except OSError as exc:
            raise ValueError(f"{flag}: cannot read {path!r}: {exc.strerror}") from None
        source = f"{flag} {path}"
    elif from_env is not None:
        secret, source = from_env, settings.JOB_SECRET.name
    else:
        return None, ""
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"{source}: the job secret must be at least {MIN_SECRET_BYTES} bytes, got {len(secret)}"
        )
    return secret, source


def conf_bool(conf: dict[str, str], key: str) -> bool | None:
    """The boolean ``conf[key]`` of ``--rdzv-conf``, or ``None`` if absent.

    Raises:
        ValueError: the value is not one of the accepted true/false spellings.
    """
    if key not in conf:
        return None
    text = conf[key].lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"--rdzv-conf {key} must be a boolean, got {conf[key]!r}")


@dataclass(kw_only=True, slots=True)
class LaunchConfig:
    """Everything one agent needs to run its node's share of a job.

    Built by :func:`fastcomm.launch.cli.parse_config` from the command line; construct it
    directly to launch from Python (``fastcomm.launch.agent.launch(config)``). Validation runs
    in ``__post_init__`` and raises ``ValueError`` with a message fit for a usage error.
    """

    entrypoint: str
    """The script (a path), the module (``module=True``) or the program (``no_python=True``)."""
    args: list[str] = field(default_factory=list)
    """Arguments of the entrypoint, passed through unchanged."""
    module: bool = False
    """Run ``entrypoint`` as ``python -m entrypoint``."""
    no_python: bool = False
    """Execute ``entrypoint`` directly instead of through ``python`` (no traceback recording)."""
    python: str = ""
    """Interpreter of the workers (default: ``$PYTHON_EXEC`` or this interpreter)."""
    min_nodes: int = 1
    """Nodes a round needs before it can start."""
    max_nodes: int = 1
    """Nodes a round admits at most (``MIN:MAX`` elastic when larger than ``min_nodes``)."""
    nproc_per_node: int = 1
    """Workers this agent starts (LOCAL_WORLD_SIZE)."""
    node_rank: int = 0
    """This node's GROUP_RANK with the static backend (ignored by c10d, which assigns it)."""
    rdzv_backend: str = "c10d"
    """``static`` (fixed node set, ranks from ``node_rank``), ``c10d`` (store-based rounds, the
    store served by one agent) or ``etcd`` (the same rounds in an etcd cluster: no agent serves
    anything, see ``etcd_job``)."""
    rdzv_endpoints: tuple[str, ...] = ()
    """With ``rdzv_backend="etcd"``: the etcd members' client addresses (``host:port``)."""
    rdzv_host: str = "127.0.0.1"
    """Host of the rendezvous store."""
    rdzv_port: int = 0
    """Port of the rendezvous store (``0``: standalone, a free port chosen by this agent)."""
    run_id: str = "none"
    """Job id (TORCHELASTIC_RUN_ID); namespaces the job's keys in the rendezvous store."""
    rdzv_conf: dict[str, str] = field(default_factory=dict)
    """``--rdzv-conf`` settings (see ``RDZV_CONF_KEYS``)."""
    is_host: bool | None = None
    """Serve the rendezvous store (``None``: when the endpoint is a local address)."""
    join_timeout: float = 600.0
    """Seconds to wait for a round to gather ``min_nodes`` (and for the store to be reachable)."""
    last_call_timeout: float = 30.0
    """Once ``min_nodes`` joined, seconds a round stays open for more (elastic ``MIN:MAX``)."""
    close_timeout: float = 30.0
    """Seconds the store host waits for the other agents to read the outcome at the end."""
    read_timeout: float = 60.0
    """Seconds one blocking store operation may take."""
    keep_alive_interval: float = 5.0
    """Seconds between heartbeats of an agent in a running round."""
    keep_alive_max_attempt: int = 3
    """Heartbeats missed before the other agents declare a node lost (a failure)."""
    max_restarts: int = 0
    """Failure restarts allowed (admitting a new node is not counted)."""
    recover: str = "restart"
    """What a lost worker costs: ``restart`` (every worker stopped and started again in a new
    round) or ``in-process`` (the loss is reported and the others go on: ``recovery``)."""
    min_ranks: int = 1
    """With ``recover="in-process"``: the fewest live ranks the job goes on with; below it
    (or below ``min_nodes`` nodes' worth of ranks) it stops with the failure report."""
    spare: bool = True
    """With ``recover="in-process"`` and ``max_restarts``: replacements start from a warm
    spare (``spare.py``); ``False`` (``--no-spare``): each starts as a new interpreter."""
    start_method: str = "forkserver"
    """How Python workers start: ``forkserver`` (or ``fork``) forks them from one interpreter
    per round that imported torch and fastcomm (``forkserver.py``); ``spawn`` starts each as a
    new interpreter (``--no-python`` workers and ``--numa-binding`` ones always are)."""
    monitor_interval: float = 0.1
    """Seconds between checks of the workers and of the store."""
    shutdown_timeout: float = 30.0
    """Seconds stopped workers get between the stop signal and SIGKILL."""
    role: str = "default"
    """ROLE_NAME of the workers."""
    master_addr: str | None = None
    """MASTER_ADDR for the workers (static backend); default: the address of GROUP_RANK 0."""
    local_addr: str | None = None
    """Address other nodes reach this one at (default: this host's FQDN)."""
    log_dir: str | None = None
    """Base directory of per-round logs and error files (default: a temporary directory)."""
    redirects: int | dict[int, int] = STD_NONE
    """Streams written only to files: 0 none, 1 stdout, 2 stderr, 3 both (or per local rank)."""
    tee: int | dict[int, int] = STD_NONE
    """Streams written both to files and (prefixed) to the console (same syntax)."""
    local_ranks_filter: set[int] | None = None
    """Local ranks whose output reaches the console (``None``: all)."""
    line_prefix_template: str | None = None
    """Console line prefix (``$rank``, ``$local_rank``, ``$role_name``); default ``[rank N]: ``."""
    duplicate_stdout_filters: tuple[str, ...] = ()
    """Substrings: a tee'd stdout line shown on the console that holds one of them is copied,
    prefixed, to ``<attempt dir>/filtered_stdout.log`` (all local ranks in one file)."""
    duplicate_stderr_filters: tuple[str, ...] = ()
    """The same for stderr (``filtered_stderr.log``)."""
    event_log_handler: str = "null"
    """Where torchelastic events go: ``console`` (JSON lines on stderr) or ``null``/
    ``dynamic_rendezvous`` (nowhere), as torch's registered handlers."""
    worker_cpus: tuple[str, ...] | None = None
    """Per local rank, the CPUs (sysfs list syntax, ``0-15,32-47``) the worker is bound to
    before it runs (``--numa-binding``); ``None``: not bound."""
    signals_to_handle: tuple[str, ...] = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    """Signals the agent catches and forwards to every worker."""
    virtual_local_rank: bool = False
    """LOCAL_RANK=0 and CUDA_VISIBLE_DEVICES narrowed to the worker's own device."""
    job_secret_file: str | None = None
    """File holding the job's secret (``--job-secret-file``), read when ``job_secret`` is unset."""
    job_secret: bytes | None = field(default=None, repr=False)
    """Key of the HMAC that signs every value read back from the stores (at least 16 bytes).
    ``None``: from ``job_secret_file`` or the environment; a single-node job makes a random one
    if none is given, a job of several nodes runs unsigned (JSON only) and says so."""

    def __post_init__(self) -> None:
        if not self.entrypoint:
            raise ValueError("the training script (or module/program) is missing")
        if self.module and self.no_python:
            raise ValueError("Don't use both the '--no-python' flag and the '--module' flag")
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise ValueError(
                f"nodes: need 1 <= MIN <= MAX, got MIN={self.min_nodes} MAX={self.max_nodes}"
            )
        if self.nproc_per_node < 1:
            raise ValueError(f"--nproc-per-node must be >= 1, got {self.nproc_per_node}")
        if self.nproc_per_node > MAX_NPROC_PER_NODE:
            raise ValueError(
                f"--nproc-per-node must be <= {MAX_NPROC_PER_NODE} (workers of one node), "
                f"got {self.nproc_per_node}"
            )
        self._check_rendezvous()
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.start_method not in START_METHODS:
            raise ValueError(
                f"--start-method must be one of {', '.join(START_METHODS)}, "
                f"got {self.start_method!r}"
            )
        if self.recover not in RECOVER_MODES:
            raise ValueError(
                f"--recover must be one of {', '.join(RECOVER_MODES)}, got {self.recover!r}"
            )
        if isinstance(self.min_ranks, bool) or not isinstance(self.min_ranks, int) or (
            self.min_ranks < 1
        ):
            raise ValueError(f"--min-ranks must be an int >= 1, got {self.min_ranks!r}")
        for name, flag in (
            ("monitor_interval", "--monitor-interval"),
            ("join_timeout", "--rdzv-conf join_timeout"),
            ("last_call_timeout", "--rdzv-conf last_call_timeout"),
            ("close_timeout", "--rdzv-conf close_timeout"),
            ("read_timeout", "--rdzv-conf read_timeout"),
            ("keep_alive_interval", "--rdzv-conf keep_alive_interval"),
            ("shutdown_timeout", "--shutdown-timeout"),
        ):
            setattr(self, name, check_seconds(f"{flag} ({name})", getattr(self, name)))
        if self.keep_alive_max_attempt < 1:
            raise ValueError("keep_alive_max_attempt must be >= 1")
        if not self.role:
            raise ValueError("--role must be non-empty")
        if not self.run_id:
            raise ValueError("--rdzv-id must be non-empty")
        if self.job_secret is not None and len(self.job_secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the job secret must be at least {MIN_SECRET_BYTES} bytes")
        for spec in (self.redirects, self.tee):
            values = spec.values() if isinstance(spec, dict) else [spec]
            if any(v not in (0, 1, 2, 3) for v in values):
                raise ValueError(f"--redirects/--tee values must be 0-3, got {spec!r}")
        self._check_outputs()
        import signal as _signal

        for name in self.signals_to_handle:
            if not isinstance(getattr(_signal, name, None), _signal.Signals):
                raise ValueError(f"--signals-to-handle: unknown signal {name!r}")
            if name in ("SIGKILL", "SIGSTOP"):
                raise ValueError(f"--signals-to-handle: {name} cannot be caught")
        if not self.python:
            self.python = os.environ.get("PYTHON_EXEC", sys.executable)

    def _check_rendezvous(self) -> None:
        """Validates the rendezvous backend, its endpoints and the node rank and port."""
        self.rdzv_backend = RDZV_ALIASES.get(self.rdzv_backend, self.rdzv_backend)
        if self.rdzv_backend not in RDZV_BACKENDS:
            raise ValueError(
                f"--rdzv-backend must be static, c10d or etcd (etcd-v2), got {self.rdzv_backend!r}"
            )
        if self.rdzv_backend == "etcd":
            if isinstance(self.rdzv_endpoints, str) or not self.rdzv_endpoints:
                raise ValueError(
                    "--rdzv-backend etcd needs --rdzv-endpoint host:port[,host:port...] (the "
                    f"etcd members' client addresses), got {self.rdzv_endpoints!r}"
                )
            self.rdzv_endpoints = tuple(self.rdzv_endpoints)
            if self.is_host is not None:
                raise ValueError(
                    "--rdzv-conf is_host: with --rdzv-backend etcd no agent serves the "
                    "rendezvous (it lives in the etcd cluster); leave is_host out"
                )
        elif self.rdzv_endpoints:
            raise ValueError(
                f"rdzv_endpoints are the etcd backend's; --rdzv-backend is {self.rdzv_backend}"
            )
        if self.rdzv_backend == "static":
            if self.min_nodes != self.max_nodes:
                raise ValueError(
                    "the static rendezvous backend needs a fixed --nnodes N "
                    "(use --rdzv-backend c10d for MIN:MAX)"
                )
            if not 0 <= self.node_rank < self.max_nodes:
                raise ValueError(
                    f"--node-rank must be in [0, {self.max_nodes}), got {self.node_rank}"
                )
            if self.rdzv_port == 0 and self.max_nodes > 1:
                raise ValueError("the static backend with several nodes needs a fixed port")
        if self.rdzv_port == 0 and self.max_nodes > 1 and self.rdzv_backend != "etcd":
            raise ValueError(
                "a job of several nodes needs --rdzv-endpoint host:port (port 0 is standalone)"
            )

    def _check_outputs(self) -> None:
        """Validates the event handler, the CPU binding and the duplicate filters."""
        if self.event_log_handler not in EVENT_LOG_HANDLERS:
            raise ValueError(
                f"--event-log-handler {self.event_log_handler!r}: torch registers only "
                f"{', '.join(EVENT_LOG_HANDLERS)} (torchrun fails on other names too); use "
                "console for the events as JSON lines on stderr"
            )
        if self.worker_cpus is not None:
            cpus = tuple(self.worker_cpus)
            if len(cpus) != self.nproc_per_node or not all(
                isinstance(c, str) and _CPU_LIST.fullmatch(c) for c in cpus
            ):
                raise ValueError(
                    f"worker_cpus must give a CPU list (e.g. '0-15,32') for each of the "
                    f"{self.nproc_per_node} local ranks, got {self.worker_cpus!r}"
                )
            self.worker_cpus = cpus
        for name, bit in (("stdout", STD_OUT), ("stderr", STD_ERR)):
            filters = getattr(self, f"duplicate_{name}_filters")
            if isinstance(filters, str) or not all(isinstance(f, str) and f for f in filters):
                raise ValueError(
                    f"--duplicate-{name}-filters must be non-empty strings, got {filters!r}"
                )
            filters = tuple(filters)
            setattr(self, f"duplicate_{name}_filters", filters)
            if filters and not self.duplicated_ranks(bit):
                raise ValueError(
                    f"--duplicate-{name}-filters {','.join(filters)!r} copies lines of the "
                    f"{name} the workers tee to the console (as torchrun), but no local rank "
                    f"does: add --tee {bit} (or 3) for a rank that --local-ranks-filter shows"
                )

    def duplicated_ranks(self, bit: int) -> list[int]:
        """Local ranks whose stream ``bit`` (``STD_OUT``/``STD_ERR``) is tee'd to the console:
        the lines ``--duplicate-*-filters`` look at (torch's ``tee_stdouts``/``tee_stderrs``)."""
        return [
            r
            for r in range(self.nproc_per_node)
            if std_for(self.tee, r) & bit
            and not std_for(self.redirects, r) & bit
            and (self.local_ranks_filter is None or r in self.local_ranks_filter)
        ]

    def replace(self, **changes) -> LaunchConfig:
        """A copy with the given fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @property
    def standalone(self) -> bool:
        """The store is this agent's own, on a free port (single node)."""
        return self.rdzv_port == 0 and self.rdzv_backend != "etcd"

    @property
    def heartbeat_limit(self) -> float:
        """Seconds without a heartbeat (or, on etcd, a kept lease) before an agent is lost."""
        return self.keep_alive_interval * self.keep_alive_max_attempt
