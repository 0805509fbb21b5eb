"""Multi-process test harness: a pool of real ranks reused across the checks of a module.

Starting a process that imports torch costs ~2 s here, so a module starts its ranks once
(``RankPool``, forked from a server that imported torch) and sends them many checks. Each
check is a module-level function (pickled by reference) called as ``fn(*args)`` on every rank;
its return values come back in rank order, and a rank's exception comes back as its formatted
traceback.

The pool's parent process serves the ``TCPStore`` (port 0), and the ranks connect as clients
(``TORCHELASTIC_USE_AGENT_STORE=True``), so ``fastcomm.init()`` works in them unchanged. After a
failed or timed-out check the pool kills every rank and starts afresh for the next check, so
one broken collective never poisons the others.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from fastcomm.comm.store import Store

# Ranks are forked from multiprocessing's fork server, which imported torch once (``import
# torch`` costs ~2 s of CPU per process here): a rank is still a process of its own, with
# nothing of fastcomm imported, the pool's environment as it is at `start`, and generators
# seeded at random (`_reseed`). A fork keeps Python's string hash seed in common; jobs started
# by ``fastcomm-run`` (tests/launch, tests/ddp/test_recover) keep theirs apart. torch's
# optimizers import torch._dynamo (~1 s more) when the first is built: the server imports it
# too where the session forces Triton to its interpreter (the root conftest, on a machine
# without CUDA), as torch._dynamo imports triton, which reads TRITON_INTERPRET once.
_CTX = mp.get_context("forkserver")
_PRELOAD = ["torch"] + (["torch._dynamo"] if os.environ.get("TRITON_INTERPRET") == "1" else [])
_CTX.set_forkserver_preload(_PRELOAD)

#: Environment of every pool's ranks unless its own ``env`` says otherwise. The flight watch
#: polls every 0.5 s (1 s by default): a failed call's report waits 2 polls + 1 s for the peers'
#: records, so a check that runs into a timeout or an abort waits 2 s for it, not 3 s.
#: ``OMP_NUM_THREADS=1`` is what ``fastcomm-run`` (as torchrun) gives several workers of one
#: host: the ranks share its cores, and a second intra-op thread per rank only waits for one
#: (600 steps of a small MLP: 1.7 s with one thread, 28 s with two on 2 busy cores).
POOL_ENV = {"FASTCOMM_FLIGHT_POLL_S": "0.5", "OMP_NUM_THREADS": "1"}

# Per-rank state that survives between checks of one pool (communicators, say).
STATE: dict[str, Any] = {}

#: Environment of ranks that run the Triton kernels on CPU memory: forced, in Triton's
#: interpreter. The interpreter must be on before triton's first import; a rank is a fresh
#: (spawned) process that imports triton only after `_worker` set this, so it holds even where
#: pytest's own process imported triton compiled (a CUDA machine, where the root conftest leaves
#: ``TRITON_INTERPRET`` unset). Keep CUDA kernels out of such pools: the interpreter cannot
#: follow device addresses.
INTERPRETED_KERNELS = {"FASTCOMM_KERNELS": "triton", "TRITON_INTERPRET": "1"}


class RankFailure(AssertionError):
    """One or more ranks raised (or never finished) a check.

    Attributes:
        errors: rank -> traceback text of each rank that raised or died.
        results: rank -> return value of each rank that finished.
        unfinished: ranks that neither returned nor raised within the timeout.
    """

    def __init__(self, message: str, errors=None, results=None, unfinished=()):
        super().__init__(message)
        self.errors = dict(errors or {})
        self.results = dict(results or {})
        self.unfinished = sorted(unfinished)


def _reseed() -> None:
    """Seeds torch's and numpy's default generators at random, as a fresh interpreter does (a
    forked rank would otherwise draw what every other rank draws)."""
    import torch

    torch.seed()
    try:
        import numpy as np
    except ImportError:  # torch runs without numpy
        return
    np.random.seed()


def _threads() -> None:
    """Applies ``OMP_NUM_THREADS``: torch read it when the fork server imported torch, before
    the pool's environment was this rank's."""
    text = os.environ.get("OMP_NUM_THREADS", "").strip()
    if text.isdigit() and int(text) > 0:
        import torch

        torch.set_num_threads(int(text))


def _worker(rank: int, world_size: int, port: int, env: dict[str, str], conn: Connection):
    os.environ.clear()  # the pool's environment as it is now, not the server's at its start
    os.environ.update(env)
    _threads()
    _reseed()
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        fn, args, kwargs = message
        try:
            result = ("ok", fn(*args, **kwargs))
        except BaseException:  # every failure goes back to pytest, with its traceback
            result = ("err", traceback.format_exc())
        try:
            conn.send(result)
        except Exception:
            conn.send(("err", f"rank {rank}: result of {fn.__name__} is not picklable"))


class RankPool:
    """``world_size`` ranks started once and fed checks with :meth:`run`.

    Args:
        world_size: number of ranks.
        env: extra environment for the ranks (over ``POOL_ENV``).
        timeout: default seconds a check may take on all ranks together.
        grace: seconds the other ranks get to finish once one rank has failed.
    """

    def __init__(
        self,
        world_size: int,
        *,
        env: dict[str, str] | None = None,
        timeout: float = 60.0,
        grace: float = 15.0,
    ) -> None:
        self.world_size = world_size
        self.env = {**POOL_ENV, **(env or {})}
        self.timeout = timeout
        self.grace = grace
        self.store: Store | None = None
        self._procs: list[mp.Process] = []
        self._conns: list[Connection] = []
        self.restarts = 0

    # ------------------------------------------------------------------ lifetime
    def start(self) -> None:
        self.store = Store(is_server=True, timeout=30)
        self._procs, self._conns = [], []
        for rank in range(self.world_size):
            parent, child = _CTX.Pipe()
            proc = _CTX.Process(
                target=_worker,
                args=(rank, self.world_size, self.store.port, {**os.environ, **self.env}, child),
                name=f"rank{rank}",
                daemon=True,
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + 5
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self._kill()
        self.store = None

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(5)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ checks
    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout: float | None = None,
        per_rank: list[tuple] | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        """Runs ``fn(*args, **kwargs)`` on every rank and returns the results in rank order.

        ``per_rank[r]``, when given, is appended to ``args`` on rank ``r``.

        Raises:
            RankFailure: a rank raised, died, or did not finish within ``timeout``; the message
                holds every failing rank's traceback. The pool restarts before the next check.
        """
        if not self._procs:
            self.start()
        timeout = self.timeout if timeout is None else timeout
        for rank, conn in enumerate(self._conns):
            extra = tuple(per_rank[rank]) if per_rank is not None else ()
            conn.send((fn, args + extra, kwargs))
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        pending = dict(enumerate(self._conns))
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for conn in wait(list(pending.values()), timeout=min(left, 0.5)):
                rank = self._conns.index(conn)
                try:
                    status, value = conn.recv()
                except (EOFError, OSError):
                    code = self._procs[rank].exitcode
                    status, value = "err", f"rank {rank} died (exit code {code})"
                del pending[rank]
                if status == "ok":
                    results[rank] = value
                else:
                    errors[rank] = value
                    deadline = min(deadline, time.monotonic() + self.grace)
        if errors or pending:
            self._kill()
            self.restarts += 1
            parts = [f"--- rank {r} raised:\n{tb}" for r, tb in sorted(errors.items())]
            if pending:
                parts.append(
                    f"--- ranks {sorted(pending)} did not finish {fn.__name__} "
                    f"within {timeout:.0f} s (pool restarted)"
                )
            raise RankFailure(
                f"{fn.__name__} failed:\n" + "\n".join(parts), errors, results, pending
            )
        return [results[r] for r in range(self.world_size)]

    def expect_failure(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> RankFailure:
        """Runs a check that must fail on some rank; returns the ``RankFailure``."""
        try:
            self.run(fn, *args, **kwargs)
        except RankFailure as exc:
            return exc
        raise AssertionError(f"{fn.__name__} was expected to fail on some rank but passed")


def pool_fixture(
    world_size: int | list[int],
    *,
    env: dict[str, str] | None = None,
    timeout: float = 60.0,
    ids: list[str] | Callable[[int], str] | None = None,
    setup: Callable[[RankPool], Any] | None = None,
    needs_cuda: bool = False,
):
    """A module-scoped pytest fixture that yields a :class:`RankPool` and closes it after.

    Assign it to the fixture's name in the test module (``pool = pool_fixture(2)``).

    Args:
        world_size: the ranks of the pool, or a list of sizes: the module then runs once per
            size, its ids ``world<n>`` unless ``ids`` says otherwise.
        env, timeout: as :class:`RankPool`'s.
        setup: called with the pool once before the module's first check.
        needs_cuda: skip the module's checks (starting no rank) where CUDA is absent.
    """
    import pytest

    sized = not isinstance(world_size, int)
    params = list(world_size) if sized else None
    if sized and ids is None:
        ids = [f"world{n}" for n in params]

    @pytest.fixture(scope="module", params=params, ids=ids if sized else None)
    def fixture(request):
        size = request.param if sized else world_size
        if needs_cuda:
            import torch

            if not torch.cuda.is_available():
                pytest.skip("needs a CUDA device")
        with RankPool(size, env=env, timeout=timeout) as pool:
            if setup is not None:
                setup(pool)
            yield pool

    return fixture


def free_port() -> int:
    """A port of 127.0.0.1 that was free a moment ago (the race with others is accepted)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---------------------------------------------------------------------- helpers for checks
