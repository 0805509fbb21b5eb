"""Drop-in DistributedDataParallel with bucketed, overlapped allreduce."""

from . import hooks
from .bucket import GradBucket
from .config import DDPConfig
from .ddp import DDP, DistributedDataParallel

__all__ = ["DDP", "DDPConfig", "DistributedDataParallel", "GradBucket", "hooks"]
