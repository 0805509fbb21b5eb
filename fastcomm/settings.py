"""Every ``FASTCOMM_*`` environment variable fastcomm reads or sets, defined once.

Each variable is an object below: its name, its type, its default and one line of meaning,
and a typed accessor, ``get()``, that reads the environment when it is called (never at
import: a value set, or monkeypatched, before the call is the one seen) and raises
``ValueError`` naming the variable, the value and what is allowed. An unset or blank variable
reads as its default. ``docs/environment_variables.md`` holds the table ``python -m
fastcomm.settings`` prints; a test checks the two agree.

Readers name a variable through its object (``settings.RECOVER_JOIN.name``), never by a string
of their own. Two readers stand outside the package's imports by design: the worker bootstrap
(``launch/_bootstrap.py``, run by path before the user's script, so it imports nothing of the
fastcomm package) loads this file by its path; ``fastcomm.kernels`` imports nothing of
fastcomm, so it keeps its own constant for ``FASTCOMM_KERNELS`` (a test checks that it names
:data:`KERNELS`).

Standard library only: the bootstrap loads it in every worker before the user's script runs.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping

__all__ = ["VARIABLES", "Choice", "Flag", "Float", "Int", "Secret", "Switch", "Text", "Var",
           "table"]

Environ = Mapping[str, str]
_UNSET = object()


class Var:
    """One environment variable.

    Attributes:
        name: the variable, ``FASTCOMM_...``.
        default: what an unset or blank variable reads as (``get()``).
        doc: one line: what it does, who sets it where fastcomm does.
        allowed: the values accepted, as an error message says them.
        kind: the type, as the docs table shows it.
        shown_default: the default as the docs table shows it (``None``: from ``default``).
    """

    __slots__ = ("name", "default", "doc", "allowed", "kind", "shown_default")
    KIND = "str"

    def __init__(self, name: str, default: object, doc: str, *, allowed: str = "any text",
                 kind: str | None = None, shown_default: str | None = None) -> None:
        self.name = name
        self.default = default
        self.doc = doc
        self.allowed = allowed
        self.kind = kind or self.KIND
        self.shown_default = shown_default

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, default={self.default!r})"

    def raw(self, environ: Environ | None = None) -> str | None:
        """The value as set (``None``: unset), in ``environ`` (default ``os.environ``)."""
        return (os.environ if environ is None else environ).get(self.name)

    def text(self, environ: Environ | None = None) -> str:
        """The value stripped of blanks (``""``: unset or blank)."""
        return (self.raw(environ) or "").strip()

    def is_set(self, environ: Environ | None = None) -> bool:
        """Whether the variable holds something other than blanks."""
        return bool(self.text(environ))

    def invalid(self, text: str) -> ValueError:
        """The error a bad value gets: the variable, the value and what is allowed."""
        return ValueError(f"{self.name}={text!r}: must be {self.allowed} (or unset)")

    def default_text(self) -> str:
        """The default as the docs table shows it."""
        if self.shown_default is not None:
            return self.shown_default
        if isinstance(self.default, bool):
            return "1" if self.default else "0"
        if isinstance(self.default, float):
            return f"{self.default:g}"
        return "unset" if self.default is None else str(self.default)


class Text(Var):
    """Free text (a path, an identity, a URL): ``get()`` is the value as set."""

    __slots__ = ()

    def get(self, environ: Environ | None = None) -> str | None:
        raw = self.raw(environ)
        return raw if raw and raw.strip() else self.default


class Secret(Var):
    """Hex digits, read as bytes; an error never shows the value."""

    __slots__ = ()
    KIND = "hex"

    def invalid(self, text: str) -> ValueError:
        return ValueError(f"{self.name} must be hex digits, got {len(text)} chars")

    def get(self, environ: Environ | None = None) -> bytes | None:
        text = self.text(environ)
        if not text:
            return self.default
        try:
            return bytes.fromhex(text)
        except ValueError:
            raise self.invalid(text) from None


class Flag(Var):
    """``0`` or ``1``, nothing else."""

    __slots__ = ()
    KIND = "0/1"

    def __init__(self, name: str, default: bool, doc: str, **kwargs) -> None:
        super().__init__(name, default, doc, allowed="0 or 1", **kwargs)

    def get(self, environ: Environ | None = None) -> bool:
        text = self.text(environ)
        if text not in ("", "0", "1"):
            raise self.invalid(text)
        return self.default if not text else text == "1"


class Switch(Var):
    """``0`` turns it off; any other value turns it on (a blank one reads as the default)."""

    __slots__ = ()
    KIND = "0/1 (not 0: 1)"

    def __init__(self, name: str, default: bool, doc: str, **kwargs) -> None:
        super().__init__(name, default, doc, allowed="0 (off) or another value (on)", **kwargs)

    def get(self, environ: Environ | None = None) -> bool:
        text = self.text(environ)
        return self.default if not text else text != "0"


class Choice(Var):
    """One of a few words, read in lower case."""

    __slots__ = ("choices",)

    def __init__(self, name: str, default: str | None, doc: str, *, choices: tuple[str, ...],
                 **kwargs) -> None:
        allowed = ", ".join(choices[:-1]) + " or " + choices[-1]
        super().__init__(name, default, doc, allowed=allowed, kind="|".join(choices), **kwargs)
        self.choices = choices

    def get(self, environ: Environ | None = None) -> str | None:
        text = self.text(environ).lower()
        if not text:
            return self.default
        if text not in self.choices:
            raise self.invalid(text)
        return text


class _Number(Var):
    __slots__ = ("ok",)
    parse: Callable[[str], float] = float

    def __init__(self, name: str, default: float | None, doc: str, *, allowed: str,
                 ok: Callable[[float], bool] = lambda v: True, **kwargs) -> None:
        super().__init__(name, default, doc, allowed=allowed, **kwargs)
        self.ok = ok

    def _read(self, environ: Environ | None, default: object):
        text = self.text(environ)
        if not text:
            return self.default if default is _UNSET else default
        try:
            value = type(self).parse(text)
        except ValueError:
            raise self.invalid(text) from None
        if not self.ok(value):  # NaN fails every comparison, so a range check too
            raise self.invalid(text)
        return value


class Int(_Number):
    """An integer, in the range ``allowed`` says (``ok`` checks it)."""

    __slots__ = ()
    KIND = "int"
    parse = int

    def get(self, environ: Environ | None = None, *, default: object = _UNSET) -> int | None:
        """The value; ``default`` replaces the variable's own when it is unset."""
        return self._read(environ, default)


