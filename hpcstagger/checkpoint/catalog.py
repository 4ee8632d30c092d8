"""Finding checkpoints in directories, committing them, and retention. Files only, no tensors."""

from __future__ import annotations

import logging
import os
import secrets
import shutil
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Iterable, Sequence

from .._io import atomic_write, fsync_dir
from ..errors import CheckpointError
from .manifest import MANIFEST, decode_manifest, encode_manifest, parse_step_dirname, step_dirname

__all__ = ["Entry", "scan", "candidates", "commit", "prune", "clear_step", "as_dirs"]

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
            self.manifest = decode_manifest(data, where)
            if self.manifest["step"] != self.step:
                raise CheckpointError(f"{where} says step {self.manifest['step']}, its directory step {self.step}; "
                                      "the checkpoint directory was renamed or damaged")
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
