"""fastcomm as a ``torch.distributed`` backend: ``dist.init_process_group("fastcomm")``.

``import fastcomm`` registers the backend name ``"fastcomm"`` (CPU and CUDA, torch's extended
API). For every group of that backend torch calls :func:`create_process_group`, which returns a
:class:`FastcommProcessGroup`: a Python ``dist.ProcessGroup`` that torch keeps as the group
itself (the default group, ``new_group``, a ``DeviceMesh`` dimension). Each c10d method maps the
call onto the :class:`~.base.Communicator` contract; nothing here moves or reduces data.

Which object does what:

- ``group.communicator``: the CPU communicator ``fastcomm.init()`` would build on the group's
  store (``communicator_for``: shm on one host, hier across hosts, else Gloo). Built at group
  creation. ``fastcomm.ddp.DDP`` given the group uses it directly (no second wrap).
- CUDA tensors: the CUDA transport is built on the group's first CUDA operation, which every
  member must issue (a collective, not a send/recv): the fastcomm CUDA communicator
  (``communicator_for(device=cuda)``: NCCL through CuPy, or ``ipc``), or, for the device-map
  form ``"cpu:fastcomm,cuda:nccl"``, torch's own backend of that name, to which CUDA calls
  are forwarded unchanged.
- ``group.gloo``: a ``ProcessGroupGloo`` over the same ranks, built at group creation (a
  send/recv involves two ranks only, so it cannot be built lazily); the CPU communicator's own
  Gloo part when it has one. It takes what the contract has no fast path for:
  ``send``/``recv``/``recv_anysource`` where the CPU communicator is not shm (``p2p``: on shm
  they run on its tagged mailboxes), and non-contiguous tensors of
  ``all_gather_single``/``reduce_scatter_single`` (those of ``allreduce``/``broadcast``/
  ``reduce`` and of the calls of unequal sizes run on a contiguous copy). The bitwise ops, the
  extra dtypes (``bool``, ``int16``, unsigned) and several tensors in one
  ``allreduce``/``reduce``/``broadcast`` run on the communicator. ``gather``, ``scatter``,
  ``alltoall`` (lists), ``all_to_all_single`` with split sizes, ``allgather`` /
  ``reduce_scatter`` lists of unequal sizes and ``allgather_coalesced`` are the
  communicator's v-calls (``vcoll.py``), their sizes agreed inside the call.
  It is also the group's registered C++ backend, so torch's introspection
  (``group._device_types``, ``group._get_backend``) sees a CPU backend. A collective handed to
  it is first compared across the ranks through the communicator (what each rank sends to and
  expects from each other, the dtype, root and reduce op): Gloo aborts the process when ranks
  disagree on sizes, fastcomm raises ``ValueError`` on every rank and the group stays usable.

``dist.monitored_barrier`` refuses every backend but Gloo by name; :func:`monitored_barrier`
(``fastcomm.monitored_barrier``) is the same call for these groups, over the group's store.

Autograd: tensors that require grad are written through detached aliases (the communicator's
entry detaches them), so a collective never enters or breaks the autograd graph.

Work: a call torch issues synchronously (``opts.asyncOp`` false: ``dist.all_reduce(t)``) runs
on the caller's thread, on the communicator's synchronous lane, and returns a
:class:`FinishedWork`; an asynchronous one (``async_op=True``, DDP's buckets, FSDP2) returns a
:class:`FastcommWork` over the communicator's (or Gloo's) own work. Both are ``dist._Work``
subclasses; their futures' value is the list of output tensors, as torch's own backends give
it; errors are raised by ``wait()`` and carried by the future, naming the rank and the
operation (and, for a call handed to Gloo, the group and the peer of a send or receive).

Complex tensors go through their real view; data that is only moved (``broadcast``, gathers,
``all_to_all``) goes through a byte view whatever its dtype.
"""

from .group import BACKEND_NAME, FastcommProcessGroup, create_process_group, monitored_barrier
from .works import FastcommWork, FinishedWork

__all__ = [
    "BACKEND_NAME", "FastcommProcessGroup", "FastcommWork", "FinishedWork", "create_process_group",
    "monitored_barrier",
]