class Float(_Number):
    """A number, in the range ``allowed`` says (``ok`` checks it)."""

    __slots__ = ()
    KIND = "float"
    parse = float

    def get(self, environ: Environ | None = None, *, default: object = _UNSET) -> float | None:
        """The value; ``default`` replaces the variable's own when it is unset."""
        return self._read(environ, default)


def _seconds(v: float) -> bool:
    return v > 0 and math.isfinite(v)


_SECONDS = "a finite number of seconds > 0"

# ------------------------------------------------------------------------------ backends
BACKEND = Choice(
    "FASTCOMM_BACKEND", None,
    "Forces the backend of `fastcomm.init()` and of the torch backend's groups (unset: NCCL "
    "where every local rank has a GPU of its own, else `ipc`, `shm` or `gloo` by host layout).",
    choices=("gloo", "nccl", "shm", "hier", "ipc"), shown_default="unset (automatic)",
)
KERNELS = Choice(
    "FASTCOMM_KERNELS", "auto",
    "Forces the fused ops' implementation: `triton` (interpreted for CPU tensors, under "
    "`TRITON_INTERPRET=1`) or `torch`; `auto`: Triton for CUDA tensors, the torch references "
    "for CPU ones. Read by `fastcomm.kernels` itself.",
    choices=("auto", "triton", "torch"),
)

# ------------------------------------------------------------------------------ the store
STORE = Text(
    "FASTCOMM_STORE", None,
    "The job's store when it is not a `TCPStore` at `MASTER_ADDR:MASTER_PORT`: "
    "`etcd://host:port[,host:port...]/prefix` puts it in an etcd cluster, under `prefix`.",
    allowed="etcd://host:port[,host:port...]/prefix", kind="url",
    shown_default="unset (`MASTER_ADDR:MASTER_PORT`)",
)
JOB_SECRET = Secret(
    "FASTCOMM_JOB_SECRET", None,
    "The job's secret, at least 16 bytes in hex: store values are HMAC-signed with it; "
    "`fastcomm-run` sets it for its workers.",
    allowed="hex digits", shown_default="unset (values unsigned)",
)
JOB_SECRET_FILE = Text(
    "FASTCOMM_JOB_SECRET_FILE", None,
    "A file whose contents (whitespace stripped) are the job's secret; `FASTCOMM_JOB_SECRET` "
    "wins over it.",
    allowed="a readable file", kind="path",
)
HOST_ID = Text(
    "FASTCOMM_HOST_ID", None,
    "This host's identity: ranks with equal ones share `/dev/shm` (tests set it to play "
    "several hosts on one).",
    shown_default="unset (hostname + boot id)",
)

