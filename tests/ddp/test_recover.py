"""In-place recovery: 3 ranks on shm (or Gloo) under ``fastcomm-run --recover in-process``, one
SIGKILLed from inside at a chosen point; the survivors finish every step, agree bitwise, and
match a replay of the same steps averaged over the ranks each step was reduced over. Across
hosts (``FASTCOMM_HOST_ID`` set per rank): ``hier`` and Gloo, from the launcher's keys."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from tests.launch._util import clean_env, run, script, spares_left

STEPS = 6
KILL_STEP = 3

# argv: out dir, the points ("<rank>:<point>", comma separated), shared buckets (0/1), a comm
# hook ("", "int8": QuantizeState over the world, "int8-torch": over torch's default group,
# "powersgd": PowerSGD over the DDP's), and "compile" to train torch.compile(DDP(model))
JOB = """
import json, os, signal, sys
import torch
from torch import nn
import fastcomm
from fastcomm.ddp import DDP
from fastcomm.ddp import ddp as ddp_module, recover
from fastcomm.comm.shm import buckets as shm_buckets

out, points, shared, comm_hook = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4]
compiled = sys.argv[5:] == ["compile"]
STEPS, KILL_STEP = {steps}, {kill_step}
comm = fastcomm.init(timeout=60)
me = comm.rank
if comm_hook == "int8-torch":
    import torch.distributed as dist
    dist.init_process_group("gloo")
mine = [p.split(":", 1)[1] for p in points.split(",") if int(p.split(":", 1)[0]) == me]
point = mine[0] if mine else ""
state = {{"step": -1}}

def die():
    os.kill(os.getpid(), signal.SIGKILL)

if point == "init":  # in DDP()'s broadcast of rank 0's state
    real = ddp_module.broadcast_tensors
    def broadcast(*args, **kwargs):
        die()
    ddp_module.broadcast_tensors = broadcast
if point == "recovery":  # during the survivors' agreement, once it reported itself
    real_post = recover.Membership._post_here
    def post(self, epoch, where):
        real_post(self, epoch, where)
        die()
    recover.Membership._post_here = post
if point == "launch":  # launching bucket 1, its predecessor launched: compiled, from a tap
    from fastcomm.ddp import reducer as reducer_module
    real_launch = reducer_module.Reducer._launch
    def launch(self, bucket):
        if state["step"] == KILL_STEP and bucket.index == 1:
            die()
        real_launch(self, bucket)
    reducer_module.Reducer._launch = launch
if point == "reduce":  # inside a shared bucket's reduction (its peers' slices half pushed)
    real_reduce = shm_buckets.ShmBucketRegion._reduce
    calls = [0]
    def reduce(self, bucket):
        if state["step"] == KILL_STEP and bucket.index == 1:
            die()
        real_reduce(self, bucket)
    shm_buckets.ShmBucketRegion._reduce = reduce

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                      nn.Linear(512, 4))
if point == "backward":  # in a gradient hook, before DDP's: later buckets already launched
    def hook(param):
        if state["step"] == KILL_STEP:
            die()
    model[0].weight.register_post_accumulate_grad_hook(hook)
ddp = DDP(model, bucket_cap_mb=0.25, shared_buckets=shared,
          gradient_as_bucket_view=True if shared else None)
if comm_hook == "int8":  # the state holds the world: the communicator that fails
    from fastcomm.ddp.hooks import QuantizeState, int8_compress_hook
    hook_state = QuantizeState(comm)
    ddp.register_comm_hook(hook_state, int8_compress_hook)
elif comm_hook == "int8-torch":  # the state holds a torch group: it cannot be rebuilt
    from fastcomm.ddp.hooks import QuantizeState, int8_compress_hook
    hook_state = QuantizeState(dist.group.WORLD)
    ddp.register_comm_hook(hook_state, int8_compress_hook)
