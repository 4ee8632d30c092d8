"""What a calibration of a spec has measured so far, kept beside its output as it is measured.

``hpcstagger calibrate --spec SPEC -o OUT`` writes each part the moment it is taken, atomically
and durably, into ``OUT.partial/``: ``job.<name>.json`` per job measured from its command, and
``source.json`` with every measurement of the source's levels. Each part carries the key of what
it measured:

- a job's key: its ``[[job]]`` entry (command, ranks, backend, env, loader), the spec's
  ``[dataset]``, ``[cache]`` and ``[loader]``, and the size and time of every file its command
  names (its training script);
- the source's key: the spec's ``[dataset]`` and the size and time of its file or directory.

A calibration that failed or was interrupted (Ctrl-C) goes on where it stopped when the same
command runs again: a part whose key still matches is reused (and said so on stderr), one whose
key changed is measured again; ``--fresh`` drops every part first. The directory is removed once
the scenario is written.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable

from hpcstagger import _io
from hpcstagger.spec.jobspec import JobSpec, Spec

__all__ = ["SavedParts", "dataset_key", "job_key", "partial_dir"]

log = logging.getLogger(__name__)


def partial_dir(out: str | os.PathLike[str]) -> Path:
    """Where the measurements of a calibration writing ``out`` are kept until it is written."""
    path = Path(os.path.abspath(out))
    return path.with_name(path.name + ".partial")


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _stat(path: str) -> list[int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns]


def dataset_key(spec: Spec) -> str:
    """The key of the spec's source: its ``[dataset]`` and its file's (or directory's) size and time."""
    return _digest({"dataset": dataclasses.asdict(spec.dataset), "file": _stat(spec.dataset.path)})


def job_key(spec: Spec, job: JobSpec) -> str:
    """The key of one job's measurement (see the module docstring)."""
    base = os.path.dirname(spec.path) or "."
    files = {}
    for token in job.command:
        path = os.path.join(base, token)
        if os.path.isfile(path):
            files[token] = _stat(path)
    return _digest({"job": dataclasses.asdict(job), "dataset": dataset_key(spec),
                    "cache": dataclasses.asdict(spec.cache), "loader": dataclasses.asdict(spec.loader),
                    "files": files})


class SavedParts:
    """A calibration's parts in ``directory`` (None: nothing is kept); ``say`` reports reuse."""

    def __init__(self, directory: Path | None, spec: Spec, *, fresh: bool, say: Callable[[str], None]):
        self.directory, self.spec, self.say = directory, spec, say
        self.source_key = dataset_key(spec)
        self.reused: list[str] = []
        if directory is None:
            return
        if fresh and directory.exists():
            shutil.rmtree(directory)
            say(f"calibrate: --fresh: dropped the measurements kept in {directory}")
        directory.mkdir(exist_ok=True)

    def _read(self, name: str) -> Any:
        if self.directory is None:
            return None
        try:
            return _io.read_json(self.directory / name)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:  # a torn or foreign file: measured again
            log.warning("ignoring the kept calibration part %s: %s", self.directory / name, exc)
            return None

    def _write(self, name: str, obj: dict[str, Any]) -> None:
        if self.directory is not None:
            _io.atomic_write_json(self.directory / name, _io.json_safe({**obj, "time": time.time()}))

    def job(self, job: JobSpec) -> dict[str, Any] | None:
        """The kept measurement of ``job``, when its key still matches (said on stderr), else None."""
        part = self._read(f"job.{job.name}.json")
        if part is None:
            return None
        if part.get("key") != job_key(self.spec, job):
            self.say(f"calibrate: job {job.name}: its command, its files or the dataset changed since its kept "
                     "measurement: measuring it again")
            return None
        self.say(f"calibrate: job {job.name}: reusing its measurement kept in {self.directory} "
                 f"({time.strftime('%H:%M:%S', time.localtime(part.get('time', 0)))}); --fresh measures it again")
        self.reused.append(f"job {job.name}")
        return dict(part["fields"])

    def save_job(self, job: JobSpec, fields: dict[str, Any]) -> None:
        """Keep ``job``'s measurement (atomically, durably)."""
        self._write(f"job.{job.name}.json", {"key": job_key(self.spec, job), "fields": fields})

    def levels(self) -> list[dict[str, Any]]:
        """The kept measurements of the source's levels, when the dataset is the same (said on stderr)."""
        part = self._read("source.json")
        if part is None:
            return []
        if part.get("key") != self.source_key:
            self.say("calibrate: the dataset changed since the source was measured: measuring it again")
            return []
        levels = [dict(m) for m in part.get("levels", [])]
        if levels:
            self.say(f"calibrate: reusing {len(levels)} measurement(s) of the source kept in {self.directory}")
            self.reused.append(f"{len(levels)} source measurement(s)")
        return levels

    def save_levels(self, levels: list[dict[str, Any]]) -> None:
        """Keep every measurement of the source so far (atomically, durably)."""
        self._write("source.json", {"key": self.source_key, "levels": levels})

    def done(self) -> None:
        """The scenario is written: the kept parts are no longer needed."""
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
