"""The checkpoint manifest and on-disk names. Pure logic: building, encoding and validating.

A checkpoint of step N is the directory ``step-<N, 9 digits>`` holding one HDF5 file per shard,
``shard-<rank>-of-<nshards>.h5``, and ``manifest.json``. The manifest is the commit marker: it is
written last (temp file, fsync, rename) by rank 0 after every rank has durably written its shard,
so a directory without one is an incomplete checkpoint and never loads. The manifest lists every
shard (size, xxh3-64 of the whole file), every tensor (kind, dtype, shape, device, HDF5 storage
dtype) with its pieces (shard, dataset, element range, xxh3-64 of the piece's bytes), the JSON tree
of the state (see :mod:`.state`), the step, the world size and the library versions. Its own
checksum (``manifest_checksum``, over the canonical JSON of everything else) catches a damaged
manifest.
"""

from __future__ import annotations

import json
import math
import re
import time
from typing import Any
from collections.abc import Iterable, Mapping

from hpcstagger.errors import CheckpointError
from hpcstagger._version import __version__
from hpcstagger._io import checksum

__all__ = [
    "FORMAT", "FORMAT_VERSION", "MANIFEST", "step_dirname", "parse_step_dirname", "shard_filename",
    "dataset_name", "build_manifest", "encode_manifest", "decode_manifest", "validate_manifest", "versions",
]

FORMAT = "hpcstagger-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_STEP_RE = re.compile(r"^step-(\d+)$")


def step_dirname(step: int) -> str:
    """The directory name of step ``step`` (``step-000000042``)."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"a checkpoint step must be an int >= 0, not {step!r}")
    return f"step-{step:09d}"


def parse_step_dirname(name: str) -> int | None:
    """The step of a directory called ``step-N``, or None for any other name."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def shard_filename(rank: int, nshards: int) -> str:
    """The file name of shard ``rank`` of ``nshards``."""
    return f"shard-{rank:05d}-of-{nshards:05d}.h5"


def dataset_name(key: str) -> str:
    """The HDF5 dataset path of tensor ``key`` (the key is already escaped into path parts)."""
    return "/" + key


def versions() -> dict[str, str]:
    """Versions of the libraries that define the format, recorded in every manifest."""
    import platform

    import h5py
    import numpy
    import torch

    return {"hpcstagger": __version__, "torch": torch.__version__, "numpy": numpy.__version__,
            "h5py": h5py.__version__, "hdf5": h5py.version.hdf5_version, "python": platform.python_version()}


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def build_manifest(*, step: int, world_size: int, tree: Any, tensors: Mapping[str, dict],
                   shards: Iterable[dict], versions: Mapping[str, str], created: float | None = None) -> dict:
    """Assemble a manifest and stamp its checksum. ``tensors`` maps key -> entry with ``pieces``."""
    body = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "step": int(step), "world_size": int(world_size),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(created or time.time())),
        "versions": dict(versions), "shards": list(shards), "tensors": dict(tensors), "state": tree,
    }
    body["manifest_checksum"] = checksum(_canonical(body))
    return body


def encode_manifest(manifest: Mapping[str, Any]) -> bytes:
    """The manifest as JSON, one line per field, shard and tensor (readable, and encoded by json's
    fast C encoder, which indenting would forgo). Key order is kept, so state dicts stay in order."""
    def enc(v: Any) -> str:
        return json.dumps(v, allow_nan=False, separators=(", ", ": "))

    lines = []
    for k, v in manifest.items():
        if k in ("tensors", "shards") and v:
            items = v.items() if isinstance(v, dict) else enumerate(v)
            body = ",\n".join(f"  {enc(i) + ': ' if isinstance(v, dict) else ''}{enc(x)}" for i, x in items)
            opener, closer = ("{", "}") if isinstance(v, dict) else ("[", "]")
            lines.append(f"{enc(k)}: {opener}\n{body}\n {closer}")
        else:
            lines.append(f"{enc(k)}: {enc(v)}")
    return ("{\n " + ",\n ".join(lines) + "\n}\n").encode()


def decode_manifest(data: bytes, where: str = "manifest") -> dict:
    """Parse and validate manifest bytes; raises CheckpointError saying what is wrong."""
    try:
        manifest = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{where}: not valid JSON ({exc}); the manifest is damaged") from None
    validate_manifest(manifest, where)
    return manifest


def _fail(where: str, what: str) -> CheckpointError:
    return CheckpointError(f"{where}: {what}; the checkpoint is damaged or was not written by hpcstagger")


def validate_manifest(m: Any, where: str = "manifest") -> None:
    """Check a decoded manifest's structure, checksum and piece coverage; raise CheckpointError."""
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise _fail(where, f"not a {FORMAT} manifest")
    if m.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{where}: format version {m.get('format_version')!r} is not {FORMAT_VERSION}; "
                              "load it with the hpcstagger version that wrote it")
    body = {k: v for k, v in m.items() if k != "manifest_checksum"}
    try:
        ok = checksum(_canonical(body)) == m.get("manifest_checksum")
    except ValueError:
        ok = False
    if not ok:
        raise _fail(where, "manifest checksum mismatch")
    for field, typ in (("step", int), ("world_size", int), ("shards", list), ("tensors", dict)):
        if not isinstance(m.get(field), typ):
            raise _fail(where, f"field {field!r} is missing or not a {typ.__name__}")
    shards = m["shards"]
    if len(shards) != m["world_size"] or [s.get("rank") for s in shards] != list(range(len(shards))):
        raise _fail(where, "shard list does not match the world size")
    for s in shards:
        if not isinstance(s.get("file"), str) or "/" in s["file"] or not isinstance(s.get("size"), int):
            raise _fail(where, f"bad shard entry {s!r}")
    for key, t in m["tensors"].items():
        shape = t.get("shape")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise _fail(where, f"tensor {key!r} has a bad shape")
        numel, covered = math.prod(shape), 0
        for p in sorted(t.get("pieces", []), key=lambda p: p.get("start", -1)):
            if p.get("start") != covered or not isinstance(p.get("count"), int) or p["count"] < 0:
                raise _fail(where, f"pieces of tensor {key!r} do not tile it")
            if not 0 <= p.get("shard", -1) < len(shards):
                raise _fail(where, f"tensor {key!r} names shard {p.get('shard')!r}")
            covered += p["count"]
        if covered != numel or not t.get("pieces"):
            raise _fail(where, f"pieces of tensor {key!r} cover {covered} of {numel} elements")
