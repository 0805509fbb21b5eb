"""ipc's shared DDP buckets on CUDA: a `PeerBucketRegion` of GPU memory mapped through IPC.

`CudaBucketRegion.setup` (a collective, through ``CudaIpcTransport.bucket_region``) allocates
this rank's area, exports it and maps the peers'; launches enqueue the region's steps on the
transport's stream and share its control block, spin bound and watchdog. The region is closed
with the transport. This module takes the transport as an argument and imports none of it.
"""

from __future__ import annotations

import torch

from ..errors import FastcommError
from ..work import Work
from .region import BUCKET_OP, PeerBucket, PeerBucketRegion, RegionLayout, region_layout

__all__ = ["CudaBucketRegion"]


class _DeviceMemory:
    """This rank's area: ``cudaMalloc``'d memory that torch tensors view (through
    ``__cuda_array_interface__``; each view holds this object). It is freed when the last view
    is gone (a ``.grad`` may outlive the region), and only once every peer has unmapped it."""

    def __init__(self, free, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "strides": None,
            "version": 2,
        }
        self._free = free
        self.ptr = ptr
        self.may_free = False

    def __del__(self) -> None:
        if self.may_free and self.ptr:
            ptr, self.ptr = self.ptr, 0
            try:
                self._free(ptr)
            except Exception:  # noqa: BLE001 - at exit the CUDA context may be gone, and
                # the memory with it; there is nobody to report to from a finalizer
                return


class CudaBucketRegion(PeerBucketRegion):
    """A :class:`PeerBucketRegion` of GPU memory mapped through CUDA IPC, run on its
    transport's stream (see ``docs/ipc.md``). Build with :meth:`setup` (a collective,
    through ``CudaIpcTransport.bucket_region``)."""

    def __init__(self, transport, key: str, layout: RegionLayout, memory: _DeviceMemory,
                 bases: torch.Tensor, opened: list[int]) -> None:
        area = torch.as_tensor(memory, device=transport.device)
        super().__init__(transport.rank, transport.size, layout, area, bases,
                         transport._control, transport._max_spins,
                         transport.timeout.total_seconds())
        self.transport = transport
        self.device = transport.device
        self._key = key
        self._memory = memory
        self._opened = opened

    @classmethod
    def setup(cls, transport, area_bytes: int, max_buckets: int, cap_bytes: int | None,
              key: str) -> CudaBucketRegion | str:
        """Every rank allocates its area, exports it and maps its peers'. Returns the region,
        or on every rank the reasons some rank could not allocate (the caller falls back).

        Raises:
            FastcommError: a rank could not map a peer's area (on every rank).
            StoreTimeoutError: a rank did not answer within the transport's timeout.
        """
        layout = region_layout(area_bytes, transport.size, max_buckets)
        rank, size, store, timeout = (transport.rank, transport.size, transport.store,
                                      transport.timeout)
        rt, total = transport._rt, layout.total_bytes
        why, ptr, handle = None, 0, None
        if cap_bytes is not None and total > cap_bytes:
            why = (f"the shared buckets need {total} bytes of GPU memory, over the cap of "
                   f"{cap_bytes}")
        else:
            with torch.cuda.device(transport.device), transport._cupy_device:
                try:
                    ptr = rt.malloc(total)
                    rt.memset(ptr, 0, total)
                    rt.deviceSynchronize()  # zeroed flags before any peer can see them
                    handle = rt.ipcGetMemHandle(ptr)
                except Exception as exc:  # noqa: BLE001 - out of memory: every rank falls back
                    if ptr:
                        rt.free(ptr)
                        ptr = 0
                    why = f"cannot allocate {total} bytes on {transport.device}: {exc}"
        gathered = store.all_gather_object(f"{key}/areas", rank, size, (why, handle), timeout)
        failed = [f"rank {r}: {w}" for r, (w, _) in enumerate(gathered) if w]
        if failed:
            if ptr:
                rt.free(ptr)
            return "; ".join(failed)
        opened: list[int] = []
        error = None
        with torch.cuda.device(transport.device), transport._cupy_device:
            try:
                for peer, (_, theirs) in enumerate(gathered):
                    if peer != rank:
                        opened.append(transport.map_peer(peer, theirs))
            except Exception as exc:  # noqa: BLE001 - reported on every rank below
                error = f"{type(exc).__name__}: {exc}"
        errors = store.all_gather_object(f"{key}/mapped", rank, size, error, timeout)
        if any(errors):
            with torch.cuda.device(transport.device), transport._cupy_device:
                for p in opened:
                    rt.ipcCloseMemHandle(p)
                # a peer may have mapped this area: freeing it under that mapping is undefined,
                # so it is kept (it goes with the process)
            raise FastcommError(
                f"rank {rank}: the ipc bucket region could not be mapped: "
                + "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)
            )
        addresses = []
        it = iter(opened)
        for peer in range(size):
            addresses.append(ptr if peer == rank else next(it))
        bases = torch.tensor(addresses, dtype=torch.int64, device=transport.device)
        device_index = transport.device.index

        def free(p: int, rt=rt, cupy_device=transport._cupy_device) -> None:
            with torch.cuda.device(device_index), cupy_device:
                rt.free(p)

        memory = _DeviceMemory(free, ptr, total)
        return cls(transport, key, layout, memory, bases, opened)

    def _check_usable(self, op: str) -> None:
        super()._check_usable(op)
        self.transport._raise_if_unusable(op)

    def _run(self, bucket: PeerBucket, steps: list, descriptor: int, scale: float) -> Work:
        """Enqueues the steps on the transport's stream, after the caller's stream."""
        flat = bucket.flat
        return self.transport.enqueue(
            BUCKET_OP, flat, lambda: self._execute(steps, flat.dtype, scale, descriptor)
        )

    def close(self) -> None:
        """Waits for the transport's stream, meets the peers, unmaps their areas; this rank's
        own is freed once every peer has unmapped it and its last view is gone. After a
        failure the ranks do not meet: the areas stay mapped until the processes end."""
        if self._closed:
            return
        self._closed = True
        t = self.transport
        t.stream.synchronize()
        healthy = t.failure() is None
        timeout = t.timeout
        if healthy:  # no kernel of any rank reads an area after this
            t.store.barrier(f"{self._key}/idle", self.size, timeout)
        with torch.cuda.device(t.device), t._cupy_device:
            for ptr in self._opened:
                t._rt.ipcCloseMemHandle(ptr)
        self._opened = []
        if healthy:
            t.store.barrier(f"{self._key}/unmapped", self.size, timeout)
            self._memory.may_free = True
        self.area = None  # the buckets' views keep the memory until they go
        self._memory = None

