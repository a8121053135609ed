"""Peer copies for the expert migration: map the expert tensors of the other GPUs of this node into this process.

With every rank's mapping of its node peers (`share_weights`), `MigrationExecutor(peer_weights=...)` turns an
``nvlink`` transfer into a pull by its destination: one cudaMemcpyAsync per expert tensor out of the source's old slot
(the copy engines over NVLink; no SMs, no NCCL kernels beside the model's, one side posts). CUDA tensors travel as
CUDA IPC handles taken out of torch's shareable handle (as SGLang's own weight sharing exports them) and are opened on
this rank's device with lazy peer access, through SGLang's ctypes wrapper of the CUDA runtime (its custom all-reduce
maps peer buffers the same way); CPU tensors (the multi-process tests) as the shared files they live in.
Measured (two H200s, eplb/async_shuffle_4_peer_ep2_h200.json): correct, half the decode thread's work per boundary,
but a higher decode p99 during moves than NCCL. Posted by the transfer thread (a one-node plan, since session 17,
eplb/async_mover_1_ep2_h200.json): 15-29 us of decode-thread work per boundary, the migration phase's decode p99 at
0.97-1.005x steady, the whole rebalance's not shown better than NCCL's: SGLANG_H20_EPLB_ASYNC_PEER is off by default.
"""
from __future__ import annotations

import datetime
import functools
import logging
import pickle
from typing import Mapping, Sequence

import torch

from sglang_h20.eplb import throttle
from sglang_h20.eplb.placement import Topology

log = logging.getLogger("sglang_h20.eplb.migration")


class _MappedSlots:
    """A peer's expert tensor [slots, ...], mapped into this process by CUDA IPC (opened on this rank's device, with
    lazy peer access: no CUDA context on the peer's GPU): slot j is `slot_bytes` at ptr + j * stride. A pull is one
    cudaMemcpyAsync on the caller's stream: the copy engines over NVLink, no SM."""

    def __init__(self, ptr: int, stride: int, slot_bytes: int):
        self.ptr, self.stride, self.slot_bytes = ptr, stride, slot_bytes

    def pull(self, j: int, dst: torch.Tensor, stream) -> None:  # pragma: no cover - GPU only
        if dst.numel() * dst.element_size() != self.slot_bytes or not dst.is_contiguous():
            raise RuntimeError(f"staging slot of {dst.numel() * dst.element_size()} B for a {self.slot_bytes} B slot")
        _cudart().memcpy_async(dst.data_ptr(), self.ptr + j * self.stride, self.slot_bytes, stream.cuda_stream)


class _CudaRT:
    """The loaded CUDA runtime (SGLang's ctypes wrapper, as its custom all-reduce uses it) plus cudaMemcpyAsync."""

    def __init__(self):
        import ctypes

        from sglang.srt.distributed.device_communicators.cuda_wrapper import CudaRTLibrary, cudaIpcMemHandle_t

        self.rt, self.handle_t, self._ctypes = CudaRTLibrary(), cudaIpcMemHandle_t, ctypes
        self._memcpy = self.rt.lib.cudaMemcpyAsync
        self._memcpy.restype = ctypes.c_int
        self._memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        self.opened: dict[bytes, int] = {}  # IPC handle -> its base address here (each opened once per process)

    def open(self, handle: bytes) -> int:  # pragma: no cover - GPU only
        if handle not in self.opened:
            h = self.handle_t()
            self._ctypes.memmove(self._ctypes.addressof(h), handle, min(len(handle), self._ctypes.sizeof(h)))
            self.opened[handle] = int(self.rt.cudaIpcOpenMemHandle(h).value)
        return self.opened[handle]

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:  # pragma: no cover - GPU only
        err = self._memcpy(dst, src, nbytes, 4, stream)  # cudaMemcpyDefault: UVA picks the route
        if err:
            raise RuntimeError(f"cudaMemcpyAsync: {self.rt.cudaGetErrorString(err)}")


@functools.lru_cache(maxsize=1)
def _cudart() -> _CudaRT:
    return _CudaRT()


def _export(t: torch.Tensor):
    """What a peer needs to map expert tensor `t` [slots, ...]: ("cuda", IPC handle, byte offset, slot stride, slot
    bytes) or, on the CPU (tests), ("cpu", file, dtype, shape, strides, offset) of a tensor made by
    `torch.from_file(..., shared=True)`."""
    if not t.is_cuda:
        name = t.untyped_storage().filename
        if name is None:
            raise RuntimeError("a CPU expert tensor must live in a shared file (torch.from_file(..., shared=True))")
        return ("cpu", name, t.dtype, tuple(t.shape), t.stride(), t.storage_offset(), t.untyped_storage().nbytes())
    es = t.element_size()
    if t.dim() < 1 or not t[0].is_contiguous():
        raise RuntimeError(f"expert tensor {tuple(t.shape)} has non-contiguous slots")
    shared = t.untyped_storage()._share_cuda_()  # (device, handle, size, offset, ...): SGLang's IPC path too
    return ("cuda", _ipc_handle(bytes(shared[1])), int(shared[3]) + t.storage_offset() * es, t.stride(0) * es,
            t[0].numel() * es)


