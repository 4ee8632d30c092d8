"""Turn a training state into a JSON tree plus a list of tensors, and back. Nothing is pickled.

A state is a dict that may hold ``nn.Module``s, optimizers and anything else with
``state_dict()``/``load_state_dict()`` (LR schedulers, GradScaler), tensors, numpy arrays, and plain
values (str, int, float, bool, None, bytes, lists, tuples, dicts with any str/int/float/bool keys,
``torch.dtype``, ``torch.device``, numpy scalars). :func:`flatten` returns the tree, in which every
tensor or array is replaced by a reference to its key, and the tensors themselves (no copies). JSON
cannot say everything Python can, so some values become tagged objects of the form
``{"__hpcstagger__": TAG, ...}``; :func:`unflatten` reverses that. Objects with ``state_dict()``
come back as their state dicts, ready for :func:`hpcstagger.checkpoint.restore`.
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable

from hpcstagger.errors import CheckpointError
from hpcstagger.checkpoint.sharding import TensorSpec

__all__ = ["Leaf", "flatten", "unflatten", "storage_dtype", "torch_dtype", "TAG"]

TAG = "__hpcstagger__"

# torch dtypes numpy stores natively; any other dtype is stored as unsigned ints of its width.
_NATIVE = {
    "float64": "<f8", "float32": "<f4", "float16": "<f2",
    "int64": "<i8", "int32": "<i4", "int16": "<i2", "int8": "|i1",
    "uint64": "<u8", "uint32": "<u4", "uint16": "<u2", "uint8": "|u1",
    "bool": "|b1", "complex128": "<c16", "complex64": "<c8",
}
_RAW = {1: "|u1", 2: "<u2", 4: "<u4", 8: "<u8", 16: "|V16"}


@dataclass
class Leaf:
    """One tensor of the state: its spec and a flat uint8 view of its bytes on its own device."""

    spec: TensorSpec
    kind: str            # "torch" or "numpy"
    device: str          # "cpu", "cuda:0", ...
    raw: Any             # 1-D torch.uint8 tensor over the tensor's bytes (shares memory when possible)
    storage: str         # numpy dtype string of the HDF5 dataset


def torch_dtype(name: str) -> Any:
    """The torch dtype called ``name`` ("bfloat16"); raises CheckpointError if this torch lacks it."""
    import torch

    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise CheckpointError(f"this checkpoint holds dtype {name!r}, which torch {torch.__version__} lacks; "
                              "load it with the torch version that wrote it")
    return dt


def storage_dtype(name: str, itemsize: int) -> str:
    """The numpy dtype string a torch dtype ``name`` is stored as in HDF5 (lossless)."""
    if name in _NATIVE:
        return _NATIVE[name]
    if itemsize not in _RAW:
        raise CheckpointError(f"cannot store dtype {name!r} of {itemsize} bytes per element")
    return _RAW[itemsize]


def _escape(part: str) -> str:
    if part == "":
        return "%E"
    part = part.replace("%", "%25").replace("/", "%2F")
    return part.replace(".", "%2E") if part in (".", "..") else part


class _Flattener:
    def __init__(self) -> None:
        self.leaves: list[Leaf] = []
        self.keys: set[str] = set()

    def key_for(self, path: list[str]) -> str:
        key = "/".join(_escape(p) for p in path) or "%E"
        base, n = key, 1
        while key in self.keys:
            n += 1
            key = f"{base}#{n}"
        self.keys.add(key)
        return key

    def tensor(self, t: Any, path: list[str], kind: str, dtype_name: str) -> dict:
        import torch

        if t.is_sparse or t.layout != torch.strided:
            raise CheckpointError(f"state entry {'/'.join(path)!r} is a {t.layout} tensor; only dense tensors "
                                  "can be checkpointed (call .to_dense() first)")
        if t.is_quantized:
            raise CheckpointError(f"state entry {'/'.join(path)!r} is a quantized tensor; dequantize it first")
        t = t.detach()
        raw = t.reshape(-1).view(torch.uint8)  # a view when t is contiguous, else one copy of t
        key = self.key_for(path)
        itemsize = t.element_size()
        spec = TensorSpec(key, dtype_name, tuple(int(d) for d in t.shape), itemsize)
        storage = _numpy_storage(dtype_name) if kind == "numpy" else storage_dtype(dtype_name, itemsize)
        self.leaves.append(Leaf(spec, kind, str(t.device), raw, storage))
        return {TAG: "tensor" if kind == "torch" else "ndarray", "key": key}

    def walk(self, obj: Any, path: list[str]) -> Any:
        import numpy as np
        import torch

        if obj is None or isinstance(obj, (bool, str)):
            return obj
        if isinstance(obj, int) and not isinstance(obj, bool):
            return int(obj)
        if isinstance(obj, float):
            return obj if math.isfinite(obj) else {TAG: "float", "value": repr(obj)}
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj, path, "torch", str(obj.dtype).removeprefix("torch."))
        if isinstance(obj, np.ndarray):
            if obj.dtype.kind not in "biufc":
                raise CheckpointError(f"state entry {'/'.join(path)!r} is a numpy array of dtype {obj.dtype}; "
                                      "only bool, integer, float and complex arrays can be checkpointed")
            arr = obj if obj.flags.c_contiguous else obj.copy(order="C")  # (ascontiguousarray makes 0-d 1-d)
            if not arr.dtype.isnative:
                arr = arr.astype(arr.dtype.newbyteorder("="))
            t = torch.from_numpy(arr.reshape(-1).view(np.uint8)).view(torch.uint8)
            return self._numpy_leaf(obj, arr, t, path)
        if isinstance(obj, np.generic):
            return {TAG: "npscalar", "dtype": obj.dtype.str, "value": self.walk(obj.item(), path)}
        if isinstance(obj, (bytes, bytearray)):
            return {TAG: "bytes", "base64": base64.b64encode(bytes(obj)).decode()}
        if isinstance(obj, torch.dtype):
            return {TAG: "dtype", "name": str(obj).removeprefix("torch.")}
        if isinstance(obj, torch.device):
            return {TAG: "device", "name": str(obj)}
        if isinstance(obj, tuple):  # also torch.Size and named tuples (which come back as tuples)
            return {TAG: "tuple", "items": [self.walk(v, path + [str(i)]) for i, v in enumerate(obj)]}
        if isinstance(obj, list):
            return [self.walk(v, path + [str(i)]) for i, v in enumerate(obj)]
        if isinstance(obj, dict):
            if all(isinstance(k, str) for k in obj) and TAG not in obj:
                return {k: self.walk(v, path + [k]) for k, v in obj.items()}
            items = []
            for k, v in obj.items():
                if not isinstance(k, (str, int, float, bool)) and k is not None:
                    raise CheckpointError(f"state entry {'/'.join(path)!r} has a dict key of type "
                                          f"{type(k).__name__}; use str, int, float or bool keys")
                items.append([self.walk(k, path), self.walk(v, path + [str(k)])])
            return {TAG: "dict", "items": items}
        if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
            cls = f"{type(obj).__module__}.{type(obj).__qualname__}"
            return {TAG: "state_dict", "class": cls, "value": self.walk(obj.state_dict(), path)}
        raise CheckpointError(
            f"state entry {'/'.join(path) or '<root>'!r} is a {type(obj).__name__}, which a checkpoint cannot "
            "hold; store tensors, numpy arrays, objects with state_dict(), or JSON-like values "
            "(str, int, float, bool, None, bytes, list, tuple, dict)")

    def _numpy_leaf(self, orig: Any, arr: Any, raw: Any, path: list[str]) -> dict:
        key = self.key_for(path)
        spec = TensorSpec(key, orig.dtype.str, tuple(int(d) for d in arr.shape), arr.dtype.itemsize)
        self.leaves.append(Leaf(spec, "numpy", "cpu", raw, _numpy_storage(arr.dtype.str)))
        return {TAG: "ndarray", "key": key}


def _numpy_storage(dtype_str: str) -> str:
    import numpy as np

    return np.dtype(dtype_str).newbyteorder("<").str if np.dtype(dtype_str).itemsize > 1 else np.dtype(dtype_str).str


def flatten(state: Any) -> tuple[Any, list[Leaf]]:
    """Split ``state`` into a JSON-able tree and its tensor leaves (in a deterministic order).

    Raises CheckpointError, naming the entry, for a value a checkpoint cannot hold.
    """
    f = _Flattener()
    tree = f.walk(state, [])
    return tree, f.leaves


def unflatten(tree: Any, tensor: Callable[[str, str], Any]) -> Any:
    """Rebuild the state from ``tree``; ``tensor(key, tag)`` returns the tensor or array for a key."""
    import numpy as np
    import torch

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(v) for v in node]
        if not isinstance(node, dict):
            return node
        tag = node.get(TAG)
        if tag is None:
            return {k: walk(v) for k, v in node.items()}
        if tag in ("tensor", "ndarray"):
            return tensor(node["key"], tag)
        if tag == "float":
            return float(node["value"])
        if tag == "npscalar":
            return np.dtype(node["dtype"]).type(walk(node["value"]))
        if tag == "bytes":
            return base64.b64decode(node["base64"])
        if tag == "dtype":
            return torch_dtype(node["name"])
        if tag == "device":
            return torch.device(node["name"])
        if tag == "tuple":
            return tuple(walk(v) for v in node["items"])
        if tag == "dict":
            return {walk(k): walk(v) for k, v in node["items"]}
        if tag == "state_dict":
            return walk(node["value"])
        raise CheckpointError(f"unknown tagged value {tag!r} in the checkpoint manifest; it was written by a "
                              "newer hpcstagger: upgrade hpcstagger to load it")

    return walk(tree)