elif comm_hook == "powersgd":  # compressing from the first step
    from fastcomm.ddp.hooks import PowerSGDState, powersgd_hook
    hook_state = PowerSGDState(None, start_powerSGD_iter=0, min_compression_rate=1)
    ddp.register_comm_hook(hook_state, powersgd_hook)
seen = []
ddp.on_membership_change(seen.append)
opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
done, sizes, graphs = [], [], []
if compiled:
    import torch._dynamo
    counters = torch._dynamo.utils.counters
    trained = torch.compile(ddp, backend="aot_eager")
else:
    trained = ddp
for step in range(STEPS):
    state["step"] = step
    if point == "between" and step == KILL_STEP:  # at a step boundary, before its forward
        die()
    gen = torch.Generator().manual_seed(1000 * me + step)
    x = torch.randn(8, 16, generator=gen)
    opt.zero_grad(set_to_none=True)
    trained(x).square().mean().backward()
    if compiled:  # graphs compiled so far, after each step
        graphs.append(counters["stats"]["unique_graphs"])
    sizes.append([ddp.world_size, list(ddp._recovery.membership.members)])
    if point == "optimizer" and step == KILL_STEP:
        die()
    opt.step()
    done.append(step)
torch.save([p.detach().clone() for p in model.parameters()], os.path.join(out, f"p{{me}}.pt"))
with open(os.path.join(out, f"r{{me}}.json"), "w") as fh:
    changes = [[c.epoch, c.rank, c.world_size, list(c.lost), list(c.members), c.where]
               for c in ddp._recovery.changes]
    json.dump({{"done": done, "sizes": sizes, "changes": changes, "rank": ddp.rank,
               "seen": len(seen), "backend": ddp.comm.backend, "graphs": graphs,
               "seen_by": [c.detected_by for c in ddp._recovery.changes],
               "watch": ddp._recovery.watch is not None, "traced": ddp.reducer.traced_step,
               "calls": dict(ddp.comm.stats.calls), "buckets": len(ddp.reducer.buckets),
               "shm_keys": ddp.comm.store.check(["shm/name"]) or ddp.comm.store.check(
                   ["shm/hosts/0"]) if ddp.comm.backend == "shm" else None,
               "hook_comm": None if not comm_hook else [hook_state.phases.first is ddp.comm,
                                                   hook_state.phases.first.size]}}, fh)
fastcomm.shutdown()
"""


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 4))


def _replay(sizes: list) -> list[torch.Tensor]:
    """The survivors' training replayed here: each step's gradients averaged over the ranks
    that step was reduced over (``sizes[step][1]``, original ranks in rank order)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step, (_, members) in enumerate(sizes):
        grads = []
        for r in members:
            model.zero_grad(set_to_none=True)
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1000 * r + step))
            model(x).square().mean().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        scale = torch.tensor(1.0 / len(members), dtype=torch.float32).item()
        for k, p in enumerate(model.parameters()):
            total = grads[0][k] * scale
            for g in grads[1:]:
                total = total + g[k] * scale
            p.grad = total
        opt.step()
    return [p.detach() for p in model.parameters()]


def _launch(tmp_path, points: str, shared: bool, hook: str = "", backend: str = "shm",
            compiled: bool = False, **env: str):
    """The 3-rank job on CPU tensors over `backend` (named: on a GPU machine the automatic
    choice would be ipc, where the shared-bucket kill points never come); `env` added to the
    ranks' environment."""
    path = script(tmp_path, "job.py", JOB.format(steps=STEPS, kill_step=KILL_STEP))
    result = run(
        ["--nproc-per-node", "3", "--recover", "in-process", path, tmp_path, points,
         "1" if shared else "0", hook, *(["compile"] if compiled else [])],
        tmp_path, timeout=150, env=clean_env(FASTCOMM_BACKEND=backend, **env),
    )
    return result


