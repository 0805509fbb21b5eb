"""Which communicator a comm hook's torch group stands for once in-place recovery replaced the
DDP's: a group of the DDP's first members follows the line; another group of the same size
stays its own (3 Gloo ranks: the DDP over ranks 0 and 1, a hook group over ranks 0 and 2)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from fastcomm.comm import group_communicator
from fastcomm.comm.world import replace_world
from fastcomm.ddp import DDP
from fastcomm.ddp.bucket import GradBucket
from fastcomm.ddp.hooks.default import hook_comm
from tests.ddp.common import MLP, init_torch_dist, rank
from tests.harness import pool_fixture

pool = pool_fixture(3, env={"CUDA_VISIBLE_DEVICES": ""}, timeout=120)


def check_hook_groups_after_a_replacement() -> dict | None:
    init_torch_dist("gloo")
    # every rank makes every group, in the same order
    ddp_group, same_members, other_members = (
        dist.new_group([0, 1]), dist.new_group([0, 1]), dist.new_group([0, 2]))
    me = rank()
    if me == 2:
        return None
    torch.manual_seed(0)
    ddp = DDP(MLP(), process_group=ddp_group)
    before = ddp.comm
    # a successor over the same members, recorded as in-place recovery records its own
    successor = group_communicator(same_members)
    replace_world(before, successor, ddp._torch_members)
    bucket = GradBucket(ddp.reducer.buckets[0], None, is_last=True, scale=0.5,
                        bucket_view=False, comm=successor)
    found = {
        "members": ddp._torch_members,
        "ddp_group": hook_comm(ddp_group, bucket) is successor,
        "same_members": hook_comm(same_members, bucket) is successor,
        "old_comm": hook_comm(before, bucket) is successor,
    }
    if me == 0:  # rank 1 is no member of it
        other = hook_comm(other_members, bucket)
        found["other_members"] = other is successor
        found["other_size"] = other.size
    return found


def test_a_torch_group_follows_the_line_only_with_the_ddps_members(pool):
    results = pool.run(check_hook_groups_after_a_replacement)
    assert results[2] is None
    for me in (0, 1):
        found = results[me]
        assert found["members"] == (0, 1), found
        assert found["ddp_group"] and found["same_members"] and found["old_comm"], found
    # as large as the DDP's group, but not its members: reduced over its own ranks
    assert results[0]["other_members"] is False and results[0]["other_size"] == 2, results[0]
