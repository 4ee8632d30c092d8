"""Finding checkpoints in directories, committing them, and retention. Files only, no tensors."""

from __future__ import annotations

import logging
import os
import secrets
import shutil
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Iterable, Sequence

from hpcstagger._io import atomic_write, fsync_dir
from hpcstagger.errors import CheckpointError
from hpcstagger.checkpoint.manifest import MANIFEST, decode_manifest, encode_manifest, parse_step_dirname, step_dirname

__all__ = ["Entry", "scan", "candidates", "shard_problem", "file_problems", "commit", "prune", "clear_step", "as_dirs"]

log = logging.getLogger(__name__)


@dataclass
class Entry:
    """One ``step-N`` directory: committed when its manifest exists (it may still be damaged)."""

    step: int
    path: str
    level: int              # index of its directory in the list of levels (0: the fastest)
    committed: bool
    manifest: dict[str, Any] | None = field(default=None, repr=False)
    error: str | None = None

    def read_manifest(self) -> dict[str, Any]:
        """Read and validate the manifest (cached); raises CheckpointError."""
        if self.manifest is None:
            where = os.path.join(self.path, MANIFEST)
            try:
                with open(where, "rb") as f:
                    data = f.read()
            except FileNotFoundError:
                raise CheckpointError(f"{where} is missing: the checkpoint of step {self.step} is incomplete "
                                      "(a save was interrupted or is in progress)") from None
            except OSError as exc:
                raise CheckpointError(f"{where} cannot be read ({exc.strerror or exc}); "
                                      "check its permissions") from None
            manifest = decode_manifest(data, where)
            if manifest["step"] != self.step:
                raise CheckpointError(f"{where} says step {manifest['step']}, its directory step {self.step}; "
                                      "the checkpoint directory was renamed or damaged")
            self.manifest = manifest  # cached only once it is valid, so a second read fails alike
        return self.manifest


def as_dirs(directory: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[str]:
    """One directory or a sequence of them (fastest level first) as a list of paths."""
    if isinstance(directory, (str, os.PathLike)):
        return [os.fspath(directory)]
    return [os.fspath(d) for d in directory]


def scan(directories: Iterable[str]) -> list[Entry]:
    """Every ``step-N`` directory in ``directories``, newest step first (faster level first on ties)."""
    out = []
    for level, root in enumerate(directories):
        try:
            names = os.listdir(root)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise CheckpointError(f"cannot list the checkpoints in {root} ({exc.strerror or exc}); "
                                  "check that it is a directory you may read") from None
        for name in names:
            step = parse_step_dirname(name)
            path = os.path.join(root, name)
            if step is None or not os.path.isdir(path):
                continue
            out.append(Entry(step, path, level, os.path.exists(os.path.join(path, MANIFEST))))
    out.sort(key=lambda e: (-e.step, e.level))
    return out


def candidates(directories: Iterable[str], step: int | None = None) -> list[Entry]:
    """Committed checkpoints to try loading, best first; only ``step`` when given."""
    return [e for e in scan(directories) if e.committed and (step is None or e.step == step)]


def shard_problem(step_dir: str, shard: dict[str, Any]) -> str | None:
    """What is wrong with one shard file of a manifest by its size alone (missing, truncated,
    replaced), or None when it has the manifest's size. Reads no data."""
    path = os.path.join(step_dir, shard["file"])
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        return f"shard {path} is missing"
    except OSError as exc:
        return f"shard {path} cannot be read ({exc.strerror or exc})"
    if size != shard["size"]:
        return f"shard {path} is {size} bytes, the manifest says {shard['size']}: truncated or replaced"
    return None


def file_problems(entry: Entry) -> list[str]:
    """The problems of a committed checkpoint found without reading shard data: its manifest fails
    to read or validate, or shard files are missing or of another size than the manifest says.
    Empty when the files look whole (their bytes may still be damaged: :func:`.load.verify_checkpoint`
    checksums them)."""
    try:
        manifest = entry.read_manifest()
    except CheckpointError as exc:
        return [str(exc)]
    return [p for s in manifest["shards"] if (p := shard_problem(entry.path, s)) is not None]


def commit(step_dir: str, manifest: dict[str, Any]) -> None:
    """Write the manifest (temp file, fsync, rename, fsync directory and its parent): the commit."""
    atomic_write(os.path.join(step_dir, MANIFEST), encode_manifest(manifest))
    fsync_dir(os.path.dirname(step_dir) or ".")


def _trash(root: str, path: str) -> str:
    """Rename a step directory out of sight (an atomic uncommit); returns the new name."""
    trash = os.path.join(root, f".trash-{os.path.basename(path)}-{secrets.token_hex(4)}")
    os.rename(path, trash)
    return trash


def _empty_trash(root: str, extra: Iterable[str] = ()) -> None:
    names = [os.path.join(root, n) for n in os.listdir(root) if n.startswith(".trash-")]
    for path in {*names, *extra}:
        shutil.rmtree(path, ignore_errors=True)


def clear_step(root: str, step: int) -> None:
    """Remove whatever an earlier run left under step ``step`` in ``root`` before saving it anew."""
    path = os.path.join(root, step_dirname(step))
    if os.path.isdir(path):
        log.info("removing the earlier checkpoint directory %s before saving step %d again", path, step)
        trash = _trash(root, path)
        fsync_dir(root)
        _empty_trash(root, [trash])


def prune(root: str, keep: int, *, protect: int | None = None) -> list[str]:
    """Keep the ``keep`` newest committed checkpoints in ``root`` (and step ``protect``); delete the
    older ones and incomplete directories older than the newest commit. Returns the removed paths.

    Each directory is first renamed out of sight (one durable rename in ``root``), then deleted,
    so a crash midway never leaves a committed checkpoint with files missing.
    """
    entries = scan([root])
    committed = [e for e in entries if e.committed]
    kept = {e.step for e in committed[:keep]}
    if protect is not None:
        kept.add(protect)
    newest = committed[0].step if committed else None
    removed = []
    for e in entries:
        if e.step in kept:
            continue
        if e.committed or (newest is not None and e.step < newest):
            _trash(root, e.path)
            removed.append(e.path)
    if removed:
        fsync_dir(root)
    _empty_trash(root)
    return removed
