"""The write-back that hands the reduced buffer over as ``.grad`` (``Reducer.hand_over``).

On 2 CPU ranks over a torch Gloo group, against torch DDP (bit-identical, ``atol=0``): with
``zero_grad(set_to_none=True)`` each ``.grad`` becomes a view of its reduced bucket and the
buffer is reused; gradients a caller still holds are never written again; gradients that
existed before backward (``set_to_none=False``, ``no_sync`` accumulation) are copied into, as
torch does; ``hand_over_grads=False`` copies everywhere.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.ddp.common import assert_same_state, batches, init_torch_dist, loss_of, wrap_pair
from tests.harness import pool_fixture


def _step(model, opt, x, y, *, set_to_none: bool = True) -> None:
    opt.zero_grad(set_to_none=set_to_none)
    loss_of("mlp", model(x), y).backward()
    opt.step()


def _grads(model) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters()]


def _same_grads(ours, theirs) -> None:
    """Bit-identical gradients (in a function: no loop variable outlives it and holds one)."""
    for a, b in zip(_grads(ours), _grads(theirs), strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def check_handed_over_and_reused():
    init_torch_dist()
    ours, theirs = wrap_pair("mlp", process_group=dist.group.WORLD)
    assert ours.reducer.hands_over
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    flats = []
    for x, y in batches("mlp", 4):
        for model, opt in zip((ours, theirs), opts, strict=True):
            _step(model, opt, x, y)
        assert all(g._base is not None for g in _grads(ours)), "no .grad was handed over"
        flats.append([b.flat.data_ptr() for b in ours.reducer.buckets])
        _same_grads(ours, theirs)
    # the buckets are rebuilt once, after the first step; from then on the same buffers
    assert flats[2:] == flats[1:-1], f"a dropped .grad's buffer was not reused: {flats}"
    assert_same_state(ours, theirs)


def check_held_gradients_stay():
    init_torch_dist()
    ours, theirs = wrap_pair("mlp", process_group=dist.group.WORLD)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    held = []
    for x, y in batches("mlp", 3):
        for model, opt in zip((ours, theirs), opts, strict=True):
            _step(model, opt, x, y)
        mine = _grads(ours)
        # the caller keeps this step's gradients: later steps must not write them
        held.append((mine, [g.clone() for g in mine], _grads(theirs)))
    for mine, copies, torch_grads in held:
        for g, c, t in zip(mine, copies, torch_grads, strict=True):
            torch.testing.assert_close(g, c, atol=0, rtol=0)
            torch.testing.assert_close(g, t, atol=0, rtol=0)
    assert_same_state(ours, theirs)


def check_existing_gradients_copied():
    init_torch_dist()
    ours, theirs = wrap_pair("mlp", process_group=dist.group.WORLD)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    data = batches("mlp", 5)
    for x, y in data[:2]:
        for model, opt in zip((ours, theirs), opts, strict=True):
            _step(model, opt, x, y, set_to_none=False)
    before = _grads(ours)
    for model, opt in zip((ours, theirs), opts, strict=True):  # accumulate, then reduce
        opt.zero_grad(set_to_none=False)
        with model.no_sync():
            loss_of("mlp", model(data[2][0]), data[2][1]).backward()
        loss_of("mlp", model(data[3][0]), data[3][1]).backward()
        opt.step()
    after = _grads(ours)
    assert all(a is b for a, b in zip(before, after, strict=True)), ".grad objects replaced"
    _same_grads(ours, theirs)
    assert_same_state(ours, theirs)


def check_turned_off():
    from fastcomm.ddp import DDP
    from tests.ddp.common import build

    init_torch_dist()
    model = DDP(build("mlp"), process_group=dist.group.WORLD)
    model.config.hand_over_grads = False
    model.reducer.comm_hook = None  # plans again, reading the option
    assert not model.reducer.hands_over
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches("mlp", 2):
        _step(model, opt, x, y)
    assert all(g._base is None for g in _grads(model))


def check_small_gradients_copied():
    """Under the default mean of 16 KiB a gradient (the test MLP's are smaller), the per-gradient
    check would cost more than the copy it saves: copied, and as torch's."""
    from fastcomm.ddp.config import SHARED_MIN_MEAN_BYTES

    init_torch_dist()
    ours, theirs = wrap_pair("mlp", process_group=dist.group.WORLD)
    assert ours.reducer.hands_over
    ours.config.shared_min_mean_bytes = SHARED_MIN_MEAN_BYTES
    ours.reducer.comm_hook = None  # plans again, reading the option
    assert not ours.reducer.hands_over
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    for x, y in batches("mlp", 3):
        for model, opt in zip((ours, theirs), opts, strict=True):
            _step(model, opt, x, y)
        assert all(g._base is None for g in _grads(ours))
        _same_grads(ours, theirs)
    assert_same_state(ours, theirs)


# the test models' gradients average under the 16 KiB from which buckets are handed over
pool = pool_fixture(2, timeout=180, env={"FASTCOMM_DDP_SHARED_MIN_MEAN_BYTES": "0"})


def test_handed_over_and_reused(pool):
    pool.run(check_handed_over_and_reused)


def test_held_gradients_stay(pool):
    pool.run(check_held_gradients_stay)


def test_existing_gradients_copied(pool):
    pool.run(check_existing_gradients_copied)


def test_turned_off(pool):
    pool.run(check_turned_off)


def test_small_gradients_copied(pool):
    pool.run(check_small_gradients_copied)
