"""torch DDP and FSDP2 compiled on the ``fastcomm`` backend, against the same program on Gloo,
on 2 CPU ranks (the groups and data of ``test_parity.py``): ``torch.compile(DDP(model))`` (its
DDPOptimizer splits the graph), and FSDP2 with each layer compiled before it is sharded, as
torchtitan does. (A whole FSDP2 model under ``torch.compile`` compiles nothing on CPU in torch
2.13, on either backend: its hooks break the graph inside the layers' loop, and Dynamo then runs
the frame eagerly.)

torch's C++ calls the group's Python methods from inside compiled regions; Dynamo must never
trace them (it sees the group as an opaque object and failed with ``UnsafeScriptObjectError``
on ``_comm_for``): ``fastcomm.comm.c10d.compiled``. The compiler backend is ``aot_eager``
(AOTAutograd's split, eager kernels), which compiles in seconds on 2 cores.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.comm.c10d.test_parity import _batches, _groups, _same
from tests.harness import pool_fixture

pytestmark = pytest.mark.timeout(300)

WIDTH = 24


class Net(nn.Module):
    """Layers in a list (a compiled ``nn.Sequential`` under torch DDP is not compiled at all:
    Dynamo leaves a torch.nn container's own frame)."""

    def __init__(self, seed: int = 0, depth: int = 4) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = torch.tanh(layer(x))
        return self.layers[-1](x)


def _graphs() -> int:
    import torch._dynamo

    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _train(model, opt, steps: int = 3) -> None:
    for x in _batches(steps, WIDTH):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


def check_torch_ddp_compiled():
    import torch._dynamo
    from torch.nn.parallel import DistributedDataParallel

    fc, gloo = _groups()
    params, compiled = [], []
    for group in (fc, gloo):
        torch._dynamo.reset()
        before = _graphs()
        ddp = DistributedDataParallel(Net(), process_group=group, bucket_cap_mb=1)
        model = torch.compile(ddp, backend="aot_eager")
        _train(model, torch.optim.SGD(model.parameters(), lr=0.1))
        compiled.append(_graphs() - before)
        params.append(torch.cat([p.detach().view(-1) for p in ddp.parameters()]))
    _same(*params)
    return compiled


pool = pool_fixture([2], env={"OMP_NUM_THREADS": "1"}, timeout=240)


def test_torch_ddp_compiled(pool):
    for compiled in pool.run(check_torch_ddp_compiled):
        assert all(n > 0 for n in compiled), compiled  # compiled on both backends


class Block(nn.Module):
    """A layer of the model's own class (Dynamo leaves a bare ``nn.Linear``'s frame alone)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return torch.tanh(self.linear(x))


class Blocks(nn.Module):
    def __init__(self, seed: int = 0, depth: int = 4) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList(Block() for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def check_fsdp2_compiled():
    """FSDP2 with each layer compiled before it is sharded (how torchtitan compiles: the
    layers' bodies are graphs, FSDP2's gathers and reduce-scatters run between them)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    fc, gloo = _groups()
    params, compiled = [], []
    for group in (fc, gloo):
        torch._dynamo.reset()
        before = _graphs()
        mesh = DeviceMesh.from_group(group, "cpu")
        model = Blocks()
        for layer in model.layers:
            layer.compile(backend="aot_eager")
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        _train(model, torch.optim.Adam(model.parameters(), lr=0.01))
        compiled.append(_graphs() - before)
        params.append(torch.cat([p.full_tensor().view(-1) for p in model.parameters()]))
    _same(*params)
    return compiled


def test_fsdp2_compiled(pool):
    for compiled in pool.run(check_fsdp2_compiled):
        assert all(n > 0 for n in compiled), compiled  # compiled on both backends
