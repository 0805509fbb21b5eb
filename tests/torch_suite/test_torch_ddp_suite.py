"""PyTorch's own DDP tests, run with ``fastcomm.ddp.DDP`` in place of torch's class.

torch ships its distributed test suite (``torch.testing._internal.distributed.distributed_test``,
class ``DistributedTest._DistTestBase``); torch runs it with ``BACKEND=gloo WORLD_SIZE=2`` through
``TestDistBackend``, two real rank processes per test. Here the same base runs with
``torch.nn.parallel.DistributedDataParallel`` replaced by fastcomm's ``DDP`` *before* the suite
module is imported (it binds the name at import): the rank processes are forked from this one
and inherit the swap; with ``FASTCOMM_TORCH_SUITE_START=spawn`` they are spawned instead and
each re-imports this module, which swaps again before importing the suite.

Selected: the tests of the base whose name mentions DDP (``ddp``, ``DDP``,
``DistributedDataParallel``, ``no_sync``) and those whose body, or a helper it calls, builds a
``DistributedDataParallel`` (``FASTCOMM_TORCH_SUITE_SELECT``, a regular expression, narrows the
run to the matching names). Excluded (``EXCLUDED`` below, one reason each): tests that read
torch internals rather than behaviour. Tests the suite itself skips on a CPU machine (CUDA,
NCCL, several GPUs) are reported as skipped by pytest.

One test of this module's own, ``test_ddp_class_is_swapped_in_every_rank``, checks in the rank
processes that the class under test is the swapped one (torch's with
``FASTCOMM_TORCH_SUITE_DDP=torch``, the reference run).

Run: ``FASTCOMM_TORCH_SUITE=1 PYTHONPATH=$PWD python -m pytest tests/torch_suite``.
"""

from __future__ import annotations

import inspect
import os
import re
import tempfile

import torch

os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("TEMP_DIR", tempfile.gettempdir())

import fastcomm.ddp  # noqa: E402

# The swap: every later `nn.parallel.DistributedDataParallel` (and the suite's own
# `from torch.nn.parallel import DistributedDataParallel`) resolves to fastcomm's class.
# FASTCOMM_TORCH_SUITE_DDP=torch keeps torch's class: the same selection as a reference run.
if os.environ.get("FASTCOMM_TORCH_SUITE_DDP", "fastcomm") != "torch":
    torch.nn.parallel.DistributedDataParallel = fastcomm.ddp.DDP

import pytest  # noqa: E402
from torch.testing._internal.distributed import distributed_test  # noqa: E402
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)

_BASE = DistributedTest._DistTestBase
_NAMED_DDP = re.compile(r"ddp|DistributedDataParallel|no_sync", re.IGNORECASE)
_NARROW = re.compile(os.environ.get("FASTCOMM_TORCH_SUITE_SELECT", ""))

# test name -> why it is not run (each reads torch internals, not DDP behaviour)
EXCLUDED: dict[str, str] = {
    "test_ddp_logging_data_cpu": "reads torch's private DDP logging data "
    "(_get_ddp_logging_data, _set_ddp_runtime_logging_sample_rate: C++ Logger fields)",
    "test_static_graph_api_cpu": "after the RuntimeError it expects (which fastcomm raises with "
    "torch's text) it reads the error back from torch's private DDP logging data",
}

pytestmark = pytest.mark.timeout(400)


class TestFastcommDDPWithTorchSuite(TestDistBackend, DistributedTest._DistTestBase):
    """torch's ``TestDistBackendWithSpawn``, with fastcomm's DDP and forked ranks."""

    def setUp(self):
        super().setUp()
        # torch's MultiProcessTestCase makes a FileStore file per test and leaves it in /tmp
        self.addCleanup(lambda name=self.file_name: os.path.exists(name) and os.remove(name))
        if os.environ.get("FASTCOMM_TORCH_SUITE_START") == "spawn":
            self._spawn_processes()
        else:
            self._start_processes(torch.multiprocessing.get_context("fork").Process)

    def test_ddp_class_is_swapped_in_every_rank(self):
        """Not one of torch's: the ranks' DDP class is the one this run means to test."""
        expected = (
            torch.nn.parallel.distributed.DistributedDataParallel
            if os.environ.get("FASTCOMM_TORCH_SUITE_DDP") == "torch"
            else fastcomm.ddp.DDP
        )
        self.assertIs(torch.nn.parallel.DistributedDataParallel, expected)
        self.assertIs(distributed_test.DistributedDataParallel, expected)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
        self.assertIs(type(model), expected)


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
    """Removes the tests this module does not run (not DDP, or listed in ``EXCLUDED``)."""
    for name in dir(_BASE):
        if not name.startswith("test_"):
            continue
        if name == "test_ddp_has_finalized":  # TestDistBackend.setUp reads it (torch skips it)
            continue
        keep = _is_ddp_test(name) and name not in EXCLUDED and _NARROW.search(name)
        if not keep:
            setattr(TestFastcommDDPWithTorchSuite, name, None)


_prune()
