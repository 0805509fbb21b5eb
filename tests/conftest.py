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


def pytest_collection_modifyitems(config, items):
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