def _check(tmp_path, result, lost: set[int], *, last_members: list[int] | None = None,
           replay: bool = True):
    assert result.returncode == 0, result.stderr[-4000:]
    survivors = sorted({0, 1, 2} - lost)
    reports = {r: json.loads((tmp_path / f"r{r}.json").read_text()) for r in survivors}
    params = {r: torch.load(tmp_path / f"p{r}.pt") for r in survivors}
    for r in lost:
        assert not (tmp_path / f"r{r}.json").exists()
        assert f"rank {r} (local_rank {r}" in result.stderr and "was lost" in result.stderr
    first = survivors[0]
    for r in survivors:  # every step done once, in order: the counter never goes back
        assert reports[r]["done"] == list(range(STEPS))
        assert reports[r]["sizes"] == reports[first]["sizes"]
        for a, b in zip(params[r], params[first], strict=True):
            assert torch.equal(a, b), f"rank {r} differs from rank {first}"
    sizes = reports[first]["sizes"]
    assert sizes[-1][0] == len(survivors)
    assert sizes[-1][1] == (last_members or survivors)
    assert sorted(reports[r]["rank"] for r in survivors) == list(range(len(survivors)))
    if not replay:  # a compressing hook's steps are not plain averages
        return reports, sizes
    expected = _replay(sizes)
    untrained = [p.detach() for p in _model().parameters()]
    for got, want, before in zip(params[first], expected, untrained, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert not torch.equal(got, before)
    return reports, sizes


@pytest.mark.timeout(200)
def test_kill_in_backward_packed_buckets(tmp_path):
    """Killed in a gradient hook while later buckets are in flight: the step in flight is
    completed among the survivors (averaged over 2), nothing is redone twice."""
    result = _launch(tmp_path, "1:backward", shared=False)
    reports, sizes = _check(tmp_path, result, {1})
    assert [s[0] for s in sizes] == [3] * KILL_STEP + [2] * (STEPS - KILL_STEP)
    change = reports[0]["changes"][0]
    assert change[:5] == [1, 0, 2, [1], [0, 2]]
    assert change[5] == f"backward {KILL_STEP}"
    assert reports[2]["changes"][0][1] == 1  # rank 2 is renumbered 1
    assert reports[0]["seen"] == reports[2]["seen"] == 1  # on_membership_change called


@pytest.mark.timeout(200)
def test_kill_in_backward_shared_buckets(tmp_path):
    """Killed in a gradient hook with shared buckets: the survivors' new segment is made
    without a store round, and they redo the step in their new shared buckets, in place (the
    successor makes no all-reduce of its own, only the buckets' in-place ones: the redo's and
    those of every later step)."""
    result = _launch(tmp_path, "1:backward", shared=True)
    reports, sizes = _check(tmp_path, result, {1})
    assert [s[0] for s in sizes] == [3] * KILL_STEP + [2] * (STEPS - KILL_STEP)
    for r in (0, 2):
        # the successor's segment was made without a store round (Segment.setup_successor)
        assert reports[r]["shm_keys"] is False, reports[r]
        calls = reports[r]["calls"]
        assert "all_reduce" not in calls, calls
        # every bucket of the step redone and of the steps after it
        assert calls["shared_all_reduce"] == reports[r]["buckets"] * (STEPS - KILL_STEP), calls


@pytest.mark.timeout(200)
@pytest.mark.parametrize("backend", ["gloo", "ipc"])
def test_kill_in_backward_on_gloo_and_ipc(tmp_path, backend):
    """On Gloo (one host): rank 1 is killed in a gradient hook while buckets are in flight;
    the liveness watch sees it gone from ``/proc`` and aborts the survivors' Gloo waits (one of
    them may wait on the other, not on the dead rank); they rebuild Gloo over themselves and
    redo the step. On ipc (its CPU part here: shm with the kernels' reduction) the same, the
    watch aborting every part (``IpcCommunicator.abort``)."""
    result = _launch(tmp_path, "1:backward", shared=False, backend=backend)
    reports, sizes = _check(tmp_path, result, {1})
    assert [s[0] for s in sizes] == [3] * KILL_STEP + [2] * (STEPS - KILL_STEP)
    for r in (0, 2):
        assert reports[r]["backend"] == backend and reports[r]["watch"]
        assert reports[r]["changes"][0][3:] == [[1], [0, 2], f"backward {KILL_STEP}"]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("hook", ["int8", "powersgd"])
def test_kill_in_backward_with_a_compressing_hook(tmp_path, hook):
    """Killed in backward with a compressing comm hook registered (its state holding the
    world, or following the DDP's): the survivors redo the step, then the hook reduces over
    the new communicator (a second one split from it); their parameters agree bitwise."""
    result = _launch(tmp_path, "1:backward", shared=False, hook=hook)
    reports, sizes = _check(tmp_path, result, {1}, replay=False)
    assert [s[0] for s in sizes] == [3] * KILL_STEP + [2] * (STEPS - KILL_STEP)
    assert reports[0]["changes"][0][5] == f"backward {KILL_STEP}"
    for r in (0, 2):
        assert reports[r]["hook_comm"] == [True, 2], reports[r]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_kill_in_a_compiled_backward(tmp_path, backend):
    """``torch.compile(DDP(model))``: killed inside the compiled backward, where a tap's op
    launches bucket 1 (bucket 0 launched); the survivors finish every step with the replay's
    parameters, and compile nothing after the shrink (the graphs do not depend on the
    communicator). A parameter's gradient hook, the eager test's kill point, runs after the
    compiled backward, when every bucket may already be reduced."""
    result = _launch(tmp_path, "1:launch", shared=False, backend=backend, compiled=True)
    reports, sizes = _check(tmp_path, result, {1})
    assert [s[0] for s in sizes] == [3] * KILL_STEP + [2] * (STEPS - KILL_STEP)
    for r in (0, 2):
        assert reports[r]["traced"], reports[r]  # the compiled backward's taps (taps.py)
        graphs = reports[r]["graphs"]
        assert graphs[0] > 0, graphs
        assert graphs[KILL_STEP - 1:] == [graphs[KILL_STEP - 1]] * (STEPS - KILL_STEP + 1), graphs


@pytest.mark.timeout(200)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_kill_inside_shared_bucket_reduction(tmp_path, compiled):
    """Killed inside a shared bucket's reduction (its peers' slices partly pushed into the
    survivors' buckets): the survivors redo the step from their own gradients' copies.
    Compiled (``torch.compile(DDP(model))``), the reduction is launched from inside the
    compiled backward, by the op its taps call (``fastcomm.ddp.taps``)."""
    result = _launch(tmp_path, "2:reduce", shared=True, compiled=compiled)
    reports, sizes = _check(tmp_path, result, {2})
    assert [s[0] for s in sizes] == [3] * KILL_STEP + [2] * (STEPS - KILL_STEP)
    for r in (0, 1) if compiled else ():  # through the taps; nothing compiled after the shrink
        assert reports[r]["traced"], reports[r]
        graphs = reports[r]["graphs"]
        assert graphs[KILL_STEP - 1:] == [graphs[KILL_STEP - 1]] * (STEPS - KILL_STEP + 1), graphs


@pytest.mark.timeout(200)
def test_kill_in_optimizer_step(tmp_path):
    """Killed after its step's reduction: the survivors' next step runs over 2."""
    result = _launch(tmp_path, "0:optimizer", shared=True)
    _, sizes = _check(tmp_path, result, {0})
    assert [s[0] for s in sizes] == [3] * (KILL_STEP + 1) + [2] * (STEPS - KILL_STEP - 1)


@pytest.mark.timeout(200)
def test_a_hook_state_holding_a_torch_group_follows_the_shrink(tmp_path):
    """Rank 1 dies in ``DDP()``'s broadcast; the int8 hook's state holds torch's default group,
    which spans the lost rank: it reduces over the survivors' communicator instead (a split of
    it for its second phase), and the survivors agree bitwise."""
    result = _launch(tmp_path, "1:init", shared=False, hook="int8-torch")
    reports, sizes = _check(tmp_path, result, {1}, replay=False)
    assert [s[0] for s in sizes] == [2] * STEPS
    for r in (0, 2):
        assert reports[r]["hook_comm"] == [True, 2], reports[r]


@pytest.mark.timeout(200)
def test_kill_in_initial_broadcast(tmp_path):
    """Rank 0, the broadcast's source, dies in DDP(): rank 1 becomes rank 0 and broadcasts."""
    result = _launch(tmp_path, "0:init", shared=False)
    reports, sizes = _check(tmp_path, result, {0})
    assert [s[0] for s in sizes] == [2] * STEPS
    assert reports[1]["changes"][0][5] == "init"
    assert reports[1]["seen"] == 0  # registered after DDP() returned


@pytest.mark.timeout(200)
def test_second_loss_during_recovery(tmp_path):
    """Rank 1 dies in backward, rank 2 right after it reported itself in the agreement: the
    next epoch leaves rank 0 alone, which finishes the job."""
    result = _launch(tmp_path, "1:backward,2:recovery", shared=False)
    reports, sizes = _check(tmp_path, result, {1, 2})
    assert [s[0] for s in sizes] == [3] * KILL_STEP + [1] * (STEPS - KILL_STEP)
    assert reports[0]["changes"][-1][2] == 1


@pytest.mark.parametrize("value, on", [("in-process", True), ("IN-PROCESS", True), ("", False),
                                       ("restart", False)])
def test_recovery_enabled_reads_the_variable(value, on):
    from fastcomm.ddp.recover import recovery_enabled

    assert recovery_enabled({"FASTCOMM_RECOVER": value}) is on
    assert recovery_enabled({}) is False


def test_recovery_enabled_refuses_other_values():
    from fastcomm.ddp.recover import recovery_enabled

    with pytest.raises(ValueError, match="FASTCOMM_RECOVER='sometimes'"):
        recovery_enabled({"FASTCOMM_RECOVER": "sometimes"})


SPANNING = """
import json, os, sys, warnings
import torch
os.environ["FASTCOMM_HOST_ID"] = "host" + os.environ["RANK"]  # as if on two hosts
os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
import torch.distributed as dist
from fastcomm.ddp import DDP

dist.init_process_group("gloo")
group = dist.new_group([0, 1])  # a torch group: its communicator cannot be aborted
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    ddp = DDP(torch.nn.Linear(4, 2), process_group=group)
text = [str(w.message) for w in caught if "shrinks in place only" in str(w.message)]
with open(os.path.join(sys.argv[1], f"w{dist.get_rank()}.json"), "w") as fh:
    json.dump({"off": ddp._recovery is None, "warned": text, "backend": ddp.comm.backend}, fh)
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_ranks_on_several_hosts_warn_and_keep_the_restart(tmp_path):
    """A torch group across hosts: nothing here can abort its waits, so no shrink (a warning);
    the hier, Gloo and NCCL backends shrink across hosts."""
    path = script(tmp_path, "spanning.py", SPANNING)
    result = run(["--nproc-per-node", "2", "--recover", "in-process", path, tmp_path], tmp_path,
                 timeout=100)
    assert result.returncode == 0, result.stderr[-3000:]
    for r in range(2):
        got = json.loads((tmp_path / f"w{r}.json").read_text())
        assert got["off"] and len(got["warned"]) == 1, got
        assert got["backend"] == "torch" and "rebuilt over the survivors (hier, gloo, nccl); " \
            "these ranks span hosts on torch" in got["warned"][0], got


GROW = """
import json, os, signal, sys, time
import torch
from torch import nn
import fastcomm
from fastcomm.ddp import DDP

out, STEPS, KILL, comm_hook = sys.argv[1], {steps}, {kill_step}, sys.argv[2]
comm = fastcomm.init(timeout=60)
started = time.time()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                      nn.Linear(512, 4))
ddp = DDP(model, bucket_cap_mb=0.25)
if comm_hook:  # over the world: the replacement's is its stand-in, replaced as it joins
    from fastcomm.ddp.hooks import QuantizeState, int8_compress_hook
    ddp.register_comm_hook(QuantizeState(comm), int8_compress_hook)
