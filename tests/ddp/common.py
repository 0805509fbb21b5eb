"""Shared pieces of the DDP checks: models, data, and fastcomm-vs-torch training runs.

Every check builds the same model twice from one seed, wraps one copy in torch's DDP and the
other in fastcomm's, feeds both the same per-rank batches (rank ``r`` draws from its own seed)
and steps an SGD optimizer on each. Why exact comparison holds for the plain reduction: with
two ranks every reduced element is ``0.5 * g0 + 0.5 * g1`` in both implementations -- the
halving is exact in binary floating point and one fp32 addition is commutative -- and the
rest of the step runs the same ops on the same data. Checks that change the arithmetic
(compression hooks, averaging over a different count) state their own tolerance.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from tests.harness import STATE


class LinearStack(nn.Module):
    """`depth` x ``Linear(width, width)`` in a module class of the tests' own: Dynamo compiles
    its call frame under torch's DDP as well (an ``nn.Sequential``'s it leaves to run eagerly
    there, so torch DDP "compiled" would be eager DDP)."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def init_torch_dist(backend: str = "gloo") -> None:
    """``init_process_group`` once per rank process (the pool's store, env:// style)."""
    if dist.is_initialized():
        return
    dist.init_process_group(
        backend,
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )
    STATE["torch_dist"] = backend


def rank() -> int:
    return int(os.environ["RANK"])


# ---------------------------------------------------------------------- models
class MLP(nn.Module):
    def __init__(self, sizes=(16, 32, 32, 4)):
        super().__init__()
        self.layers = nn.Sequential(
            *[
                m
                for a, b in zip(sizes[:-1], sizes[1:], strict=True)
                for m in (nn.Linear(a, b), nn.Tanh())
            ][:-1]
        )

    def forward(self, x):
        return self.layers(x)


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x)))
        return self.head(h.mean(dim=(2, 3)))


class Branchy(nn.Module):
    """``skip`` is used only when the batch mean is positive; ``never`` is never used."""

    def __init__(self, dynamic: bool = True):
        super().__init__()
        self.dynamic = dynamic
        self.inp = nn.Linear(16, 16)
        self.skip = nn.Linear(16, 16)
        self.never = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        if not self.dynamic or x.mean() > 0:
            h = h + self.skip(h)
        return self.out(h)


class Tied(nn.Module):
    """Input embedding and output projection share one weight."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 16)
        self.mid = nn.Linear(16, 16)
        self.proj = nn.Linear(16, 20, bias=False)
        self.proj.weight = self.embed.weight

    def forward(self, idx):
        return self.proj(torch.tanh(self.mid(self.embed(idx)))).mean(1)


MODELS = {"mlp": MLP, "convbn": ConvBN, "branchy": Branchy, "tied": Tied}


def build(name: str, seed: int = 0, **kwargs) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name](**kwargs)


def batches(name: str, steps: int, *, seed: int | None = None, batch: int = 8):
    """Per-rank batches ``(x, y)`` for model `name` (rank ``r`` uses seed ``100 + r``)."""
    gen = torch.Generator().manual_seed(100 + rank() if seed is None else seed)
    out = []
    for _ in range(steps):
        if name == "convbn":
            x = torch.randn(batch, 3, 6, 6, generator=gen)
        elif name == "tied":
            x = torch.randint(0, 20, (batch, 5), generator=gen)
        else:
            x = torch.randn(batch, 16, generator=gen)
        out.append((x, torch.randint(0, 4, (batch,), generator=gen)))
    return out


def loss_of(model_name: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if model_name == "tied":
        return ((out - 0.1 * y[:, None]) ** 2).mean()
    return nn.functional.cross_entropy(out, y)


def step(model, opt, model_name, x, y) -> float:
    opt.zero_grad(set_to_none=True)
    loss = loss_of(model_name, model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


def wrap_pair(model_name: str, *, model_kwargs=None, **ddp_kwargs):
    """(fastcomm DDP, torch DDP) over identical copies of the model."""
    from fastcomm.ddp import DDP

    init_torch_dist()
    torch_only = {k: v for k, v in ddp_kwargs.items() if k != "comm"}
    ours = DDP(build(model_name, **(model_kwargs or {})), **ddp_kwargs)
    theirs = nn.parallel.DistributedDataParallel(
        build(model_name, **(model_kwargs or {})), **torch_only
    )
    return ours, theirs


def assert_same_state(ours, theirs, *, atol: float = 0.0, rtol: float = 0.0) -> None:
    a, b = ours.state_dict(), theirs.state_dict()
    assert list(a) == list(b), (list(a), list(b))
    for key in a:
        torch.testing.assert_close(
            a[key], b[key], atol=atol, rtol=rtol, msg=lambda m, k=key: f"{k}: {m}"
        )


def train_both(
    model_name: str, steps: int = 4, *, lr: float = 0.1, model_kwargs=None, **ddp_kwargs
):
    """Trains both wrappers on the same batches; returns them."""
    ours, theirs = wrap_pair(model_name, model_kwargs=model_kwargs, **ddp_kwargs)
    opt_a = torch.optim.SGD(ours.parameters(), lr=lr, momentum=0.9)
    opt_b = torch.optim.SGD(theirs.parameters(), lr=lr, momentum=0.9)
    for x, y in batches(model_name, steps):
        step(ours, opt_a, model_name, x, y)
        step(theirs, opt_b, model_name, x, y)
    return ours, theirs
