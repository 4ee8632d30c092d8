"""CUDA for the shared loader's GPU path: device memory shared between processes by IPC handles.

The calls go to the CUDA driver (``libcuda.so.1``, present wherever a GPU is) through ctypes, not
through torch's own IPC reductions: those keep a reference counter per exporting process in a
``/dev/shm/torch_*`` file, which a killed process leaves behind, and they pass pickled objects.
Here the exporter allocates its ring with ``cuMemAlloc`` and publishes the 64-byte handle as hex text;
an importer opens it with ``cuIpcOpenMemHandle`` and closes it when the last tensor over it is gone.
Tensors are built over raw device pointers through ``__cuda_array_interface__``.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

from hpcstagger.errors import ConfigError, LoaderError

log = logging.getLogger(__name__)

_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
_lib: Any = None


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]


def _driver() -> Any:
    global _lib
    if _lib is None:
        try:
            _lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise LoaderError(f"the CUDA driver library libcuda.so.1 cannot be loaded ({exc}); the shared "
                              "loader's GPU path needs an NVIDIA driver") from None
    return _lib


def _call(name: str, *args: Any) -> None:
    lib = _driver()
    fn = getattr(lib, name + "_v2", None) or getattr(lib, name)
    res = int(fn(*args))
    if res:
        text = ctypes.c_char_p()
        lib.cuGetErrorName(res, ctypes.byref(text))
        label = text.value.decode() if text.value else "unknown"
        raise LoaderError(f"the CUDA driver call {name} failed: {label} ({res})")


def resolve_device(spec: Any) -> tuple[int, str]:
    """(index, UUID) of the CUDA device ``spec`` names ("cuda", "cuda:1", a torch.device or an int);
    ConfigError when it is not a CUDA device or CUDA is not available."""
    import torch

    try:
        dev = torch.device(f"cuda:{spec}" if isinstance(spec, int) else spec)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"SharedLoader: device={spec!r} is not a device ({exc}); pass 'cuda' or 'cuda:N'") from None
    if dev.type != "cuda":
        raise ConfigError(f"SharedLoader: device={spec!r} is not a CUDA device; leave device unset for batches in "
                          "host memory")
    if not torch.cuda.is_available():
        raise ConfigError(f"SharedLoader: device={spec!r} but CUDA is not available here; leave device unset")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if not 0 <= index < torch.cuda.device_count():
        raise ConfigError(f"SharedLoader: device={spec!r}, but this process sees {torch.cuda.device_count()} "
                          "CUDA device(s)")
    return index, str(torch.cuda.get_device_properties(index).uuid)


def find_device(uuid: str) -> int:
    """The index, in this process, of the CUDA device with ``uuid``; LoaderError when it is not visible."""
    import torch

    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    raise LoaderError(f"the CUDA device {uuid} is not visible to the shared loader's GPU stager "
                      "(CUDA_VISIBLE_DEVICES differs between jobs?)")


class _Memory:
    """Device memory at ``ptr`` of ``size`` bytes, seen by torch through __cuda_array_interface__."""

    def __init__(self, ptr: int, size: int, index: int):
        self.ptr, self.size, self.index = ptr, size, index

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": (self.size,), "typestr": "|u1", "data": (self.ptr, False), "version": 2}

    def tensor(self) -> Any:
        """A uint8 tensor over the whole memory (it keeps this object, and so the memory, alive)."""
        import torch

        return torch.as_tensor(self, device=f"cuda:{self.index}")


class DeviceRing(_Memory):
    """Device memory this process allocated and exports (freed by :meth:`free`)."""

    def __init__(self, size: int, index: int):
        import torch

        torch.cuda.set_device(index)  # the runtime makes the device's primary context current here
        torch.cuda.synchronize(index)
        ptr = ctypes.c_uint64()
        _call("cuMemAlloc", ctypes.byref(ptr), ctypes.c_size_t(size))
        super().__init__(ptr.value, size, index)

    def handle(self) -> str:
        """The IPC handle of the memory, as hex text."""
        h = _IpcHandle()
        _call("cuIpcGetMemHandle", ctypes.byref(h), ctypes.c_uint64(self.ptr))
        return bytes(h.reserved).hex()

    def free(self) -> None:
        if self.ptr:
            ptr, self.ptr = self.ptr, 0
            _call("cuMemFree", ctypes.c_uint64(ptr))


class ImportedRing(_Memory):
    """Another process's device memory opened from its IPC handle; closed when garbage-collected."""

    def __init__(self, handle_hex: str, size: int, index: int):
        import torch

        raw = bytes.fromhex(handle_hex)
        if len(raw) != 64:
            raise LoaderError("the shared loader's GPU ring handle is malformed (a corrupted control file?)")
        with torch.cuda.device(index):
            torch.cuda.synchronize(index)  # the device's primary context is current in this thread
            h = _IpcHandle()
            ctypes.memmove(h.reserved, raw, 64)
            ptr = ctypes.c_uint64()
            _call("cuIpcOpenMemHandle", ctypes.byref(ptr), h, ctypes.c_uint(_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS))
        super().__init__(ptr.value, size, index)

    def __del__(self) -> None:
        ptr, self.ptr = getattr(self, "ptr", 0), 0
        if ptr:
            try:
                _call("cuIpcCloseMemHandle", ctypes.c_uint64(ptr))
            except Exception:  # never raise from a finaliser (the process may be shutting down)
                pass