me = ddp._recovery.membership.me  # the original rank; 3 for the replacement
opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
ddp.register_state("opt", opt)
joined = [ddp.join_step or None]
ddp.on_membership_change(
    lambda c: joined.__setitem__(0, int(c.where.split()[1])) if c.where.startswith("join")
    else None)
done, sizes, first = [], [], None
step, deadline = ddp.join_step, time.monotonic() + 90
while joined[0] is None or step < max(STEPS, joined[0] + 5):
    assert time.monotonic() < deadline, "no replacement joined"
    if me == 1 and step == KILL:
        os.kill(os.getpid(), signal.SIGKILL)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1000 * me + step))
    opt.zero_grad(set_to_none=True)
    ddp(x).square().mean().backward()
    opt.step()
    first = first or time.time()
    sizes.append([ddp.world_size, list(ddp._recovery.membership.members)])
    done.append(step)
    step += 1
    time.sleep(0.02)
torch.save([p.detach().clone() for p in model.parameters()], os.path.join(out, f"p{{me}}.pt"))
with open(os.path.join(out, f"r{{me}}.json"), "w") as fh:
    json.dump({{"done": done, "sizes": sizes, "join_step": ddp.join_step, "rank": ddp.rank,
               "joined": joined[0], "first_step_s": first - started,
               "spare": "FASTCOMM_SPARE_ACTIVATED" in os.environ}}, fh)
