import itertools
import os

import pytest

# The Triton interpreter runs @triton.jit kernels on CPU tensors; it must be on before triton
# is first imported (triton binds tl.max and friends at import time), so it is set here,
# before any test module imports triton or fastcomm.kernels.
try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _HAS_CUDA = False
else:
    # pytest-xdist's workers share the machine's cores: intra-op threads beyond a worker's
    # share only wait for a core (the pools' ranks, like launched workers, run one each)
    _WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    if _WORKERS > 1:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // _WORKERS))
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

_names = itertools.count()
_LEFTOVERS = pytest.StashKey()


#: The files that take longest (per-file sums of a run at ``-n 3`` on 2 cores), scheduled
#: first: with ``--dist loadfile`` a long file handed out last keeps one worker busy while the
#: others have nothing left (that run's sums give 563 s in collection order, 525 s with these
#: first). It orders the scheduling only; a file missing from the list runs after, as collected.
_LONGEST_FIRST = [
    "tests/launch/test_two_nodes.py",  # 117 s
    "tests/ddp/test_recover.py",  # 109 s
    "tests/launch/test_etcd_launch.py",  # 87 s
    "tests/launch/test_etcd_nodes.py",  # 84 s
    "tests/launch/test_recover_launch.py",  # 75 s
    "tests/launch/test_multinode.py",  # 68 s
    "tests/ddp/test_compile.py",  # 45 s
    "tests/launch/test_forkserver.py",  # 43 s
    "tests/comm/test_flight.py",  # 42 s
    "tests/ddp/test_compiled_autograd.py",  # 42 s
    "tests/comm/c10d/test_p2p.py",  # 36 s
    "tests/comm/shm/test_communicator.py",  # 36 s
    "tests/ddp/test_hooks.py",  # 33 s
    "tests/launch/test_hang_report.py",  # 32 s
    "tests/launch/test_security.py",  # 31 s
    "tests/ddp/test_torch_parity.py",  # 28 s
    "tests/comm/shm/test_faults.py",  # 28 s
    "bench/test_ddp_compile.py",  # 27 s
    "tests/launch/test_signals.py",  # 26 s
    "tests/ddp/test_recover_event.py",  # 25 s
    "tests/launch/test_flags.py",  # 25 s
    "tests/comm/ipc/test_cuda.py",  # 24 s
    "tests/comm/c10d/test_process_group.py",  # 24 s
    "tests/comm/hier/test_communicator.py",  # 23 s
]


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def unique_name(request):
    """A store namespace no other check of this session uses."""
    return f"{request.node.name}-{next(_names)}"


def pytest_sessionstart(session):
    """Starts watching the processes this session makes (``tests/leftovers.py``)."""
    from tests.leftovers import Leftovers

    session.config.stash[_LEFTOVERS] = watcher = Leftovers()
    watcher.start()


def pytest_sessionfinish(session, exitstatus):
    """The suite must leave no shared-memory segment and no process of its own behind: the
    session fails (exit status 1), naming them, if it does."""
    watcher = session.config.stash.get(_LEFTOVERS, None)
    if watcher is None:
        return
    problems = watcher.check()
    if problems:
        writer = session.config.get_terminal_writer()
        writer.line()
        for line in problems:
            writer.line(f"FAILED: the test session left {line}", red=True)
        session.exitstatus = 1
