"""``hpcstagger info``: versions, launchers, Slurm context, /dev/shm, CPUs and GPUs of this node."""

from __future__ import annotations

import argparse
import json
from typing import Any

from hpcstagger.measure.tables import human_bytes


def register(sub: Any) -> None:
    p = sub.add_parser("info", help="report versions, launchers, Slurm job, /dev/shm, CPUs and GPUs",
                       description="Report what this node offers hpcstagger: library versions (with "
                                   "the MPI library and Horovod build), launchers on PATH, the Slurm "
                                   "job this runs in, /dev/shm capacity, CPUs and GPUs.")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    p.set_defaults(func=run)


def _version(entry: dict[str, Any]) -> str:
    if not entry.get("installed"):
        return "not installed" + (f" ({entry['error']})" if "No module named" not in entry.get("error", "") else "")
    text = str(entry.get("version") or "?")
    if entry.get("error"):
        text += f" (error: {entry['error']})"
    return text


def format_text(info: dict[str, Any]) -> str:
    """The human-readable report of :func:`hpcstagger.cli.sysinfo.collect`'s dict."""
    rows: list[tuple[str, str]] = []
    v = info["versions"]
    rows.append(("python", f"{v['python']['version']} ({v['python']['executable']})"))
    rows.append(("hpcstagger", info["hpcstagger"]))
    torch = v["torch"]
    rows.append(("torch", _version(torch) + (f", CUDA {torch['cuda']}" if torch.get("cuda") else ", CPU build"
                                             if torch.get("installed") else "")))
    rows.append(("numpy", _version(v["numpy"])))
    rows.append(("h5py", _version(v["h5py"]) + (f", HDF5 {v['h5py']['hdf5']}" if v["h5py"].get("hdf5") else "")))
    mpi = v["mpi4py"]
    rows.append(("mpi4py", _version(mpi)))
    if mpi.get("library"):
        rows.append(("MPI library", f"{mpi['library']} (MPI {mpi.get('standard', '?')})"))
    hvd = v["horovod"]
    if hvd.get("installed") and hvd.get("torch"):
        built = [k for k in ("mpi", "gloo", "nccl") if hvd.get(f"{k}_built")]
        rows.append(("horovod", f"{hvd.get('version')} (built with: {', '.join(built) or 'none'})"))
    else:
        rows.append(("horovod", _version(hvd) if hvd.get("installed") else
                     "not installed (scripts/install-horovod builds it)"))
    for name, entry in info["launchers"].items():
        rows.append((name, (entry["path"] or "not found") + (f" ({entry['version']})" if entry.get("version") else "")))
    job = info["slurm_job"]
    if job:
        rows.append(("slurm job", f"{job['job_id']} ({job.get('job_name') or '?'}) on {job['nodelist']}, "
                                  f"{job.get('ntasks') or '?'} task(s), {job.get('num_nodes') or '?'} node(s)"))
    else:
        rows.append(("slurm job", "not inside a Slurm job"))
    ml = info["mpi_launch"]
    rows.append(("mpi launch", f"rank {ml['rank']} of {ml['size']}" if ml["launched"] else "not launched by MPI"))
    sysinfo = info["system"]
    rows.append(("host", f"{sysinfo['hostname']} ({sysinfo['platform']})"))
    rows.append(("cpus", f"{sysinfo['cpus_usable']} usable of {sysinfo['cpu_count']}"))
    rows.append(("memory", human_bytes(sysinfo["memory_bytes"])))
    shm = info["shm"]
    if "error" in shm:
        rows.append(("/dev/shm", f"unavailable: {shm['error']}"))
    else:
        rows.append(("/dev/shm", f"{human_bytes(shm['available_bytes'])} free of {human_bytes(shm['size_bytes'])}"))
    gpus = info["gpus"]
    if gpus["count"]:
        rows.append(("gpus", "; ".join(f"{d['index']}: {d['name']}" for d in gpus["devices"])))
    else:
        rows.append(("gpus", "none"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {val}" for k, val in rows)


def _render(info: dict[str, Any], as_json: bool) -> str:
    if as_json:
        return json.dumps(info, indent=None, sort_keys=True, default=str)
    return format_text(info)


def run(args: argparse.Namespace) -> int:
    from hpcstagger.cli.sysinfo import collect
    from hpcstagger.comm import Comm

    info = collect()
    text = _render(info, args.json)
    if info["versions"]["mpi4py"].get("world_size", 1) > 1:  # set only when MPI is initialised
        # Each rank writing its own report lets the launcher interleave pieces of long lines;
        # rank 0 prints them all, in rank order, one report (one JSON object per line) per rank.

        reports = Comm.world().gather(text, root=0)
        if reports is None:
            return 0
        text = "\n".join(reports) if args.json else "\n\n".join(reports)
    print(text, flush=True)
    return 0
