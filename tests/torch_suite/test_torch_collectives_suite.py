"""PyTorch's own collective tests, run on the ``fastcomm`` torch.distributed backend.

torch ships its distributed test suite (``torch.testing._internal.distributed.distributed_test``,
class ``DistributedTest._DistTestBase``) and runs it with ``BACKEND=gloo WORLD_SIZE=2`` through
``TestDistBackend``: two real rank processes per test, ``init_process_group(BACKEND,
init_method="file://...")``. Here the same base runs with ``BACKEND=fastcomm``: the backend is
declared a plugin that creates subgroups (``DistTestCases.backend_feature["plugin"]`` and
``["subgroup"]``) *before* the suite module is imported, since its decorators read them at
import. Rank processes are forked from this one (``FASTCOMM_TORCH_SUITE_START=spawn``: spawned).

Selected: every test of the base that neither names DDP (``ddp``, ``DistributedDataParallel``,
``no_sync``) nor builds a ``DistributedDataParallel`` (the DDP tests are
``test_torch_ddp_suite.py``'s): the collectives, object collectives, point-to-point, groups and
subgroups, ``SyncBatchNorm``, the model averagers, the profiler checks.
``FASTCOMM_TORCH_SUITE_SELECT`` (a regular expression) narrows the run. Excluded (``EXCLUDED``,
one reason each): tests of an API torch gives backend "gloo" alone. Tests the suite skips on a
CPU machine (CUDA, NCCL, world size 4) are reported as skipped by pytest.

Tests that pass on Gloo but that the suite gates to backend "gloo" by name (``GLOO_GATED``):
``TestFastcommGlooGatedTests`` runs their bodies, unchanged, on fastcomm, so every test of the
selection that passes on Gloo here also runs on fastcomm.

``FASTCOMM_TORCH_SUITE_BACKEND=gloo`` runs the same selection on Gloo, ``EXCLUDED`` included:
the reference run. Its passed tests are this run's passed tests plus ``EXCLUDED``.

Run: ``FASTCOMM_TORCH_COLLECTIVES_SUITE=1 PYTHONPATH=$PWD python -m pytest tests/torch_suite``.
"""

from __future__ import annotations

import inspect
import os
import re
import tempfile
import types

import torch

_BACKEND = os.environ.get("FASTCOMM_TORCH_SUITE_BACKEND", "fastcomm")
os.environ["BACKEND"] = _BACKEND
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("TEMP_DIR", tempfile.gettempdir())

from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402

import fastcomm  # noqa: E402,F401 - registers the backend

# the suite's decorators read these at import: fastcomm is a backend plugin that makes subgroups
DistTestCases.backend_feature["plugin"].add("fastcomm")
DistTestCases.backend_feature["subgroup"].add("fastcomm")

import pytest  # noqa: E402
from torch.testing._internal.distributed import distributed_test  # noqa: E402
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)

if distributed_test.BACKEND != _BACKEND:  # another module imported the suite first
    raise RuntimeError(
        f"torch's distributed_test was imported with BACKEND={distributed_test.BACKEND!r}; run "
        "this module in a pytest run of its own (FASTCOMM_TORCH_COLLECTIVES_SUITE=1)"
    )

_BASE = DistributedTest._DistTestBase
_NAMED_DDP = re.compile(r"ddp|DistributedDataParallel|no_sync", re.IGNORECASE)
_NARROW = re.compile(os.environ.get("FASTCOMM_TORCH_SUITE_SELECT", ""))

# test name -> why it is not run on fastcomm
EXCLUDED: dict[str, str] = {
    "test_monitored_barrier_gloo": "dist.monitored_barrier is implemented for backend 'gloo' "
    "only: torch checks the backend's name before it reaches the group",
    "test_monitored_barrier_gloo_rank_0_timeout": "dist.monitored_barrier: 'gloo' only, as above",
    "test_monitored_barrier_gloo_subgroup": "dist.monitored_barrier: 'gloo' only, as above",
}

