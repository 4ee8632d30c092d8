"""Checks a spec must pass before any rank of it starts: the dataset, each job's backend, the launcher.

A run that starts every rank only to fail in each of them costs seconds of MPI start-up, a
traceback per rank and whatever the killed ranks leave in /dev/shm. The checks here run in the
launching process, in well under a second, and create nothing: :func:`problems` returns one
:class:`Problem` per failure (each one line naming the job, the spec field and the fix), and
:func:`check` raises them as one error. ``hpcstagger launch``, ``sweep``, ``calibrate --spec``,
``exec`` and the batch scripts call them before they start anything.

- the dataset (``[dataset]``, read by every job): the path exists and is readable, before its
  format is looked at (a mistyped directory is a path that does not exist, not an HDF5 file
  without a dataset name); an HDF5 file opens, holds ``dataset.name`` as a dataset with a sample
  axis and at least one sample; a directory has a file matching ``dataset.pattern``;
- each job's ``backend`` can be imported by the interpreter the jobs run under (a ``python``
  command word runs this interpreter): ``horovod.torch`` for ``"horovod"``, ``torch.distributed``
  for ``"ddp"``. The modules are found, not imported (importing torch takes seconds): Horovod's
  compiled torch library must be there too;
- the launcher: ``mpiexec`` on PATH (or beside this interpreter), or ``srun`` inside a Slurm
  allocation.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Mapping, Sequence

from hpcstagger.errors import ConfigError, DependencyError, HpcstaggerError, LaunchError
from hpcstagger.spec.jobspec import JobSpec, Spec

__all__ = ["Problem", "problems", "check", "check_dataset", "check_backends", "check_launcher",
           "BACKEND_MODULES"]

# The module each backend needs, and what to do when it is missing.
BACKEND_MODULES = {"horovod": "horovod.torch", "ddp": "torch.distributed"}
_BACKEND_FIX = {"horovod": 'run scripts/install-horovod, or set backend = "ddp"',
                "ddp": 'install torch where the jobs run (scripts/install), or set backend = "none"'}


@dataclass(frozen=True)
class Problem:
    """One failed check: ``field`` (the spec field, e.g. ``dataset.path``), ``message`` (one line
    naming the job, the field and the fix) and ``kind``: ``"config"``, ``"dependency"`` or ``"launch"``."""

    field: str
    message: str
    kind: str = "config"

    def __str__(self) -> str:
        return self.message


def _spec_file(spec: Spec) -> str:
    return os.path.basename(spec.path) if spec.path else "the spec"


def _readers(spec: Spec) -> str:
    names = spec.job_names
    return f"job {names[0]}" if len(names) == 1 else f"jobs {', '.join(names)}"


def check_dataset(spec: Spec) -> list[Problem]:
    """The ``[dataset]``'s problems (none without a path: the jobs bring their own data)."""
    ds = spec.dataset
    if not ds.path:
        return []
    where = f"{_readers(spec)}: "
    fix = f"check [dataset] path in {_spec_file(spec)}"
    path = ds.path
    if not os.path.exists(path):
        return [Problem("dataset.path", f"{where}dataset.path {path} does not exist ({fix})")]
    is_dir = os.path.isdir(path)
    if not os.access(path, os.R_OK | (os.X_OK if is_dir else 0)):
        return [Problem("dataset.path", f"{where}dataset.path {path} is not readable by you ({fix}, or "
                                        f"'chmod u+r{'x' if is_dir else ''} {path}')")]
    if ds.format == "hdf5" and is_dir:
        return [Problem("dataset.format", f'{where}dataset.path {path} is a directory but dataset.format is '
                                          f'"hdf5" (set format = "directory" in {_spec_file(spec)}, or point '
                                          f'path at the HDF5 file)')]
    if ds.format == "directory" and not is_dir:
        return [Problem("dataset.format", f'{where}dataset.path {path} is a file, not a directory, but '
                                          f'dataset.format is "directory" (set format = "hdf5" and dataset.name '
                                          f'in {_spec_file(spec)}, or point path at the directory)')]
    if is_dir:
        return _check_directory(spec, where)
    return _check_hdf5(spec, where)


