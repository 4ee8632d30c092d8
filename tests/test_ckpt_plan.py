"""The pure parts of checkpoints: the shard plan and the manifest (no torch, no files)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpcstagger.checkpoint.manifest import (
    build_manifest, decode_manifest, encode_manifest, parse_step_dirname, shard_filename, step_dirname,
    validate_manifest,
)
from hpcstagger.checkpoint.sharding import TensorSpec, layout_signature, plan_shards
from hpcstagger.errors import CheckpointError

shapes = st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple)
specs_st = st.lists(st.tuples(shapes, st.sampled_from([1, 2, 4, 8])), min_size=0, max_size=12).map(
    lambda xs: [TensorSpec(f"t{i}", "x", s, isz) for i, (s, isz) in enumerate(xs)])


@settings(max_examples=300, deadline=None)
@given(specs=specs_st, n=st.integers(1, 7), min_split=st.sampled_from([0, 1, 64, 10_000]))
def test_pieces_tile_every_tensor_and_shards_are_balanced(specs, n, min_split):
    plan = plan_shards(specs, n, min_split=min_split)
    for s in specs:
        pieces = sorted((p for p in plan.pieces if p.key == s.key), key=lambda p: p.start)
        assert pieces, s
        pos = 0
        for p in pieces:
            assert p.start == pos and 0 <= p.shard < n
            assert p.whole == (p.start == 0 and p.count == s.numel)
            pos += p.count
        assert pos == s.numel
        assert len({p.shard for p in pieces}) == len(pieces)  # one piece per tensor per shard
    sizes = plan.shard_bytes()
    total = sum(s.nbytes for s in specs)
    assert sum(sizes) == total
    # Each shard is off its ideal share by at most one unsplittable tensor (or element) per cut.
    slack = max([s.nbytes for s in specs if s.nbytes < min_split] + [s.itemsize for s in specs] + [0])
    for k, size in enumerate(sizes):
        ideal = total * (k + 1) // n - total * k // n
        assert abs(size - ideal) <= 2 * slack, (sizes, ideal, slack)
    # Deterministic: every rank computes the same plan.
    assert plan_shards(specs, n, min_split=min_split) == plan


def test_big_tensor_is_split_evenly_and_small_ones_stay_whole():
    specs = [TensorSpec("emb", "float32", (1000, 1000), 4), TensorSpec("bias", "float32", (10,), 4)]
    plan = plan_shards(specs, 4, min_split=1 << 20)
    emb = [p for p in plan.pieces if p.key == "emb"]
    assert [p.shard for p in emb] == [0, 1, 2, 3]
    assert sum(p.count for p in emb) == 1_000_000
    assert max(p.count for p in emb) - min(p.count for p in emb) <= 20  # the 40-byte bias shifts the cuts
    bias = [p for p in plan.pieces if p.key == "bias"]
    assert len(bias) == 1 and bias[0].whole and bias[0].shard == 3


def test_plan_rejects_bad_input():
    with pytest.raises(ValueError, match="nshards"):
        plan_shards([], 0)
    with pytest.raises(ValueError, match="duplicate"):
        plan_shards([TensorSpec("a", "x", (1,), 4)] * 2, 1)


def test_layout_signature_sees_keys_dtypes_and_shapes():
    a = [TensorSpec("a", "float32", (2, 3), 4)]
    assert layout_signature(a) == layout_signature(list(a))
    assert layout_signature(a) != layout_signature([TensorSpec("a", "float32", (3, 2), 4)])
    assert layout_signature(a) != layout_signature([TensorSpec("a", "bfloat16", (2, 3), 2)])
    assert layout_signature(a) != layout_signature([TensorSpec("b", "float32", (2, 3), 4)])


def test_step_and_shard_names():
    assert step_dirname(42) == "step-000000042"
    assert parse_step_dirname("step-000000042") == 42
    assert parse_step_dirname("step-1234567890") == 1234567890
    for bad in ("step-", "step-x", "tmp", "step-1.tmp"):
        assert parse_step_dirname(bad) is None
    assert shard_filename(3, 4) == "shard-00003-of-00004.h5"
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(CheckpointError):
            step_dirname(bad)


def _manifest(**over):
    tensors = {"w": {"kind": "torch", "dtype": "float32", "shape": [2, 3], "device": "cpu", "storage": "<f4",
                     "pieces": [{"shard": 0, "dataset": "/w", "start": 0, "count": 4, "checksum": "a" * 16},
                                {"shard": 1, "dataset": "/w", "start": 4, "count": 2, "checksum": "b" * 16}]}}
    shards = [{"rank": r, "file": shard_filename(r, 2), "size": 100, "checksum": "c" * 16} for r in range(2)]
    args = dict(step=7, world_size=2, tree={"w": {"__hpcstagger__": "tensor", "key": "w"}}, tensors=tensors,
                shards=shards, versions={"torch": "x"})
    args.update(over)
    return build_manifest(**args)


def test_manifest_round_trip_and_checksum():
    m = _manifest()
    back = decode_manifest(encode_manifest(m))
    assert back == m
    validate_manifest(back)
    tampered = dict(m, step=8)
    with pytest.raises(CheckpointError, match="manifest checksum mismatch"):
        validate_manifest(tampered)
    with pytest.raises(CheckpointError, match="not valid JSON"):
        decode_manifest(encode_manifest(m)[:-20])


@pytest.mark.parametrize("change,match", [
    (lambda m: m["tensors"]["w"]["pieces"].pop(), "cover 4 of 6"),
    (lambda m: m["tensors"]["w"]["pieces"][1].update(start=5), "do not tile"),
    (lambda m: m["tensors"]["w"]["pieces"][1].update(shard=2), "names shard 2"),
    (lambda m: m["shards"].pop(), "does not match the world size"),
    (lambda m: m["shards"][0].update(file="../x.h5"), "bad shard entry"),
])
def test_manifest_structure_errors(change, match):
    m = _manifest()
    change(m)
    m = build_manifest(tree=m["state"], **{k: m[k] for k in ("step", "world_size", "tensors", "shards", "versions")})
    with pytest.raises(CheckpointError, match=match):
        validate_manifest(m)


def test_tensor_spec_sizes():
    s = TensorSpec("x", "bfloat16", (3, 0, 2), 2)
    assert s.numel == 0 and s.nbytes == 0
    assert TensorSpec("y", "float64", (), 8).nbytes == 8 == math.prod(()) * 8
