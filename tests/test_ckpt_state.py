"""Flattening a training state to JSON plus tensors and back, without pickle."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from hpcstagger.checkpoint.state import flatten, storage_dtype, unflatten
from hpcstagger.errors import CheckpointError
from support.ckpt_util import same


def _round_trip(state):
    tree, leaves = flatten(state)
    tree = json.loads(json.dumps(tree, allow_nan=False))  # what the manifest holds
    by_key = {}
    for leaf in leaves:
        data = leaf.raw.clone()  # the bytes a shard would hold
        if leaf.kind == "torch":
            t = data.view(getattr(torch, leaf.spec.dtype)).reshape(leaf.spec.shape)
        else:
            t = data.numpy().view(np.dtype(leaf.storage).newbyteorder("=")).reshape(leaf.spec.shape)
            t = t.astype(np.dtype(leaf.spec.dtype))
        by_key[leaf.spec.key] = t
    return unflatten(tree, lambda key, tag: by_key[key]), leaves


def test_values_survive_exactly():
    state = {
        "int": 3, "big": 2**80, "float": 0.1, "nan": float("nan"), "inf": float("-inf"), "none": None, "flag": True,
        "text": "ü/x", "bytes": b"\x00\xff", "tuple": (1, (2, "a")), "list": [1, [2.5]],
        "int_keys": {0: "a", 1: "b"}, "mixed_keys": {1: 2, "1": 3, 2.5: 4, None: 5},
        "tag_collision": {"__hpcstagger__": "tensor", "key": "x"},
        "dtype": torch.bfloat16, "device": torch.device("cpu"),
        "np_scalar": np.float32(1.5), "np_int": np.int64(7),
        "python_rng": random.Random(1).getstate(), "numpy_rng": np.random.RandomState(2).get_state(),
        "torch_rng": torch.get_rng_state(),
    }
    back, _ = _round_trip(state)
    same(state, back)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
                                   torch.int64, torch.uint8, torch.bool, torch.complex64, torch.float8_e4m3fn,
                                   torch.float8_e5m2, torch.uint16])
def test_tensor_dtypes_are_lossless(dtype):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(5, 3, generator=g) * 10
    t = (base > 0) if dtype == torch.bool else base.to(dtype) if not dtype.is_complex else torch.complex(base, -base)
    back, leaves = _round_trip({"t": t, "scalar": t[0, 0].clone(), "empty": t[:0]})
    same({"t": t, "scalar": t[0, 0].clone(), "empty": t[:0]}, back)
    assert leaves[0].storage == storage_dtype(str(dtype).removeprefix("torch."), t.element_size())


def test_numpy_arrays_keep_dtype_and_byte_order():
    arrays = {"be": np.arange(6, dtype=">i4").reshape(2, 3), "f": np.linspace(0, 1, 7), "b": np.array([True, False]),
              "c": np.array([1 + 2j], np.complex128), "scalar": np.array(3.5, np.float32)}
    back, _ = _round_trip(arrays)
    for k, a in arrays.items():
        assert back[k].dtype == a.dtype and np.array_equal(back[k], a), k


def test_non_contiguous_and_grad_tensors():
    p = torch.nn.Parameter(torch.randn(4, 4))
    t = torch.randn(6, 4).t()  # non-contiguous
    back, _ = _round_trip({"p": p, "t": t})
    assert torch.equal(back["p"], p.detach()) and not back["p"].requires_grad
    assert torch.equal(back["t"], t)


def test_modules_and_optimizers_become_state_dicts():
    m = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    m(torch.randn(1, 3)).sum().backward()
    opt.step()
    back, _ = _round_trip({"model": m, "opt": opt})
    same(m.state_dict(), back["model"])
    same(opt.state_dict(), back["opt"])


def test_keys_with_slashes_and_duplicates_stay_distinct():
    state = {"a/b": torch.ones(1), "a": {"b": torch.zeros(1)}, 1: {".": torch.full((1,), 2.0)},
             "1": {".": torch.full((1,), 3.0)}}
    tree, leaves = flatten(state)
    keys = [leaf.spec.key for leaf in leaves]
    assert len(set(keys)) == 4
    assert all("/." not in "/" + k and not k.startswith(".") for k in keys), keys
    back, _ = _round_trip(state)
    same(state, back)


@pytest.mark.parametrize("bad,match", [
    ({"x": object()}, "'x' is a object"),
    ({"x": {1, 2}}, "'x' is a set"),
    ({"x": {(1, 2): 3}}, "dict key of type tuple"),
    ({"x": np.array(["a"])}, "numpy array of dtype <U1"),
    ({"s": torch.eye(2).to_sparse()}, "only dense tensors"),
])
def test_unsupported_values_are_named(bad, match):
    with pytest.raises(CheckpointError, match=match):
        flatten(bad)