def _check_directory(spec: Spec, where: str) -> list[Problem]:
    ds = spec.dataset
    try:
        found = next((p for p in Path(ds.path).glob(ds.pattern) if p.is_file()), None)
    except (OSError, ValueError) as exc:
        return [Problem("dataset.pattern", f"{where}dataset.pattern {ds.pattern!r} cannot be used under "
                                           f"{ds.path} ({exc}); fix [dataset] pattern in {_spec_file(spec)}")]
    if found is None:
        return [Problem("dataset.pattern", f"{where}no file under {ds.path} matches dataset.pattern "
                                           f"{ds.pattern!r} (check [dataset] path and pattern in "
                                           f"{_spec_file(spec)})")]
    return []


def _hdf5_datasets(f: object, h5: object, limit: int = 8) -> list[str]:
    """Up to ``limit`` dataset names in an open HDF5 file, for the hint."""
    names: list[str] = []

    def visit(name: str, obj: object) -> object:
        if isinstance(obj, h5.Dataset):  # type: ignore[attr-defined]
            names.append(name)
        return True if len(names) >= limit else None

    f.visititems(visit)  # type: ignore[attr-defined]
    return names


def _check_hdf5(spec: Spec, where: str) -> list[Problem]:
    ds = spec.dataset
    fix = f"in {_spec_file(spec)}"
    try:
        import h5py
    except ImportError as exc:
        return [Problem("dataset.format", f"{where}dataset.path {ds.path} is an HDF5 file but h5py is not "
                                          f"importable ({exc}): pip install h5py", "dependency")]
    if not h5py.is_hdf5(ds.path):
        return [Problem("dataset.path", f"{where}dataset.path {ds.path} is not an HDF5 file, but the spec reads it "
                                        f"as one (format hdf5): point [dataset] path at the HDF5 file, or at a "
                                        f"directory of samples, {fix}")]
    try:
        with h5py.File(ds.path, "r") as f:
            obj = f.get(ds.name)
            if not isinstance(obj, h5py.Dataset):
                have = _hdf5_datasets(f, h5py)
                what = "is a group, not a dataset" if obj is not None else "is not in it"
                listing = f"it has {', '.join(have)}" if have else "it has no datasets"
                return [Problem("dataset.name", f"{where}dataset.name {ds.name!r} {what} ({ds.path}; {listing}): "
                                                f"set [dataset] name {fix}")]
            shape = obj.shape
    except OSError as exc:
        return [Problem("dataset.path", f"{where}dataset.path {ds.path} cannot be opened as HDF5 ({exc}); "
                                        f"check [dataset] path {fix}")]
    if not shape:
        return [Problem("dataset.name", f"{where}dataset {ds.name!r} in {ds.path} has no sample axis (shape "
                                        f"{shape}): its first axis must index the samples; set [dataset] name "
                                        f"{fix}")]
    if shape[0] == 0:
        return [Problem("dataset.name", f"{where}dataset {ds.name!r} in {ds.path} has 0 samples (shape {shape}); "
                                        f"fill it, or set [dataset] name {fix}")]
    return []