def to_device(batch: Any, device: Any, *, non_blocking: bool = False) -> Any:
    """``batch`` with every tensor in it (in dicts, lists, tuples and namedtuples) moved to ``device``."""
    import torch

    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return {k: to_device(v, device, non_blocking=non_blocking) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(to_device(v, device, non_blocking=non_blocking) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device, non_blocking=non_blocking) for v in batch)
    return batch


def host_register(ptr: int, size: int) -> bool:
    """Page-lock ``size`` bytes of mapped host memory at ``ptr`` for fast copies; False if refused."""
    import torch

    err = int(torch.cuda.cudart().cudaHostRegister(ptr, size, 0))
    if err:
        log.info("cudaHostRegister of the shared loader's ring failed (CUDA error %d); copying from pageable "
                 "memory", err)
        return False
    return True


def host_unregister(ptr: int) -> None:
    import torch

    torch.cuda.cudart().cudaHostUnregister(ptr)


class DeviceConsumer:
    """A consumer's side of the GPU path: the imported device ring, and the fences that hold a
    batch's slot until the CUDA work queued before the consumer moved on has run."""

    def __init__(self, index: int, private: bool):
        from collections import deque

        self.index, self.private = index, private
        self.ring: Any = None
        self.slot_bytes = 0
        self.fences: deque[tuple[int, Any]] = deque()

    def batch(self, ctl: Any, mm: Any, s: int) -> Any:
        """Batch of host slot ``s`` (descriptor mapped at ``mm``) with its tensors on the device."""
        import torch

        from hpcstagger.loader import _ring as R

        if self.ring is None:
            rec = ctl.ipc()
            if rec is None:
                raise LoaderError("the shared pipeline's GPU ring was not published before its first batch "
                                  "(a bug; please report it)")
            self.ring = ImportedRing(str(rec["handle"]), int(rec["size"]), self.index).tensor()
            self.slot_bytes = int(rec["slot_bytes"])
        with torch.cuda.device(self.index):
            return R.decode(mm, 0, self.ring, s * self.slot_bytes, self.private)

    def release(self, me: Any, value: int) -> None:
        """Set ``me``'s released word to ``value`` once the work queued so far on the device has run."""
        import torch

        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.index))
        self.fences.append((value, ev))
        self.poll(me)

    def poll(self, me: Any) -> bool:
        """Release the batches whose CUDA work has run; True while some work is still to finish."""
        from hpcstagger.loader import _ring as R

        while self.fences and self.fences[0][1].query():
            me[R.C_RELEASED] = self.fences.popleft()[0]
        return bool(self.fences)

    def to_device(self, batch: Any) -> Any:
        """A batch this consumer prepared itself, its tensors moved to the device."""
        return to_device(batch, f"cuda:{self.index}")

    def close(self) -> None:
        self.ring = None
        self.fences.clear()
