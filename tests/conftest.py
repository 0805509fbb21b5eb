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
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

_names = itertools.count()


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


def pytest_sessionfinish(session, exitstatus):
    """The whole suite must leave no shared-memory segment behind (its exit status says so)."""
    import time

    from fastcomm.comm.shm.segment import PREFIX, SHM_DIR, process_alive

    if not os.path.isdir(SHM_DIR):
        return
    deadline = time.monotonic() + 10.0
    while True:
        left = sorted(n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX))
        # another session's live segment is not ours to judge; a dead creator's is a leak
        leaked = [n for n in left if not process_alive(int(n[len(PREFIX):].split("-", 1)[0]))]
        if not left or leaked or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    if leaked:
        session.config.get_terminal_writer().line(
            f"FAILED: shared-memory segments left in {SHM_DIR} by exited processes: {leaked}",
            red=True,
        )
        session.exitstatus = 1