def _find_module(module: str) -> str | None:
    """Why ``module`` cannot be imported (None when it is found), without importing it or its
    parents: each part is looked for on the parent package's path."""
    top, *rest = module.split(".")
    try:
        found = importlib.util.find_spec(top)
    except (ImportError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    if found is None:
        return f"No module named {top!r}"
    locations = list(found.submodule_search_locations or [])
    name = top
    for part in rest:
        name = f"{name}.{part}"
        hit = next((os.path.join(d, part) for d in locations
                    if os.path.isfile(os.path.join(d, part, "__init__.py"))
                    or os.path.isfile(os.path.join(d, part + ".py"))), None)
        if hit is None:
            return f"No module named {name!r}"
        locations = [hit] if os.path.isdir(hit) else []
    if module == "horovod.torch" and locations:
        if not any(n.startswith("mpi_lib_v2") for d in locations for n in os.listdir(d)):
            return "horovod.torch has no compiled library (Horovod was built without PyTorch)"
    return None


def _job_prefix(job: JobSpec) -> str:
    return f"job {job.name}: "


def check_backends(spec: Spec, jobs: Sequence[str] | None = None, *,
                   find: Mapping[str, str | None] | None = None) -> list[Problem]:
    """Each job's (``jobs``, default all) backend module that cannot be imported; ``find`` (module ->
    reason or None) replaces the look-up, for tests."""
    out = []
    why: dict[str, str | None] = dict(find or {})
    for i, job in enumerate(spec.jobs):
        module = BACKEND_MODULES.get(job.backend)
        if module is None or (jobs is not None and job.name not in jobs):
            continue
        if module not in why:
            why[module] = _find_module(module)
        if why[module]:
            out.append(Problem(f"job[{i}].backend",
                               f"{_job_prefix(job)}backend {job.backend} is not importable ({why[module]}): "
                               f"{_BACKEND_FIX[job.backend]} (its [[job]] in {_spec_file(spec)})", "dependency"))
    return out


def check_launcher(launcher: str = "mpiexec", mpiexec: str | None = None,
                   environ: Mapping[str, str] | None = None) -> list[Problem]:
    """The launcher's problem: no ``mpiexec`` on PATH (or beside this interpreter), or ``srun``
    outside a Slurm allocation."""
    env = os.environ if environ is None else environ
    if launcher == "mpiexec":
        if mpiexec or shutil.which("mpiexec") or shutil.which("mpiexec", path=os.path.dirname(sys.executable)):
            return []
        return [Problem("launcher", "launcher mpiexec is not on PATH: install an MPI (pip install mpich) or load "
                                    "your site's MPI module", "launch")]
    if launcher == "srun":
        if not shutil.which("srun"):
            return [Problem("launcher", "launcher srun is not on PATH: run inside a Slurm allocation (sbatch or "
                                        "salloc), or use --launcher mpiexec", "launch")]
        if not env.get("SLURM_JOB_ID"):
            return [Problem("launcher", "launcher srun runs inside a Slurm allocation (sbatch or salloc), and "
                                        "SLURM_JOB_ID is unset: submit the script with sbatch, or use --launcher "
                                        "mpiexec", "launch")]
        return []
    return [Problem("launcher", f"launcher must be 'mpiexec' or 'srun', not {launcher!r}")]


def problems(spec: Spec, *, launcher: str | None = "mpiexec", mpiexec: str | None = None,
             jobs: Sequence[str] | None = None) -> list[Problem]:
    """Everything that would make ``spec``'s ranks fail at start: the dataset, the backends of
    ``jobs`` (default all), and ``launcher`` (None: not checked, e.g. already inside one)."""
    out = check_dataset(spec) + check_backends(spec, jobs)
    if launcher is not None:
        out += check_launcher(launcher, mpiexec)
    return out


def check(spec: Spec, *, launcher: str | None = "mpiexec", mpiexec: str | None = None,
          jobs: Sequence[str] | None = None) -> None:
    """Raise when :func:`problems` finds any: ConfigError if one is the spec's, else DependencyError
    for a missing module, else LaunchError; the message is every problem on one line."""
    found = problems(spec, launcher=launcher, mpiexec=mpiexec, jobs=jobs)
    if not found:
        return
    kinds = {p.kind for p in found}
    cls: type[HpcstaggerError] = (ConfigError if "config" in kinds else
                                  DependencyError if "dependency" in kinds else LaunchError)
    raise cls("; ".join(p.message for p in found))