fastcomm.shutdown()
"""


@pytest.mark.timeout(200)
@pytest.mark.parametrize("comm_hook", ["", "int8"])
def test_replacement_joins_and_trains_in_step(tmp_path, comm_hook):
    """Rank 1 is killed at step 3; the launcher starts a replacement (--max-restarts 1) that
    joins at a step boundary with rank 0's parameters and optimizer state: at the end the
    three are bitwise equal and (without a compressing hook, whose state follows the joined
    communicator) match a replay of every step over its members."""
    path = script(tmp_path, "grow.py", GROW.format(steps=STEPS, kill_step=KILL_STEP))
    result = run(["--nproc-per-node", "3", "--recover", "in-process", "--max-restarts", "1",
                  path, tmp_path, comm_hook], tmp_path, timeout=180)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "starting a replacement for rank 1" in result.stderr
    reports = {r: json.loads((tmp_path / f"r{r}.json").read_text()) for r in (0, 2, 3)}
    params = {r: torch.load(tmp_path / f"p{r}.pt") for r in (0, 2, 3)}
    join = reports[3]["join_step"]
    assert join > KILL_STEP and reports[0]["joined"] == reports[2]["joined"] == join
    # started from the launcher's warm spare, which is gone with the job
    assert reports[3]["spare"] and not reports[0]["spare"]
    assert not spares_left(cwd=tmp_path)
    end = reports[0]["done"][-1] + 1
    assert reports[0]["done"] == reports[2]["done"] == list(range(end))
    assert reports[3]["done"] == list(range(join, end))
    assert reports[3]["rank"] == 2 and reports[3]["sizes"][0] == [3, [0, 2, 3]]
    for r in (2, 3):
        for a, b in zip(params[r], params[0], strict=True):
            assert torch.equal(a, b), f"rank {r} differs from rank 0"
    sizes = reports[0]["sizes"]
    assert [s[0] for s in sizes] == [3] * KILL_STEP + [2] * (join - KILL_STEP) + [3] * (
        end - join)
    if comm_hook:
        return
    for got, want in zip(params[0], _replay(sizes), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# ranks on hosts as FASTCOMM_HOST_ID says ("aabb": ranks 0, 1 on host a; 2, 3 on host b), each
# host's ranks numbered locally in order: liveness across hosts comes from the launcher's keys,
# not /proc. argv: out dir, the ranks killed in a gradient hook at KILL_STEP (comma separated)
SPAN_JOB = """
import json, os, signal, sys
rank, HOSTS = int(os.environ["RANK"]), "{hosts}"
os.environ.update(FASTCOMM_HOST_ID="host-" + HOSTS[rank],
                  LOCAL_RANK=str(HOSTS[:rank].count(HOSTS[rank])),
                  LOCAL_WORLD_SIZE=str(HOSTS.count(HOSTS[rank])))