def env_rank() -> int:
    """This rank's number (``RANK``), in a check run by a pool."""
    return int(os.environ["RANK"])


def env_world() -> int:
    """The pool's size (``WORLD_SIZE``), in a check run by a pool."""
    return int(os.environ["WORLD_SIZE"])


def rank_store():
    """This rank's client of the pool's store (cached)."""
    if "store" not in STATE:
        STATE["store"] = Store(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            timeout=30,
            rank=int(os.environ["RANK"]),
        )
    return STATE["store"]


def poll_keys(store, keys: list[str], timeout: float = 60.0) -> None:
    """Waits until every key of ``keys`` is set in ``store``, looking every 20 ms.

    A rank that stays away from a collective on purpose waits this way, not with
    ``store.wait``: a blocking wait holds the rank's store connection, which its flight watch
    shares, so the rank could not answer the failing peers' report request (the report then
    waits its full 2 s for this rank's record, and names it as not answering)."""
    deadline = time.monotonic() + timeout
    while not store.check(keys):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {os.environ.get('RANK')}: {keys} not set in {timeout} s")
        time.sleep(0.02)


def poll_barrier(name: str, timeout: float = 60.0) -> None:
    """A barrier of every rank of the pool over :func:`rank_store`, waited by :func:`poll_keys`."""
    store = rank_store()
    if store.add(f"{name}/arrived", 1) == env_world():
        store.set(f"{name}/done", "1")
    poll_keys(store, [f"{name}/done"], timeout)