# ------------------------------------------------------------------------------ shm communicator
SHM_SLOT_BYTES = Int(
    "FASTCOMM_SHM_SLOT_BYTES", 1 << 20,
    "Bytes of each rank's slot in each half of the `shm` segment: the chunk a round moves.",
    allowed="a positive multiple of 4096", ok=lambda v: v > 0 and not v % 4096,
    shown_default="1048576 (1 MiB)",
)
SHM_ONE_SHOT_BYTES = Int(
    "FASTCOMM_SHM_ONE_SHOT_BYTES", None,
    "Largest `shm` all-reduce, in bytes, done in one shot instead of reduce-scatter + "
    "all-gather.",
    allowed="an integer >= 0", ok=lambda v: v >= 0, shown_default="unset (512 KiB / size)",
)
SHM_SPIN_US = Float(
    "FASTCOMM_SHM_SPIN_US", None,
    "Microseconds a waiting `shm` rank polls in a tight loop.",
    allowed="a number in [0, 1e6]", ok=lambda v: 0 <= v <= 1e6,
    shown_default="unset (20 where the ranks fit on the cores, else 0)",
)
SHM_YIELD_US = Float(
    "FASTCOMM_SHM_YIELD_US", 1000.0,
    "Microseconds a waiting `shm` rank then polls between `sched_yield()` calls before it "
    "sleeps on a futex.",
    allowed="a number in [0, 1e7]", ok=lambda v: 0 <= v <= 1e7,
)
SHM_COMPILED = Flag(
    "FASTCOMM_SHM_COMPILED", True,
    "Whether the `shm` communicator runs its compiled core (where it was built at install).",
)
SHM_FENCE = Flag(
    "FASTCOMM_SHM_FENCE", False,
    "Forces explicit memory fences on the `shm` flags on x86 too (other machines always fence).",
)
PIDFD = Flag(
    "FASTCOMM_PIDFD", True,
    "Whether a peer process on this host is watched through a pidfd (Linux >= 5.3), its exit "
    "seen within a wait's sleep slice; 0 reads `/proc` every 50 ms instead.",
)

# ------------------------------------------------------------------------------ ipc communicator
IPC_CUDA_WORKSPACE_BYTES = Int(
    "FASTCOMM_IPC_CUDA_WORKSPACE_BYTES", 32 << 20,
    "Bytes of the `ipc` CUDA transport's data area per rank (two alternating buffers).",
    allowed="an integer number of bytes", shown_default="33554432 (32 MiB)",
)
IPC_CUDA_TWO_SHOT_BYTES = Int(
    "FASTCOMM_IPC_CUDA_TWO_SHOT_BYTES", 512 << 10,
    "Rounds of the `ipc` CUDA all-reduce of at least this many bytes run two-shot, smaller "
    "ones one-shot.",
    allowed="an integer number of bytes", shown_default="524288 (512 KiB)",
)

# ------------------------------------------------------------------------------ flight recorder
FLIGHT_SIZE = Int(
    "FASTCOMM_FLIGHT_SIZE", 2000,
    "Length of each communicator's flight recorder ring; 0 turns the recorder off.",
    allowed="an integer >= 0", ok=lambda v: v >= 0,
)
FLIGHT_POLL_S = Float(
    "FASTCOMM_FLIGHT_POLL_S", 1.0,
    "Seconds between two rounds of the flight watch: heartbeat, dump requests, hang check.",
    allowed=_SECONDS, ok=_seconds, kind="seconds",
)
SUSPECT_S = Float(
    "FASTCOMM_SUSPECT_S", 30.0,
    "Seconds a collective may wait before the flight watch reports a suspected hang.",
    allowed=_SECONDS, ok=_seconds, kind="seconds",
)
FLIGHT_DIR = Text(
    "FASTCOMM_FLIGHT_DIR", None,
    "Folder the flight records and hang reports are written to, besides the store; "
    "`fastcomm-run` sets it to `flight/` in its workers' log folder.",
    allowed="a folder", kind="path", shown_default="unset (the store only)",
)

