"""What a 4 KiB ``dist.batch_isend_irecv`` exchange costs below fastcomm: torch's part, the
engine's part, and what is left to the adapter.

    python bench/p2p_floor.py [OUT.json]      # rounds: FASTCOMM_BENCH_ROUNDS (default 5)

Figures (us per exchange, best and median block of each round, 2 ranks on one host):

- ``torch-python-group``: ``batch_isend_irecv`` of one isend and one irecv on a Python
  ``ProcessGroup`` whose ``send``/``recv`` return a finished work and move nothing (one
  process): torch's own wrappers (``P2POp``, the list check, ``isend``/``irecv``), the least any
  Python group pays;
- ``torch-cpp-group``: the same on torch's C++ ``FakeProcessGroup`` (backend ``"fake"``), the
  least a C++ backend pays;
- ``engine``: shm's tagged engine alone, its one-chunk send and receive, no torch;
- ``engine-through-torch``: ``batch_isend_irecv`` on the fastcomm group with its ``send``/``recv``
  replaced (on this instance) by the engine's one-chunk calls: no checks, no flight record,
  no statistics; the floor of any adapter written in Python or C above this engine;
- ``fastcomm``: ``batch_isend_irecv`` on the fastcomm group as users call it.

The spin stays on (``FASTCOMM_SHM_SPIN_US=20``): on a crowded host the automatic choice turns
it off, and each receive would sleep instead, which measures the host.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CALLS, BLOCKS = 1000, 15
ROUNDS = int(os.environ.get("FASTCOMM_BENCH_ROUNDS", "5"))


def _blocks(fn, barrier=None, slowest=None) -> tuple[float, float]:
    for _ in range(300):
        fn()
    times = []
    for _ in range(BLOCKS):
        if barrier is not None:
            barrier()
        start = time.perf_counter()
        for _ in range(CALLS):
            fn()
        elapsed = (time.perf_counter() - start) / CALLS * 1e6
        times.append(slowest(elapsed) if slowest is not None else elapsed)
    return min(times), statistics.median(times)


def _torch_floor(kind: str) -> None:
    """One process: ``batch_isend_irecv`` on a group that moves nothing; prints JSON."""
    x, out = torch.ones(1024), torch.empty(1024)
    if kind == "python":
        class Done(dist._Work):
            def wait(self, timeout=None):
                return True

        done = Done()

        class Nothing(dist.ProcessGroup):
            def send(self, tensors, dst, tag=0):
                return done

            def recv(self, tensors, src, tag=0):
                return done

            def getBackendName(self):
                return "nothing"

        dist.Backend.register_backend("nothing", lambda store, rank, size, timeout:
                                      Nothing(rank, size), devices=["cpu"])
        dist.init_process_group("nothing", store=dist.HashStore(), rank=0, world_size=2)
    else:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)

    def exchange():
        ops = [dist.P2POp(dist.isend, x, 1), dist.P2POp(dist.irecv, out, 1)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    print(json.dumps([_blocks(exchange) for _ in range(ROUNDS)]))


def _rank(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      FASTCOMM_SHM_SPIN_US="20")
    import fastcomm  # noqa: F401 - registers the backend
    from fastcomm.comm.c10d.works import finished_work
    from fastcomm.comm.calls import DTYPE_CODES

    torch.set_num_threads(1)
    dist.init_process_group("fastcomm")
    group = dist.group.WORLD
    x, received, peer = torch.ones(1024), torch.empty(1024), 1 - rank
    for _ in range(100):  # builds the engine
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, peer),
                                            dist.P2POp(dist.irecv, received, peer)]):
            work.wait()
    engine = group._mailboxes
    x_addr, out_addr, nbytes, code = x.data_ptr(), received.data_ptr(), x.nbytes, \
        DTYPE_CODES[x.dtype]
    sent, got = finished_work([x]), finished_work([received])

    def engine_send(tensors, dst, tag=0):
        if not engine.send_now(x_addr, nbytes, dst, 0, code):
            raise RuntimeError(f"rank {rank}: the engine's slot to rank {dst} was busy")
        return sent

    def engine_recv(tensors, src, tag=0):
        while not engine.recv_now(out_addr, nbytes, src, 0, code):
            pass
        return got

    def engine_alone():
        engine_send(None, peer)
        engine_recv(None, peer)

    def exchange():
        ops = [dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, received, peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    def slowest(value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    results: dict = {"engine": [], "engine-through-torch": [], "fastcomm": []}
    for _ in range(ROUNDS):
        results["fastcomm"].append(_blocks(exchange, dist.barrier, slowest))
        results["engine"].append(_blocks(engine_alone, dist.barrier, slowest))
        group.send, group.recv = engine_send, engine_recv  # this instance only
        try:
            results["engine-through-torch"].append(_blocks(exchange, dist.barrier, slowest))
        finally:
            del group.send, group.recv
    assert torch.equal(received, torch.ones(1024)), "the exchange moved the wrong bytes"
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--floor":
        _torch_floor(sys.argv[2])
        return
    out = sys.argv[1] if len(sys.argv) > 1 else None
    rounds: dict = {}
    for kind in ("python", "cpp"):
        text = subprocess.run([sys.executable, __file__, "--floor", kind], check=True,
                              capture_output=True, text=True, timeout=600).stdout
        rounds[f"torch-{kind}-group"] = json.loads(text.splitlines()[-1])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = f"/tmp/fastcomm-p2p-floor-{os.getpid()}.json"
    try:
        mp.spawn(_rank, args=(2, port, tmp), nprocs=2)
        with open(tmp) as f:
            rounds.update(json.load(f))
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    summary = {name: {"best_us": round(min(b for b, _ in r), 2),
                      "median_us": round(statistics.median(m for _, m in r), 2)}
               for name, r in rounds.items()}
    for name, figures in summary.items():
        print(f"{name:22s} best {figures['best_us']:6.2f} us  "
              f"median {figures['median_us']:6.2f} us")
    if out:
        with open(out, "w") as f:
            json.dump({"torch": torch.__version__, "cpus": os.cpu_count(), "rounds": rounds,
                       "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