def rank_comm(backend: str = "gloo", timeout: float = 30.0):
    """A communicator of ``backend`` over all ranks of the pool (cached per backend)."""
    key = f"comm/{backend}"
    if key not in STATE or STATE[key].closed:
        from fastcomm.comm import new_communicator

        STATE["gen"] = STATE.get("gen", 0) + 1
        rank = int(os.environ["RANK"])
        extra = {}
        if backend == "nccl":  # FASTCOMM_TEST_DEVICE=0 puts every rank on one shared GPU
            extra["device"] = int(os.environ.get("FASTCOMM_TEST_DEVICE", rank))
        STATE[key] = new_communicator(
            backend,
            store=rank_store().prefixed(f"{backend}-{STATE['gen']}", rank=rank),
            rank=rank,
            size=int(os.environ["WORLD_SIZE"]),
            timeout=timeout,
            **extra,
        )
    return STATE[key]


def fresh_comm(backend: str, name: str, timeout: float = 30.0):
    """A new, uncached communicator in the store namespace ``name`` (unique per check)."""
    from fastcomm.comm import new_communicator

    rank = int(os.environ["RANK"])
    return new_communicator(
        backend,
        store=rank_store().prefixed(name, rank=rank),
        rank=rank,
        size=int(os.environ["WORLD_SIZE"]),
        timeout=timeout,
    )


def map_peer_files(name: str, tag: str, nbytes: int) -> list:
    """Maps every rank's ``nbytes`` POSIX shared-memory file into this rank, in rank order.

    Each rank creates its own zero-filled file (named after its pid, so the segment sweeper
    knows whose it is), maps every peer's once all exist, and unlinks its own once all are
    mapped: nothing outlives the processes. Call on every rank of the pool.

    Returns:
        the ``mmap.mmap`` objects, one per rank; close them when done.
    """
    import mmap

    from fastcomm.comm.shm.segment import PREFIX, SHM_DIR

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = rank_store()
    pids = store.all_gather_object(f"{name}/pids", rank, world, os.getpid(), 30)
    paths = [
        os.path.join(SHM_DIR, f"{PREFIX}{pid}-{tag}-{name}-{r}") for r, pid in enumerate(pids)
    ]
    fd = os.open(paths[rank], os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)
    store.barrier(f"{name}/created", world, 30)
    maps = []
    for path in paths:
        fd = os.open(path, os.O_RDWR)
        try:
            maps.append(mmap.mmap(fd, nbytes))
        finally:
            os.close(fd)
    store.barrier(f"{name}/mapped", world, 30)
    os.unlink(paths[rank])
    return maps