# ------------------------------------------------------------------------------ DDP
DDP_SHARED_BUCKETS = Switch(
    "FASTCOMM_DDP_SHARED_BUCKETS", True,
    "Default of `DDPConfig.shared_buckets`: buckets in memory the ranks share, reduced in place.",
)
DDP_SHARED_CAP_MB = Float(
    "FASTCOMM_DDP_SHARED_CAP_MB", None,
    "Default of `DDPConfig.shared_bucket_cap_mb`: the most MiB of `/dev/shm` the shared "
    "buckets may take.",
    allowed="a number of MiB", kind="MiB", shown_default="unset (no cap)",
)
DDP_SHARED_MIN_MEAN_BYTES = Int(
    "FASTCOMM_DDP_SHARED_MIN_MEAN_BYTES", 16 << 10,
    "Default of `DDPConfig.shared_min_mean_bytes`: buckets are shared where their gradients "
    "average this many bytes (0: always).",
    allowed="a number of bytes", shown_default="16384 (16 KiB)",
)
DDP_HAND_OVER = Switch(
    "FASTCOMM_DDP_HAND_OVER", True,
    "Default of `DDPConfig.hand_over_grads`: CPU gradients become views of the reduced bucket "
    "instead of copies of it.",
)
DDP_CUDA_GRAPHS = Switch(
    "FASTCOMM_DDP_CUDA_GRAPHS", True,
    "Default of `DDPConfig.cuda_graphs`: packed CUDA buckets replay from a captured CUDA graph.",
)
DDP_COMPILED_BACKWARD = Choice(
    "FASTCOMM_DDP_COMPILED_BACKWARD", "auto",
    "Default of `DDPConfig.compiled_backward`: under `torch.compile(DDP(model))`, `traced` puts "
    "the gradient hooks inside one compiled backward; `split` has Dynamo's DDPOptimizer compile "
    "a graph per bucket, as for torch DDP; `auto`: traced for CPU parameters, split for CUDA "
    "ones (the traced path has not run on a GPU yet).",
    choices=("auto", "traced", "split"),
)
DDP_COMPILED_OVERLAP = Choice(
    "FASTCOMM_DDP_COMPILED_OVERLAP", "auto",
    "Under compiled autograd, whether a bucket's reduction runs while the backward goes on (its "
    "wait after the last launch) or is waited for at once; `auto`: on for CUDA buckets, off for "
    "CPU ones, whose reduction thread would take the backward's cores.",
    choices=("auto", "on", "off"),
)

# ------------------------------------------------------------------------------ recovery
RECOVER = Choice(
    "FASTCOMM_RECOVER", "restart",
    "`in-process`: fastcomm DDP shrinks in place when a rank is lost (`fastcomm-run --recover "
    "in-process` sets it for its workers).",
    choices=("in-process", "restart"),
)
RECOVER_TIMEOUT = Float(
    "FASTCOMM_RECOVER_TIMEOUT", 60.0,
    "Seconds the members of an in-place recovery wait for each other in one epoch's agreement.",
    allowed=_SECONDS, ok=_seconds, kind="seconds",
)
RECOVER_JOIN = Text(
    "FASTCOMM_RECOVER_JOIN", None,
    "Set by `fastcomm-run` for a replacement (`1`, `2`, ...: its number on its node) or a "
    "joining node's workers (`node<GROUP_RANK>`): they join the running ranks instead of "
    "starting a job.",
    allowed="a number or node<GROUP_RANK>",
)
RECOVER_JOIN_EVERY = Int(
    "FASTCOMM_RECOVER_JOIN_EVERY", 16,
    "The running ranks look for a joiner every this many synchronized forwards.",
    allowed="an integer >= 1", ok=lambda v: v >= 1,
)

# ------------------------------------------------------------------------------ the launcher
SPARE_ACTIVATED = Text(
    "FASTCOMM_SPARE_ACTIVATED", None,
    "Set by `fastcomm-run` in a replacement's environment when it starts warm (forked by the "
    "fork server, or from a warm spare): the `time.time()` of that moment.",
    allowed="a time.time()", kind="float",
)
LAUNCH_AGENT_PID = Text(
    "FASTCOMM_LAUNCH_AGENT_PID", None,
    "Set by `fastcomm-run` for its workers' bootstrap, which removes it: the pid of the "
    "worker's parent (the agent, or the fork server), whose exit ends the worker.",
    allowed="a pid", kind="int",
)
LAUNCH_VERBOSE = Switch(
    "FASTCOMM_LAUNCH_VERBOSE", False,
    "`fastcomm-run` logs its informational lines, as `LOGLEVEL=INFO` has it do.",
)

VARIABLES: tuple[Var, ...] = tuple(v for v in list(globals().values()) if isinstance(v, Var))
"""Every variable, in the order above."""


def table() -> str:
    """The Markdown table of :data:`VARIABLES` (``docs/environment_variables.md`` holds it)."""
    rows = ["| Variable | Type | Default | Meaning |", "| --- | --- | --- | --- |"]
    for var in VARIABLES:
        cells = (f"`{var.name}`", f"`{var.kind}`", var.default_text(), var.doc)
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(table(), end="")
