"""Command line of ``fastcomm-run`` / ``python -m fastcomm.launch`` (torchrun's flags).

Every flag has torchrun's spellings (``--nproc-per-node`` and ``--nproc_per_node``) and reads
its default from the ``PET_<NAME>`` environment variable as torchrun does. The command line is
fully validated before anything starts: a bad flag or value prints one usage error line (no
traceback) and exits with status 2. No flag is accepted and then ignored: each does what
torchrun 2.13 does, or a value fastcomm-run cannot honour is refused with a usage error that
names the flag, the value and what to do instead (the list: docs/launch.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid

from fastcomm import settings

from .config import (
    EVENT_LOG_HANDLERS,
    RDZV_ALIASES,
    RDZV_BACKENDS,
    RDZV_CONF_KEYS,
    RECOVER_MODES,
    START_METHODS,
    LaunchConfig,
    check_seconds,
    conf_bool,
    conf_float,
    parse_endpoint,
    parse_etcd_endpoints,
    parse_filters,
    parse_nnodes,
    parse_rdzv_conf,
    parse_std,
    read_job_secret,
)
from .net import is_local_address, is_wildcard
from .numa import NUMA_MODES, worker_cpus

__all__ = ["main", "get_parser", "parse_config"]

PROG = "fastcomm-run"


class _Env(argparse.Action):
    """A valued flag whose default comes from ``PET_<DEST>`` (torch's ``argparse_util.env``)."""

    def __init__(self, dest, default=None, required=False, **kwargs) -> None:
        default = os.environ.get(f"PET_{dest.upper()}", default)
        if default:
            required = False
        super().__init__(dest=dest, default=default, required=required, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)


class _CheckEnv(argparse.Action):
    """A boolean flag that ``PET_<DEST>=1`` turns on (torch's ``argparse_util.check_env``)."""

    def __init__(self, dest, default=False, **kwargs) -> None:
        raw = os.environ.get(f"PET_{dest.upper()}", "1" if default else "0")
        try:
            default = bool(int(raw))
        except ValueError:
            default = raw.strip().lower() in ("true", "yes", "on")
        super().__init__(dest=dest, const=True, default=default, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, True)


def _opt(parser, *names, action=_Env, **kwargs):
    """Adds a flag under ``names`` and, for each dashed long name, its underscore spelling too
    (torchrun accepts ``--nproc-per-node`` and ``--nproc_per_node`` alike)."""
    spellings = []
    for name in names:
        spellings.append(name)
        if name.startswith("--") and "-" in name[2:]:
            spellings.append("--" + name[2:].replace("-", "_"))
    parser.add_argument(*spellings, action=action, **kwargs)


def get_parser() -> argparse.ArgumentParser:
    """The argument parser of ``fastcomm-run``: torchrun's flags, in both spellings."""
    p = argparse.ArgumentParser(
        prog=PROG,
        description="fastcomm's elastic launcher: torchrun-compatible, recovers from worker "
        "failures (one agent per node, rendezvous through a TCP store).",
    )
    _add_job_flags(p)
    _add_output_flags(p)
    _add_node_flags(p)
    p.add_argument("training_script", help="the script (or module, or program) to run")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return p


def _add_job_flags(p: argparse.ArgumentParser) -> None:
    """Nodes, rendezvous, restarts and monitoring, how the script runs."""
    _opt(p, "--nnodes", default="1:1", help="number of nodes, or MIN:MAX (elastic)")
    _opt(p, "--nproc-per-node", default="1",
         help="workers per node: an int, or cpu, gpu, xpu, auto")
    # rendezvous
    _opt(p, "--rdzv-backend", default="static",
         help="static, c10d or etcd (etcd-v2): etcd keeps the rendezvous and the job's store "
         "in an etcd cluster, so no node serves anything")
    _opt(p, "--rdzv-endpoint", default="",
         help="host:port of the rendezvous store (served by the agent on that host); with "
         "etcd, the members' client addresses host:port[,host:port...]")
    _opt(p, "--rdzv-id", default="none", help="job id (TORCHELASTIC_RUN_ID)")
    _opt(p, "--rdzv-conf", default="",
         help="k=v,... (join_timeout, last_call_timeout, close_timeout, read_timeout, "
         "is_host, keep_alive_interval, keep_alive_max_attempt)")
    _opt(p, "--standalone", action=_CheckEnv,
         help="single node: serve the rendezvous store on a free loopback port")
    # restarts and monitoring
    _opt(p, "--max-restarts", type=int, default=0,
         help="failure restarts of the worker group before giving up")
    _opt(p, "--recover", default="restart", choices=list(RECOVER_MODES),
         help="what a lost worker costs: restart (every worker starts again, the default) or "
         "in-process (the loss is reported, the others go on; fastcomm DDP shrinks in place)")
    _opt(p, "--min-ranks", type=int, default=1,
         help="with --recover in-process: the fewest live ranks the job goes on with")
    _opt(p, "--no-spare", action=_CheckEnv,
         help="with --recover in-process --max-restarts N: start a replacement as a new "
         "interpreter instead of warm (forked, or under --start-method spawn from a spare: an "
         "idle interpreter with torch imported)")
    _opt(p, "--monitor-interval", type=float, default=0.1,
         help="seconds between checks of the workers")
    _opt(p, "--start-method", default="forkserver", choices=list(START_METHODS),
         help="how Python workers start: forkserver (the default; fork is the same) forks them "
         "from one interpreter that imported torch and fastcomm once; spawn starts each as a "
         "new interpreter (for a script that sets torch's import-time variables itself)")
    _opt(p, "--event-log-handler", default="null",
         help=f"where torchelastic events go: {', '.join(EVENT_LOG_HANDLERS)} (console: JSON "
         "lines on stderr)")
    _opt(p, "--role", default="default", help="ROLE_NAME of the workers")
    # how the script runs
    _opt(p, "-m", "--module", action=_CheckEnv, help="run the script as a module (python -m)")
    _opt(p, "--no-python", action=_CheckEnv,
         help="execute the script directly, not through python")
    _opt(p, "--run-path", action=_CheckEnv,
         help="run the script with runpy.run_path (in a new interpreter); takes precedence "
         "over --no-python")


def _add_output_flags(p: argparse.ArgumentParser) -> None:
    """Where the workers' output and logs go."""
    _opt(p, "--log-dir", default=None,
         help="base directory of logs and error files (<run_id>_<random>/attempt_<round>/"
         "<local_rank>/{stdout,stderr}.log, error.json)")
    _opt(p, "-r", "--redirects", default="0",
         help="streams to files only: 0 none, 1 stdout, 2 stderr, 3 both, or 0:3,1:1,...")
    _opt(p, "-t", "--tee", default="0", help="streams to files and the console (same syntax)")
    _opt(p, "--local-ranks-filter", default="",
         help="local ranks whose output is shown on the console (e.g. 0,1)")
    _opt(p, "--duplicate-stdout-filters", default="",
         help="comma-separated substrings (,, escapes a comma): tee'd stdout lines holding one "
         "are copied to <attempt dir>/filtered_stdout.log")
    _opt(p, "--duplicate-stderr-filters", default="",
         help="the same for stderr (filtered_stderr.log)")


def _add_node_flags(p: argparse.ArgumentParser) -> None:
    """Static rendezvous and addresses, unsupported plugins, signals, the job secret."""
    _opt(p, "--node-rank", type=int, default=0, help="this node's rank (static backend)")
    _opt(p, "--master-addr", default="127.0.0.1",
         help="address of node 0 (static backend without --rdzv-endpoint)")
    _opt(p, "--master-port", type=int, default=None,
         help="rendezvous port on node 0 (static backend; default 29500)")
    _opt(p, "--local-addr", default=None,
         help="address of this machine the other nodes reach it at; its stores listen there "
         "(default: 127.0.0.1 for a single node, else the address that routes to the "
         "rendezvous host)")
    _opt(p, "--logs-specs", action="store", default=None,
         help="not supported: no torchrun.logs_specs plugin is loaded (use --log-dir, "
         "--redirects, --tee)")
    _opt(p, "--numa-binding", action="store", default=None, choices=NUMA_MODES,
         help="bind each worker to the CPUs near its GPU cuda:LOCAL_RANK (needs CUDA)")
    # signals
    _opt(p, "--signals-to-handle", default="SIGTERM,SIGINT,SIGHUP,SIGQUIT",
         help="signals the launcher forwards to the workers")
    _opt(p, "--shutdown-timeout", type=float, default=None,
         help="seconds between SIGTERM (or the signal received) and SIGKILL, for workers "
         "and for what a worker leaves running when it exits (default "
         "$TORCH_ELASTIC_SHUTDOWN_TIMEOUT or 30, as torchrun)")
    _opt(p, "--virtual-local-rank", action=_CheckEnv,
         help="LOCAL_RANK=0, CUDA_VISIBLE_DEVICES narrowed to the worker's device")
    # security
    _opt(p, "--job-secret-file", default=None,
         help="file whose contents (at least 16 bytes) sign every value the launcher and the "
         f"workers read back from the stores; every node must name the same contents "
         f"(or set ${settings.JOB_SECRET.name} in hex, or ${settings.JOB_SECRET_FILE.name}). "
         "A single node makes a random secret when none is given; several nodes without one "
         "run unsigned (JSON only)")


def _nproc(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        pass  # not a count: one of the names below
    if value == "cpu":
        return (
            len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity")
            else (os.cpu_count() or 1)
        )
    import torch  # only for device counts

    if value == "gpu":
        if not torch.cuda.is_available():
            raise ValueError("--nproc-per-node gpu: CUDA is not available")
        return torch.cuda.device_count()
    if value == "xpu":
        if not (hasattr(torch, "xpu") and torch.xpu.is_available()):
            raise ValueError("--nproc-per-node xpu: XPU is not available")
        return torch.xpu.device_count()
    if value == "auto":
        if torch.cuda.is_available():
            return torch.cuda.device_count()
        return _nproc("cpu")
    raise ValueError(f"--nproc-per-node must be an int, cpu, gpu, xpu or auto, got {value!r}")


def _warn(message: str) -> None:
    print(f"[{PROG}] warning: {message}", file=sys.stderr, flush=True)


def parse_config(args: argparse.Namespace) -> LaunchConfig:
    """Turns parsed flags into a ``LaunchConfig`` (``ValueError`` on an invalid combination)."""
    min_nodes, max_nodes = parse_nnodes(args.nnodes)
    conf = parse_rdzv_conf(args.rdzv_conf)
    backend, host, port, run_id = _rendezvous(args, max_nodes)
    endpoints = parse_etcd_endpoints(args.rdzv_endpoint) if backend == "etcd" else ()
    _warn_unused_addresses(args, backend)
    _check_rdzv_conf(conf, backend)
    _check_unsupported(args)
    ranks_filter = _ranks_filter(args.local_ranks_filter)
    shutdown = _shutdown_timeout(args.shutdown_timeout)
    check_seconds("--monitor-interval", args.monitor_interval)
    check_seconds("--shutdown-timeout", shutdown)
    if args.log_dir is not None:
        _check_log_dir(args.log_dir)
    if args.local_addr is not None:
        _check_local_addr(args.local_addr)
    secret, _ = read_job_secret(args.job_secret_file, os.environ)
    signals = tuple(s.strip() for s in args.signals_to_handle.split(",") if s.strip())
    no_python = _no_python(args)
    keep_alive = conf.get("keep_alive_max_attempt", "3")
    try:
        keep_alive_max_attempt = int(keep_alive)
    except ValueError:
        raise ValueError(f"keep_alive_max_attempt must be an int, got {keep_alive!r}") from None
    join_timeout = conf_float(conf, "join_timeout", conf_float(conf, "timeout", 600.0))
    nproc = _nproc(args.nproc_per_node)
    cpus = None if args.numa_binding is None else worker_cpus(args.numa_binding, nproc)
    return LaunchConfig(
        entrypoint=args.training_script,
        args=list(args.training_script_args),
        module=args.module,
        no_python=no_python,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=nproc,
        node_rank=args.node_rank,
        rdzv_backend=backend,
        rdzv_endpoints=endpoints,
        rdzv_host=host,
        rdzv_port=port,
        run_id=run_id,
        rdzv_conf=conf,
        is_host=conf_bool(conf, "is_host"),
        join_timeout=join_timeout,
        last_call_timeout=conf_float(conf, "last_call_timeout", 30.0),
        close_timeout=conf_float(conf, "close_timeout", 30.0),
        read_timeout=conf_float(conf, "read_timeout", 60.0),
        keep_alive_interval=conf_float(conf, "keep_alive_interval", 5.0),
        keep_alive_max_attempt=keep_alive_max_attempt,
        max_restarts=args.max_restarts,
        recover=args.recover,
        min_ranks=args.min_ranks,
        spare=not args.no_spare,
        start_method=args.start_method,
        monitor_interval=args.monitor_interval,
        shutdown_timeout=float(shutdown),
        role=args.role,
        master_addr=host if backend == "static" else None,
        local_addr=args.local_addr,
        log_dir=args.log_dir,
        redirects=parse_std(args.redirects),
        tee=parse_std(args.tee),
        local_ranks_filter=ranks_filter,
        line_prefix_template=os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE") or None,
        duplicate_stdout_filters=parse_filters(args.duplicate_stdout_filters),
        duplicate_stderr_filters=parse_filters(args.duplicate_stderr_filters),
        event_log_handler=args.event_log_handler,
        worker_cpus=cpus,
        signals_to_handle=signals,
        virtual_local_rank=args.virtual_local_rank,
        job_secret_file=args.job_secret_file,
        job_secret=secret,
    )


def _rendezvous(args: argparse.Namespace, max_nodes: int) -> tuple[str, str, int, str]:
    """``(backend, host, port, run id)`` of the rendezvous: ``--standalone`` and a single node
    without an endpoint get a c10d store on a free local port, as torchrun."""
    backend = RDZV_ALIASES.get(args.rdzv_backend, args.rdzv_backend)
    endpoint = args.rdzv_endpoint
    run_id = args.rdzv_id
    if backend not in RDZV_BACKENDS:
        raise ValueError(
            f"--rdzv-backend must be static, c10d or etcd (etcd-v2), got {args.rdzv_backend!r}"
        )
    if backend == "etcd":
        if args.standalone:
            raise ValueError(
                "--standalone serves the rendezvous on this node; it contradicts "
                "--rdzv-backend etcd (give one or the other)"
            )
        host, port = parse_endpoint(parse_etcd_endpoints(endpoint)[0])
        return backend, host, port, run_id
    if args.standalone:
        if max_nodes > 1:
            raise ValueError(
                f"--standalone runs a single node; it contradicts --nnodes {args.nnodes}"
            )
        backend, endpoint, run_id = "c10d", "localhost:0", str(uuid.uuid4())
    elif (
        backend == "static"
        and not endpoint
        and args.master_port is None
        and max_nodes == 1
        and args.node_rank == 0  # else static, so --node-rank 1 of 1 node is refused
    ):
        backend, endpoint, run_id = "c10d", "localhost:0", str(uuid.uuid4())
    elif backend == "c10d" and not endpoint:
        if max_nodes > 1:
            raise ValueError("--rdzv-backend c10d with several nodes needs --rdzv-endpoint")
        endpoint = "localhost:0"
    master_port = 29500 if args.master_port is None else args.master_port
    if not 0 <= master_port < 65536:
        raise ValueError(f"--master-port must be in [0, 65535], got {master_port}")
    if backend == "static" and not args.master_addr:
        raise ValueError("--master-addr must be non-empty")
    if backend == "static" and not endpoint:
        endpoint = f"{args.master_addr}:{master_port}"
    host, port = parse_endpoint(endpoint, default_port=29400 if backend == "c10d" else None)
    return backend, host, port, run_id


def _check_rdzv_conf(conf: dict[str, str], backend: str) -> None:
    """Warns of ``--rdzv-conf`` keys fastcomm-run does not read; refuses a non-TCP store (and,
    with etcd, any ``store_type``: the store is the etcd cluster)."""
    for key in conf:
        if key not in RDZV_CONF_KEYS:
            _warn(
                f"--rdzv-conf key {key!r} is not one fastcomm-run reads "
                f"({', '.join(RDZV_CONF_KEYS)}); ignored, as torch's rendezvous ignores keys"
            )
    if backend == "etcd" and "store_type" in conf:
        raise ValueError(
            f"--rdzv-conf store_type={conf['store_type']}: with --rdzv-backend etcd the "
            "rendezvous and the job's store live in the etcd cluster; leave store_type out"
        )
    if conf.get("store_type", "tcp").strip().lower() != "tcp":
        raise ValueError(
            f"--rdzv-conf store_type={conf['store_type']}: fastcomm-run's rendezvous store is "
            "a TCP store at --rdzv-endpoint (store_type=tcp); torch's file store is not supported"
        )


def _check_unsupported(args: argparse.Namespace) -> None:
    """Refuses ``--logs-specs``; checks ``--run-path``."""
    if args.logs_specs is not None:
        raise ValueError(
            f"--logs-specs {args.logs_specs!r}: fastcomm-run loads no torchrun.logs_specs "
            "plugin; it writes worker logs to <log-dir>/<run id>_*/attempt_<round>/<local rank>/"
            "{stdout,stderr}.log as --log-dir, --redirects, --tee and --local-ranks-filter say"
        )
    _check_start(args)


def _ranks_filter(text: str) -> set[int] | None:
    """``--local-ranks-filter``: ``"0,1"`` -> ``{0, 1}``; empty: ``None`` (every rank)."""
    if not text:
        return None
    try:
        return {int(r) for r in text.split(",")}
    except ValueError:
        raise ValueError(
            f"--local-ranks-filter must be a comma-separated list of ints, got {text!r}"
        ) from None


def _shutdown_timeout(value: float | None) -> float:
    """``--shutdown-timeout``, else ``$TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` (checked), else 30."""
    if value is not None:
        return value
    text = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30")
    try:
        shutdown = float(text)
    except ValueError:
        raise ValueError(
            f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT must be a number of seconds, got {text!r}"
        ) from None
    check_seconds("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", shutdown)
    return shutdown


def _check_local_addr(addr: str) -> None:
    """``--local-addr`` must be one address of this machine (the stores listen on it)."""
    if is_wildcard(addr):
        raise ValueError(
            f"--local-addr must be one address of this machine, not {addr!r} (every interface)"
        )
    if not is_local_address(addr):
        raise ValueError(
            f"--local-addr {addr!r} is not an address of this machine (the stores listen on it)"
        )


def _no_python(args: argparse.Namespace) -> bool:
    """Whether the entrypoint runs without python (``--run-path`` takes precedence over
    ``--no-python``, as torchrun); checks that a script exists."""
    script = args.training_script
    no_python = args.no_python and not args.run_path
    if no_python and args.module:
        raise ValueError("Don't use both the '--no-python' flag and the '--module' flag")
    if not args.module and not no_python and not os.path.isfile(script):
        raise ValueError(f"training script {script!r} does not exist")
    return no_python


def _warn_unused_addresses(args: argparse.Namespace, backend: str) -> None:
    """torchrun's warnings: flags of the static backend that the chosen rendezvous ignores."""
    if backend != "static" and args.node_rank != 0:
        _warn(
            f"--node-rank {args.node_rank} is used only by the static backend; the {backend} "
            "rendezvous assigns node ranks (ignored, as torchrun)"
        )
    if args.rdzv_backend == "static" and not args.standalone and not args.rdzv_endpoint:
        return  # the endpoint is --master-addr:--master-port
    for flag, value, default in (
        ("--master-addr", args.master_addr, "127.0.0.1"),
        ("--master-port", args.master_port, None),
    ):
        if value != default:
            _warn(
                f"{flag} {value} is used only by the static backend without --rdzv-endpoint; "
                f"the rendezvous is at {args.rdzv_endpoint or 'a free local port'} "
                "(ignored, as torchrun)"
            )


def _check_start(args: argparse.Namespace) -> None:
    """``--run-path`` contradicts ``--module``."""
    if args.run_path and args.module:
        raise ValueError(
            "--run-path runs a script file with runpy.run_path; it contradicts --module "
            "(give the script's path)"
        )


def _check_log_dir(path: str) -> None:
    """Creates ``--log-dir`` now, so a path that cannot be made is a usage error."""
    if not path:
        raise ValueError("--log-dir must be non-empty")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--log-dir {path!r} cannot be created: {exc.strerror}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"--log-dir {path!r} is not writable")


def main(argv: list[str] | None = None) -> int:
    """Parses ``argv`` (default ``sys.argv[1:]``), runs the job; returns the exit status.

    2: usage error (nothing was started); 0: every worker succeeded; 1: the job failed (the
    root cause is printed); 128+N: stopped by signal N.
    """
    parser = get_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else 2
    try:
        config = parse_config(args)
    except (ValueError, OSError) as exc:
        parser.print_usage(sys.stderr)
        print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    from .agent import launch

    return launch(config)


def run() -> None:
    """The ``fastcomm-run`` console script (and ``python -m fastcomm.launch``): :func:`main`,
    then the process ends without tearing down the modules it imported (torch: about half a
    second), once its ``atexit`` callbacks ran and its output is flushed."""
    import atexit

    code = main()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass  # the console is gone: the status still says how it ended
    os._exit(code)