import torch
from torch import nn
import fastcomm
from fastcomm.ddp import DDP

out, killed = sys.argv[1], [int(r) for r in sys.argv[2].split(",")]
STEPS, KILL_STEP = {steps}, {kill_step}
comm = fastcomm.init(backend="{backend}", timeout=30)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                      nn.Linear(512, 4))
state = {{"step": -1}}
if rank in killed:
    def hook(param):
        if state["step"] == KILL_STEP:
            os.kill(os.getpid(), signal.SIGKILL)
    model[0].weight.register_post_accumulate_grad_hook(hook)
ddp = DDP(model, bucket_cap_mb=0.25)
assert ddp._recovery is not None and ddp._recovery.watch is not None
opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
done, sizes = [], []
for step in range(STEPS):
    state["step"] = step
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1000 * rank + step))
    opt.zero_grad(set_to_none=True)
    ddp(x).square().mean().backward()
    sizes.append([ddp.world_size, list(ddp._recovery.membership.members)])
    opt.step()
    done.append(step)
torch.save([p.detach().clone() for p in model.parameters()], os.path.join(out, f"p{{rank}}.pt"))
with open(os.path.join(out, f"r{{rank}}.json"), "w") as fh:
    json.dump({{"done": done, "sizes": sizes, "backend": ddp.comm.backend,
               "changes": [[list(c.lost), c.where] for c in ddp._recovery.changes]}}, fh)
