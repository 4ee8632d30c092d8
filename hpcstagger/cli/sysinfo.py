"""What this node offers hpcstagger: library versions, launchers, Slurm context, /dev/shm, CPUs, GPUs.

:func:`collect` returns one JSON-able dict; ``hpcstagger info`` prints it. Every probe is best
effort: a missing or broken package is reported in its entry (``"error"``), never raised.
"""

from __future__ import annotations

import importlib
import os
import platform
import shutil
import socket
import subprocess
import sys
from typing import Any

from hpcstagger import config, slurm
from hpcstagger._version import __version__
from hpcstagger.comm import launched_by_mpi

__all__ = ["collect", "shm_usage"]

_LAUNCHERS = ("mpiexec", "mpirun", "srun", "sbatch", "scontrol")


def _module_version(name: str) -> dict[str, Any]:
    try:
        mod = importlib.import_module(name)
    except Exception as exc:  # reported, not raised
        return {"installed": False, "error": f"{type(exc).__name__}: {exc}"}
    return {"installed": True, "version": getattr(mod, "__version__", None)}


def _torch_info() -> dict[str, Any]:
    info = _module_version("torch")
    if info["installed"]:
        import torch

        info["cuda"] = torch.version.cuda
        info["cuda_available"] = bool(torch.cuda.is_available())
    return info


def _h5py_info() -> dict[str, Any]:
    info = _module_version("h5py")
    if info["installed"]:
        import h5py

        info["hdf5"] = h5py.version.hdf5_version
    return info


def _mpi_info() -> dict[str, Any]:
    """mpi4py's version and the MPI library's version string.

    Outside an MPI launch MPI is not initialised: MPI_Get_library_version may be called before
    MPI_Init, so ``hpcstagger info`` stays safe to run anywhere (a login node, an sbatch script).
    """
    info = _module_version("mpi4py")
    if not info["installed"]:
        return info
    try:
        if "mpi4py.MPI" not in sys.modules and not launched_by_mpi():
            import mpi4py

            mpi4py.rc.initialize = False
            mpi4py.rc.finalize = False
        from mpi4py import MPI

        info["library"] = " ".join(MPI.Get_library_version().strip().splitlines()[0].split())
        info["library_version_string"] = MPI.Get_library_version().strip()
        major, minor = MPI.Get_version()
        info["standard"] = f"{major}.{minor}"
        info["initialized"] = bool(MPI.Is_initialized())
        if MPI.Is_initialized():
            info["world_size"] = MPI.COMM_WORLD.Get_size()
            info["world_rank"] = MPI.COMM_WORLD.Get_rank()
            info["thread_level"] = {
                MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
                MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple",
            }.get(MPI.Query_thread(), "unknown")
    except Exception as exc:
        info["error"] = f"{type(exc).__name__}: {exc}"
    return info


def _horovod_info() -> dict[str, Any]:
    info = _module_version("horovod")
    if not info["installed"]:
        return info
    try:
        import horovod.torch as hvd

        info["torch"] = True
        info["mpi_built"] = bool(hvd.mpi_built())
        info["gloo_built"] = bool(hvd.gloo_built())
        info["nccl_built"] = bool(hvd.nccl_built())
    except Exception as exc:
        info["torch"] = False
        info["error"] = f"horovod.torch: {type(exc).__name__}: {exc}"
    return info


def _version_line(path: str) -> str | None:
    """The version line that ``path --version`` prints (Hydra's ``Version:`` line, else the first)."""
    try:
        proc = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [ln.strip() for ln in (proc.stdout + proc.stderr).splitlines()
             if ln.strip() and "error:" not in ln and "fatal:" not in ln]  # Slurm without a slurm.conf
    for line in lines:
        if line.startswith("Version:"):  # MPICH's Hydra prints a header before its version
            return "Hydra " + line.split(":", 1)[1].strip()
    return lines[0] if lines else None


def _launchers() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in _LAUNCHERS:
        path = shutil.which(name)
        entry: dict[str, Any] = {"path": path}
        if path and name in ("mpiexec", "srun", "sbatch"):
            entry["version"] = _version_line(path)
        out[name] = entry
    return out


def shm_usage(path: str = "/dev/shm") -> dict[str, Any]:
    """Size, free and available bytes of the file system holding ``path``."""
    try:
        st = os.statvfs(path)
    except OSError as exc:
        return {"path": path, "error": f"{type(exc).__name__}: {exc}"}
    return {"path": path, "size_bytes": st.f_blocks * st.f_frsize,
            "free_bytes": st.f_bfree * st.f_frsize, "available_bytes": st.f_bavail * st.f_frsize}


def _gpus() -> dict[str, Any]:
    devices: list[dict[str, Any]] = []
    source = None
    try:
        import torch

        if torch.cuda.is_available():
            source = "torch"
            for i in range(torch.cuda.device_count()):
                p = torch.cuda.get_device_properties(i)
                devices.append({"index": i, "name": p.name, "memory_bytes": int(p.total_memory)})
    except Exception:
        pass
    if not devices and shutil.which("nvidia-smi"):
        line = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
        names = [ln.strip() for ln in line.stdout.splitlines() if ln.startswith("GPU ")]
        if names:
            source = "nvidia-smi"
            devices = [{"index": i, "name": n} for i, n in enumerate(names)]
    return {"count": len(devices), "devices": devices, "source": source,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def collect() -> dict[str, Any]:
    """Everything ``hpcstagger info`` reports, as one JSON-able dict."""
    usable: int | None
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    mpi = _mpi_info()
    return {
        "hpcstagger": __version__,
        "versions": {
            "python": {"version": platform.python_version(), "implementation": platform.python_implementation(),
                       "executable": sys.executable},
            "hpcstagger": {"installed": True, "version": __version__},
            "torch": _torch_info(),
            "numpy": _module_version("numpy"),
            "h5py": _h5py_info(),
            "mpi4py": mpi,
            "horovod": _horovod_info(),
        },
        "launchers": _launchers(),
        "slurm_job": slurm.job_context(),
        "mpi_launch": {"launched": launched_by_mpi(),
                       "rank": os.environ.get("PMI_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK"),
                       "size": os.environ.get("PMI_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE")},
        "system": {
            "hostname": socket.gethostname(),
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "cpus_usable": usable,
            "memory_bytes": _memory_bytes(),
        },
        "shm": shm_usage("/dev/shm"),
        "gpus": _gpus(),
        "knobs": config.describe(),
    }