def _ipc_handle(shareable: bytes) -> bytes:
    """The cudaIpcMemHandle_t (64 bytes) in torch's shareable handle: raw in old torch; since torch 2.x one version
    byte, one type byte ('c': a cudaMalloc block; 'e': an expandable segment, which has no such handle), then it."""
    if len(shareable) == 64:
        return shareable
    if len(shareable) >= 66 and shareable[1:2] == b"c":
        return shareable[2:66]
    raise RuntimeError(f"not a cudaMalloc block's IPC handle (type {shareable[1:2]!r}: expandable segments?)")


def _map(exported):
    if exported[0] == "cpu":
        _, name, dtype, shape, stride, offset, nbytes = exported
        storage = torch.UntypedStorage.from_file(name, shared=True, nbytes=nbytes)
        return torch.empty(0, dtype=dtype).set_(storage, offset, shape, stride)
    _, handle, offset, stride, slot_bytes = exported
    return _MappedSlots(_cudart().open(handle) + offset, stride, slot_bytes)


def _touch(mapped, weights) -> None:
    """One small pull from every mapped peer tensor, here (the placement thread), synchronized: the first copy out
    of a peer's memory enables peer access (lazily, cudaIpcMemLazyEnablePeerAccess): the likely cause, not
    confirmed, of the one 16 ms boundary of the decode thread at the first rebalance of an EP-2 server
    (eplb/async_shuffle_4_peer_ep2_h200.json). Added after that run: not yet run on a GPU."""
    cuda = [m for ms in mapped.values() for m in ms if isinstance(m, _MappedSlots)]
    if not cuda:
        return
    any_w = next(t for ws in weights.values() for t in ws)
    scratch = torch.empty(16, dtype=torch.uint8, device=any_w.device)
    side = torch.cuda.Stream(any_w.device)
    for m in cuda:  # 16 bytes of each
        throttle.point()
        _cudart().memcpy_async(scratch.data_ptr(), m.ptr, min(16, m.slot_bytes), side.cuda_stream)
    side.synchronize()


def share_weights(store, rank: int, topology: Topology, weights: Mapping[int, Sequence[torch.Tensor]],
                  timeout_s: float = 60.0) -> dict[tuple[int, int], list] | None:
    """Publish this rank's expert tensors to the ranks of its node and map theirs here, {(peer rank, layer): per
    tensor, its mapping}. CUDA tensors travel as CUDA IPC handles (opened on this rank's device; pulled with
    cudaMemcpyAsync), CPU tensors (tests) as the shared files they live in. Collective over the store's ranks:
    None on EVERY rank when any rank could not publish or map (expandable segments, no IPC, CPU tensors not in a
    shared file), so the choice is the same everywhere. Once per server: expert tensors never move (CUDA graphs hold
    their pointers), so the mappings stay valid."""
    world, gpn = topology.num_gpus, topology.gpus_per_node
    peers = [r for r in range(world) if r != rank and r // gpn == rank // gpn]
    wait = datetime.timedelta(seconds=timeout_s)
    ok, why, mapped = True, "", {}
    try:
        exported = {}
        for l, ws in weights.items():
            throttle.point()
            exported[int(l)] = [_export(t) for t in ws]
        store.set(f"weights/{rank}", b"1" + pickle.dumps(exported))
    except Exception as e:
        ok, why = False, f"rank {rank} cannot publish its expert tensors: {type(e).__name__}: {e}"
        store.set(f"weights/{rank}", b"0")
    try:
        if peers:
            store.wait([f"weights/{r}" for r in peers], wait)
        for r in peers:
            v = store.get(f"weights/{r}")
            if v[:1] != b"1":
                raise RuntimeError(f"rank {r} published none")
            for l, ex in pickle.loads(v[1:]).items():
                throttle.point()
                mapped[(r, l)] = [_map(x) for x in ex]
        _touch(mapped, weights)
    except Exception as e:
        if ok:
            ok, why = False, f"rank {rank} cannot map its peers' expert tensors: {type(e).__name__}: {e}"
    store.set(f"ok/{rank}", b"1" if ok else b"0")
    store.wait([f"ok/{r}" for r in range(world)], wait)
    if all(store.get(f"ok/{r}") == b"1" for r in range(world)):
        return mapped
    if why:
        log.warning("EPLB migration: no peer copies (%s); every transfer goes through the process group", why)
    return None