fastcomm.shutdown()
"""


@pytest.mark.timeout(200)
@pytest.mark.parametrize("killed", ["3", "2,3"], ids=["a rank of host b", "all of host b"])
def test_hier_across_hosts_recovers_in_place(tmp_path, killed):
    """hier over two hosts: ranks of host b killed mid-backward (one, or the whole host); the
    survivors learn it from the launcher's keys, rebuild hier over themselves and finish every
    step, bitwise equal, matching the replay."""
    _span(tmp_path, "aabb", "hier", killed)


@pytest.mark.timeout(200)
def test_gloo_across_hosts_recovers_in_place(tmp_path):
    """Gloo over three hosts (a rank each): rank 1 killed mid-backward; the survivors learn it
    from the launcher's key, rebuild Gloo over themselves and finish every step, bitwise
    equal, matching the replay."""
    _span(tmp_path, "abc", "gloo", "1")


def _span(tmp_path, hosts: str, backend: str, killed: str) -> None:
    job = SPAN_JOB.format(steps=STEPS, kill_step=KILL_STEP, hosts=hosts, backend=backend)
    path = script(tmp_path, "span.py", job)
    world = len(hosts)
    result = run(["--nproc-per-node", str(world), "--recover", "in-process", path, tmp_path,
                  killed], tmp_path, timeout=180)
    assert result.returncode == 0, result.stderr[-4000:]
    lost = [int(r) for r in killed.split(",")]
    survivors = [r for r in range(world) if r not in lost]
    reports = {r: json.loads((tmp_path / f"r{r}.json").read_text()) for r in survivors}
    params = {r: torch.load(tmp_path / f"p{r}.pt") for r in survivors}
    for r in survivors:
        assert reports[r]["done"] == list(range(STEPS))
        assert reports[r]["sizes"] == [[world, list(range(world))]] * KILL_STEP + [
            [len(survivors), survivors]] * (STEPS - KILL_STEP)
        assert reports[r]["changes"] == [[lost, f"backward {KILL_STEP}"]]
        assert reports[r]["backend"] == backend
        for a, b in zip(params[r], params[0], strict=True):
            assert torch.equal(a, b), f"rank {r} differs from rank 0"
    for got, want in zip(params[0], _replay(reports[0]["sizes"]), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
