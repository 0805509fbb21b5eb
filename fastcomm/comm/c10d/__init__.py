"""fastcomm as a ``torch.distributed`` backend: ``dist.init_process_group("fastcomm")``.

``import fastcomm`` registers the backend name ``"fastcomm"`` (CPU and CUDA). For every group
of that backend torch calls :func:`create_process_group`, which returns a
:class:`FastcommProcessGroup`: a Python ``dist.ProcessGroup`` whose methods map each c10d call
onto the :class:`~.base.Communicator` contract; nothing here moves or reduces data.

Invariants: ``group.communicator`` (the CPU communicator ``fastcomm.init()`` would build on the
group's store) and ``group.gloo`` (a ``ProcessGroupGloo`` over the same ranks, the registered
C++ backend) are built at group creation; the CUDA transport on the group's first CUDA
collective, which every member must issue. A collective handed to Gloo is compared across the
ranks first, so a disagreement raises ``ValueError`` on every rank instead of aborting. Tensors
that require grad are written through detached aliases.

What goes where, works and futures, dtypes: docs/torch_backend.md.
"""

from .group import BACKEND_NAME, FastcommProcessGroup, create_process_group, monitored_barrier
from .works import FastcommWork, FinishedWork

__all__ = [
    "BACKEND_NAME", "FastcommProcessGroup", "FastcommWork", "FinishedWork", "create_process_group",
    "monitored_barrier",
]