# Tests that pass on Gloo but that the suite runs for backend "gloo" only (a literal "gloo" in
# their skip condition, read at import): run on fastcomm by TestFastcommGlooGatedTests, their
# bodies unchanged, with the skip mark left off. test name -> what it exercises.
GLOO_GATED: dict[str, str] = {
    "test_all_gather_object_default_pg": "all_gather_object",
    "test_all_gather_object_subgroup": "all_gather_object on a new_group",
    **{f"test_all_reduce_coalesced_{g}{op}": "all_reduce_coalesced"
       for g in ("", "full_group_") for op in ("max", "min", "product", "sum")},
    "test_batch_isend_irecv_gloo": "batch_isend_irecv",
    "test_batch_isend_irecv_gloo_tags": "batch_isend_irecv with tags",
    "test_get_future": "futures of allreduce chained with then()",
    "test_scatter_object_list": "scatter_object_list",
    "test_sparse_all_reduce_sum": "sparse COO all_reduce",
    "test_barrier_timeout_full_group": "a barrier that one rank never joins times out",
}

pytestmark = pytest.mark.timeout(300)


class _ForkedRanks(TestDistBackend):
    """torch's ``TestDistBackendWithSpawn``, its ranks forked from this process."""

    def setUp(self):
        super().setUp()
        # torch's MultiProcessTestCase makes a FileStore file per test and leaves it in /tmp
        self.addCleanup(lambda name=self.file_name: os.path.exists(name) and os.remove(name))
        if os.environ.get("FASTCOMM_TORCH_SUITE_START") == "spawn":
            self._spawn_processes()
        else:
            self._start_processes(torch.multiprocessing.get_context("fork").Process)


class TestFastcommCollectivesWithTorchSuite(_ForkedRanks, DistributedTest._DistTestBase):
    """torch's collective tests on the fastcomm backend."""

    def test_default_group_is_fastcomm_in_every_rank(self):
        """Not one of torch's: the ranks' default group is the backend this run tests."""
        import torch.distributed as dist

        self.assertEqual(dist.get_backend(), _BACKEND)
        if _BACKEND == "fastcomm":
            from fastcomm.comm.c10d import FastcommProcessGroup

            self.assertIs(type(dist.group.WORLD), FastcommProcessGroup)


class TestFastcommGlooGatedTests(_ForkedRanks, DistributedTest._DistTestBase):
    """The tests of ``GLOO_GATED`` (only), on fastcomm."""


def _without_skip_mark(fn):
    """``fn`` as a new function object without the mark ``skip_but_pass_in_sandcastle_if`` set
    on it (the decorators under it stay: the copy calls the same closure)."""
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__,
                              fn.__closure__)
    copy.__dict__.update(
        {k: v for k, v in fn.__dict__.items() if not k.startswith("__unittest_skip")}
    )
    return copy


def _builds_ddp(name: str, seen: set[str]) -> bool:
    """Whether the base's method `name`, or a ``self._helper`` it calls, builds a DDP."""
    if name in seen:
        return False
    seen.add(name)
    fn = inspect.unwrap(getattr(_BASE, name))
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        return False
    if "DistributedDataParallel(" in source:
        return True
    helpers = re.findall(r"self\.(_\w+)\(", source)
    return any(hasattr(_BASE, h) and _builds_ddp(h, seen) for h in helpers)


def _is_ddp_test(name: str) -> bool:
    return bool(_NAMED_DDP.search(name)) or _builds_ddp(name, set())


def _prune() -> None:
    """Removes the tests this module does not run (DDP's, or listed in ``EXCLUDED``)."""
    for name in dir(_BASE):
        if not name.startswith("test_"):
            continue
        if name == "test_ddp_has_finalized":  # TestDistBackend.setUp reads it (torch skips it)
            continue
        # the reference run keeps the exclusions: it shows which of them pass on Gloo
        excluded = _BACKEND == "fastcomm" and name in EXCLUDED
        keep = not _is_ddp_test(name) and not excluded and _NARROW.search(name)
        if not keep:
            setattr(TestFastcommCollectivesWithTorchSuite, name, None)
        gated = _BACKEND == "fastcomm" and name in GLOO_GATED and name not in EXCLUDED
        gated = gated and _NARROW.search(name)
        setattr(TestFastcommGlooGatedTests, name,
                _without_skip_mark(getattr(_BASE, name)) if gated else None)


_prune()
