"""Loading, verifying and restoring checkpoints. Nothing is unpickled: JSON and raw tensor bytes only.

:func:`load` picks the newest committed checkpoint (or the given step) across one or more levels,
skips incomplete ones, and damaged ones with a :class:`~hpcstagger.errors.CheckpointWarning`
(or raises, with ``strict=True``), checks every piece's checksum while reading
it, and rebuilds the state. Every rank reads every shard it needs, so the number of ranks need not
match the save. :func:`verify_checkpoint` checks one checkpoint thoroughly (whole-file checksums as
well), for ``hpcstagger ckpt verify``.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any
from collections.abc import Callable, Sequence

from hpcstagger._io import checksum
from hpcstagger.comm import as_comm
from hpcstagger.errors import CheckpointError, CheckpointWarning, describe_exception
from hpcstagger.checkpoint.catalog import Entry, as_dirs, candidates, scan, shard_problem
from hpcstagger.checkpoint.manifest import FORMAT, parse_step_dirname
from hpcstagger.checkpoint.state import unflatten, torch_dtype

__all__ = ["load", "load_entry", "restore", "read_checkpoint", "verify_checkpoint", "list_entries"]

log = logging.getLogger(__name__)
_CHUNK = 8 << 20


def _readinto_all(fd: int, view: memoryview, offset: int, path: str) -> None:
    while len(view):
        n = os.preadv(fd, [view], offset)
        if n <= 0:
            raise CheckpointError(f"{path} ends early at byte {offset}; the shard is truncated")
        view, offset = view[n:], offset + n


def _check_shard(step_dir: str, manifest: dict[str, Any], rank: int, pieces: list[tuple[str, dict[str, Any]]],
                 dest: Callable[[str, dict[str, Any]], Any], *, whole_file: bool = False,
                 progress: Callable[[int], None] | None = None) -> None:
    """Read and check the pieces of shard ``rank``; ``dest(key, piece)`` gives a uint8 array for the bytes."""
    import h5py
    import numpy as np
    import xxhash

    shard = manifest["shards"][rank]
    path = os.path.join(step_dir, shard["file"])
    if (problem := shard_problem(step_dir, shard)) is not None:
        raise CheckpointError(problem)
    if whole_file:
        h = xxhash.xxh3_64()
        with open(path, "rb", buffering=0) as f:
            buf = bytearray(_CHUNK)
            while n := f.readinto(buf):
                h.update(memoryview(buf)[:n])
                if progress:
                    progress(n)
        if h.hexdigest() != shard["checksum"]:
            raise CheckpointError(f"shard {path}: whole-file checksum mismatch (xxh3 {h.hexdigest()}, the manifest "
                                  f"says {shard['checksum']}): the file is damaged")
    plan = []
    try:
        with h5py.File(path, "r", locking=False) as f:
            a = f.attrs
            if a.get("format") != FORMAT or int(a.get("rank", -1)) != rank or \
                    int(a.get("step", -1)) != manifest["step"] or int(a.get("nshards", -1)) != len(manifest["shards"]):
                raise CheckpointError(f"shard {path} does not belong to this checkpoint (its attributes say step "
                                      f"{a.get('step')}, rank {a.get('rank')} of {a.get('nshards')})")
            for key, p in pieces:
                ds = f.get(p["dataset"])
                if not isinstance(ds, h5py.Dataset):
                    raise CheckpointError(f"shard {path} lacks dataset {p['dataset']}")
                t = manifest["tensors"][key]
                if (ds.attrs.get("checksum") != p["checksum"] or int(ds.attrs.get("start", 0)) != p["start"]
                        or ds.size != p["count"] or ds.dtype != np.dtype(t["storage"])):
                    raise CheckpointError(f"shard {path}: dataset {p['dataset']} does not match the manifest "
                                          "(checksum, range or dtype differ)")
                off = ds.id.get_offset() if p["count"] else None
                if off is None and p["count"]:  # not stored contiguously (e.g. repacked): let HDF5 read it
                    out = dest(key, p)
                    ds.read_direct(out.view(np.dtype(t["storage"])).reshape(ds.shape))
                    if checksum(out) != p["checksum"]:
                        raise CheckpointError(f"shard {path}: dataset {p['dataset']} fails its checksum: "
                                              "the data is damaged")
                else:
                    plan.append((off, key, p))
        with open(path, "rb", buffering=0) as fobj:
            fd = fobj.fileno()
            for off, key, p in plan:
                view = memoryview(dest(key, p))
                h = xxhash.xxh3_64()
                for a0 in range(0, len(view), _CHUNK):
                    part = view[a0:a0 + _CHUNK]
                    if off is not None:
                        _readinto_all(fd, part, off + a0, path)
                    h.update(part)
                    if progress and not whole_file:
                        progress(len(part))
                if h.hexdigest() != p["checksum"]:
                    raise CheckpointError(f"shard {path}: dataset {p['dataset']} fails its checksum (xxh3 "
                                          f"{h.hexdigest()}, the manifest says {p['checksum']}): the data is damaged")
    except CheckpointError:
        raise
    except (OSError, KeyError, ValueError, TypeError) as exc:
        raise CheckpointError(f"shard {path} cannot be read: {type(exc).__name__}: {exc}") from exc


def _pieces_by_shard(manifest: dict[str, Any]) -> dict[int, list[tuple[str, dict[str, Any]]]]:
    by: dict[int, list[tuple[str, dict[str, Any]]]] = {r: [] for r in range(len(manifest["shards"]))}
    for key, t in manifest["tensors"].items():
        for p in t["pieces"]:
            by[p["shard"]].append((key, p))
    return by


def _device_available(name: str) -> bool:
    import torch

    dev = torch.device(name)
    if dev.type == "cpu":
        return True
    if dev.type == "cuda":
        return torch.cuda.is_available() and (dev.index or 0) < torch.cuda.device_count()
    mod = getattr(torch, dev.type, None)
    return bool(mod is not None and getattr(mod, "is_available", lambda: False)())


def _placer(map_location: Any) -> Callable[[Any, str], Any]:
    warned: set[str] = set()

    def place(t: Any, saved: str) -> Any:
        if callable(map_location):
            return map_location(t, saved)
        if map_location is None:
            target = saved
        elif isinstance(map_location, dict):
            target = str(map_location.get(saved, saved))
        else:
            target = str(map_location)
        if target == "cpu":
            return t
        if not _device_available(target):
            if map_location is not None:
                raise CheckpointError(f"map_location asks for device {target!r}, which this process does not have")
            if target not in warned:
                warned.add(target)
                log.warning("tensors saved on %s are loaded on the CPU: this process has no %s "
                            "(pass map_location to choose)", target, target)
            return t
        return t.to(target)

    return place


def read_checkpoint(path: str, *, map_location: Any = None, entry: Entry | None = None) -> dict[str, Any]:
    """Load the checkpoint in step directory ``path`` (all shards, checksums checked); raises CheckpointError."""
    import numpy as np
    import torch

    if entry is None:
        step = parse_step_dirname(os.path.basename(os.path.normpath(path)))
        if step is None:
            raise CheckpointError(f"{path} is not a checkpoint directory (named step-N)")
        entry = Entry(step, path, 0, True)
    manifest = entry.read_manifest()
    for shard in manifest["shards"]:  # a missing or cut shard fails before any data is read
        if (problem := shard_problem(entry.path, shard)) is not None:
            raise CheckpointError(problem)
    arrays: dict[str, Any] = {}
    flat: dict[str, Any] = {}
    for key, t in manifest["tensors"].items():
        if t["kind"] == "torch":
            ten = torch.empty(t["shape"], dtype=torch_dtype(t["dtype"]))
            arrays[key] = ten
            flat[key] = ten.reshape(-1).view(torch.uint8).numpy()
        else:
            arr = np.empty(t["shape"], dtype=np.dtype(t["storage"]).newbyteorder("="))
            arrays[key] = arr
            flat[key] = arr.reshape(-1).view(np.uint8)

    def dest(key: str, p: dict[str, Any]) -> Any:
        isz = np.dtype(manifest["tensors"][key]["storage"]).itemsize
        return flat[key][p["start"] * isz:(p["start"] + p["count"]) * isz]

    for rank, pieces in _pieces_by_shard(manifest).items():
        if pieces:
            _check_shard(entry.path, manifest, rank, pieces, dest)
    place = _placer(map_location)

    def tensor(key: str, tag: str) -> Any:
        t = manifest["tensors"][key]
        if t["kind"] == "numpy":
            arr = arrays[key]
            return arr if arr.dtype == np.dtype(t["dtype"]) else arr.astype(np.dtype(t["dtype"]))
        return place(arrays[key], t["device"])

    return unflatten(manifest["state"], tensor)


def load(directory: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], step: int | None = None, *,
         comm: Any = None, map_location: Any = None, strict: bool = False) -> dict[str, Any]:
    """Load the newest committed checkpoint (or step ``step``) from ``directory``.

    ``directory`` may be a list of levels (fastest first): the newest complete checkpoint on any
    level wins. Incomplete checkpoints (no manifest) are passed over. A damaged one is skipped
    for the next older step with one :class:`~hpcstagger.errors.CheckpointWarning` per damaged
    checkpoint, naming its step and file; with ``strict=True`` it is a CheckpointError instead
    (a copy of the same step on another level may still stand in). With ``comm``, collective:
    every rank loads the same checkpoint, one rank's failure to read it makes every rank move on
    (or raise), and every rank warns alike. ``map_location``: None (each tensor to the device it
    was saved from, or the CPU when that device is absent), a device, a dict mapping saved device
    names to devices, or a function ``(cpu_tensor, saved_device) -> tensor``. Raises
    CheckpointError when nothing loadable is found.
    """
    return _load(directory, step, comm, map_location, strict)[1]


def load_entry(directory: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], step: int | None = None, *,
               comm: Any = None, map_location: Any = None, strict: bool = False) -> tuple[Entry, dict[str, Any]]:
    """Like :func:`load`, and also return the :class:`~.catalog.Entry` it loaded (its step and path)."""
    return _load(directory, step, comm, map_location, strict)


def _one_line(text: str) -> str:
    return " ".join(text.split("\n")).strip()


def _try_read(entry: Entry, map_location: Any) -> tuple[dict[str, Any] | None, str | None]:
    try:
        return read_checkpoint(entry.path, map_location=map_location, entry=entry), None
    except CheckpointError as exc:
        return None, _one_line(str(exc))
    except Exception as exc:  # a damaged file can raise anything; skip it
        return None, _one_line(describe_exception(exc))


def _load(directory: Any, step: int | None, comm: Any, map_location: Any,
          strict: bool) -> tuple[Entry, dict[str, Any]]:
    dirs = as_dirs(directory)
    c = as_comm(comm)
    found: list[Entry] | str | None = None
    if c.rank == 0:
        try:
            found = candidates(dirs, step)
        except CheckpointError as exc:  # unreadable directory: every rank raises it, none waits
            found = str(exc)
    found = c.bcast(found) if c.size > 1 else found
    if isinstance(found, str) or found is None:
        raise CheckpointError(found or "no candidates")
    damaged: list[tuple[Entry, str]] = []
    for i, entry in enumerate(found):
        state, err = _try_read(entry, map_location)
        errs = c.allgather(err) if c.size > 1 else [err]
        bad = {r: e for r, e in enumerate(errs) if e is not None}
        if not bad:
            assert state is not None, "no rank failed, this one included, so it read the checkpoint"
            log.info("loaded the checkpoint of step %d from %s", entry.step, entry.path)
            for skipped, text in damaged:
                instead = "a copy on another level" if skipped.step == entry.step else f"step {entry.step}"
                warnings.warn(CheckpointWarning(
                    f"skipped the damaged checkpoint of step {skipped.step} in {skipped.path} and loaded {instead} "
                    f"({entry.path}): {text}; 'hpcstagger ckpt verify {skipped.path}' lists its problems, and "
                    "load(..., strict=True) makes this an error"), stacklevel=3)
            return entry, state
        text = "; ".join(f"rank {r}: {e}" if c.size > 1 else e for r, e in sorted(bad.items()))
        log.debug("the checkpoint of step %d in %s cannot be loaded: %s", entry.step, entry.path, text)
        damaged.append((entry, text))
        if (strict or step is not None) and not any(e.step == entry.step for e in found[i + 1:]):
            raise CheckpointError(
                f"the checkpoint of step {entry.step} in {entry.path} is damaged: {text}; load an older step "
                f"explicitly with step=N ('hpcstagger ckpt ls {os.path.dirname(entry.path)}' lists them), or "
                f"check its files with 'hpcstagger ckpt verify {entry.path}'")
    where = ", ".join(dirs)
    if damaged:
        listed = "; ".join(f"step {e.step} ({e.path}): {t}" for e, t in damaged)
        raise CheckpointError(f"no loadable checkpoint in {where}, every committed one is damaged: {listed}; "
                              f"'hpcstagger ckpt verify {dirs[0]}' lists every problem")
    what = f"checkpoint of step {step}" if step is not None else "checkpoint"
    raise CheckpointError(f"no committed {what} in {where}; check the path (hpcstagger ckpt ls DIR lists them)")


def restore(state: dict[str, Any], **targets: Any) -> dict[str, Any]:
    """Put ``state[name]`` back into each ``name=object`` via ``object.load_state_dict``.

    ``restore(state, model=model, optimizer=opt)`` loads ``state["model"]`` into ``model`` and
    ``state["optimizer"]`` into ``opt``. Returns the entries of ``state`` not restored. Raises
    CheckpointError when a name is not in the state or an object has no ``load_state_dict``.
    """
    rest = dict(state)
    for name, obj in targets.items():
        if name not in state:
            raise CheckpointError(f"the checkpoint has no entry {name!r} to restore; it has: {sorted(state)}")
        if not callable(getattr(obj, "load_state_dict", None)):
            raise CheckpointError(f"cannot restore {name!r}: a {type(obj).__name__} has no load_state_dict()")
        obj.load_state_dict(state[name])
        rest.pop(name)
    return rest


def verify_checkpoint(path: str, *, progress: Callable[[int], None] | None = None) -> list[str]:
    """Every problem of the checkpoint in step directory ``path`` (empty: it is sound).

    Checks the manifest, that every shard exists with its size and whole-file checksum, that its
    datasets match the manifest, and every piece's checksum.
    """
    import numpy as np

    step = parse_step_dirname(os.path.basename(os.path.normpath(path)))
    if step is None:
        return [f"{path} is not a checkpoint directory (named step-N)"]
    entry = Entry(step, path, 0, os.path.exists(os.path.join(path, "manifest.json")))
    try:
        manifest = entry.read_manifest()
    except CheckpointError as exc:
        return [str(exc)]
    problems = []
    scratch = np.empty(0, np.uint8)

    def dest(key: str, p: dict[str, Any]) -> Any:
        nonlocal scratch
        t = manifest["tensors"][key]
        n = p["count"] * np.dtype(t["storage"]).itemsize
        if scratch.size < n:
            scratch = np.empty(n, np.uint8)
        return scratch[:n]

    for rank, pieces in _pieces_by_shard(manifest).items():
        try:
            _check_shard(path, manifest, rank, pieces, dest, whole_file=True, progress=progress)
        except CheckpointError as exc:
            problems.append(_one_line(str(exc)))
        except Exception as exc:  # a damaged file can raise anything; report it as a problem
            problems.append(_one_line(f"shard {rank} of {path}: {describe_exception(exc)}"))
    return problems


def list_entries(directory: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[Entry]:
    """Every step directory in ``directory`` (one or more levels), newest first."""
    return scan(as_dirs(directory))
