"""``ipc`` backend: kernel collectives for the ranks of one node (see ``communicator``).

CPU tensors: the shm segment and schedules with the ``peer_reduce`` kernel as their reduction.
CUDA tensors: ``all_reduce`` through the CUDA IPC transport (``cuda``, imported on first use),
everything else through Gloo.
"""

from .communicator import IpcCommunicator, cpu_reduction, kernel_reduce, reference_reduce

__all__ = ["IpcCommunicator", "cpu_reduction", "kernel_reduce", "reference_reduce"]
