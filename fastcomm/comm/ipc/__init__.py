"""``ipc`` backend: kernel collectives for the ranks of one node (see ``communicator``).

CPU tensors: the shm segment and schedules with the ``peer_reduce`` kernel as their reduction.
CUDA tensors: ``all_reduce`` and DDP bucket regions through the CUDA IPC transport (``cuda``,
imported on first use), everything else through Gloo. The transport's protocol (``descriptor``,
``plan``, ``region``) needs no CuPy; ``docs/ipc.md`` describes it.
"""

from .communicator import IpcCommunicator, cpu_reduction, kernel_reduce, reference_reduce

__all__ = ["IpcCommunicator", "cpu_reduction", "kernel_reduce", "reference_reduce"]
