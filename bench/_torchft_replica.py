"""One torchft 0.2.0 replica of bench/test_recover.py's job (run by torchft's own interpreter):

    python _torchft_replica.py OUT LIGHTHOUSE REPLICA STEPS KILL_STEP VICTIM
"""
import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
from torch import nn
from torch.distributed import TCPStore
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

out, lighthouse = sys.argv[1], sys.argv[2]
replica, steps, kill_step, victim = map(int, sys.argv[3:7])
torch.set_num_threads(1)
store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                      nn.Linear(1024, 256))
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

def state_dict():
    return {"model": model.state_dict(), "opt": opt.state_dict()}

def load_state_dict(sd):
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["opt"])

manager = Manager(
    pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), min_replica_size=2,
    load_state_dict=load_state_dict, state_dict=state_dict, replica_id=f"replica{replica}",
    lighthouse_addr=lighthouse, store_addr="127.0.0.1", store_port=store.port, rank=0,
    world_size=1, timeout=timedelta(seconds=10), quorum_timeout=timedelta(seconds=30),
)
ddp = DistributedDataParallel(manager, model)
optimizer = Optimizer(manager, opt)
gen = torch.Generator().manual_seed(replica)
x, y = torch.randn(64, 64, generator=gen), torch.randn(64, 256, generator=gen)
log = open(os.path.join(out, f"tft_{replica}.jsonl"), "w")
while manager.current_step() < steps:
    step = manager.current_step()
    if replica == victim and step == kill_step:
        with open(os.path.join(out, "kill.json"), "w") as fh:
            json.dump({"time": time.time(), "step": step}, fh)
        os.kill(os.getpid(), signal.SIGKILL)
    optimizer.zero_grad()
    nn.functional.mse_loss(ddp(x), y).backward()
    optimizer.step()
    log.write(json.dumps([step, time.time(), manager.current_step(),
                          manager.num_participants()]) + "\n")
    log.flush()
manager.shutdown()
