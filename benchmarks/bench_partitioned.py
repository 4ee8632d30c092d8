#!/usr/bin/env python3
"""Benchmark of the partitioned cache across nodes. All measurements come from one run.

Results: benchmarks/RESULTS.md, section Partitioned cache.

(a) Epochs on M emulated nodes (M = 2 and 4, one rank per node by default), each node with a cache
    of 1/M of the dataset (x ``--slack``), behind one ``ThrottledSource`` that every rank shares (the
    shared file system). Every epoch each rank reads its share of a fresh random order (as a
    DistributedSampler does) through a ``CachedDataset``, once over a ``PartitionedCache`` and once
    over node-local ``ShmCache``s of the same size. Per epoch: source bytes read (all ranks,
    percent of the dataset), epoch time (slowest rank) and wrong samples. Nodes are emulated with
    MPICH's cliques (``MPIR_CVAR_NUM_CLIQUES``), so the traffic between them goes through MPICH's
    network module as between real nodes.
(b) Remote-hit throughput per process for samples of 100 KB and 1 MB: ``get`` + ``bytes()`` of
    samples owned by another node against the same for local hits. Beside it, the floor that the
    transport sets, from raw parts timed in the same run with the other rank idle in a barrier: one
    ``MPI_Rget`` of the sample's bytes from the other node's window, one memory copy and one xxh3
    checksum of them. A local hit needs a checksum and a copy, a remote hit the read as well, so
    ``(checksum + copy) / (read + checksum + copy)`` is the ratio a remote hit would reach with this
    transport if nothing else cost anything: the transport's floor.
(c) Transport: one-sided ``MPI_Rget`` against two-sided request/reply to a server thread, with the
    target process idle and with it busy in Python (it holds the GIL), 100 KB per transfer, for 1 s
    each. The target's main thread makes no MPI call in that second (a training step does none), so
    a transport that needs the target's progress for one-sided reads shows it.
(d) Faults: 2 nodes x 2 ranks; rank 3 (node 1) is stopped (SIGSTOP: a hung node) or killed
    (SIGKILL) half way through epoch 2. Per case: which ranks wrote a report of every epoch, wrong
    samples, dead nodes. Every rank writes its report as soon as its epochs are done, then lingers
    (until every rank but the victim has reported or ended, at most 60 s) before it leaves, so that the launcher's
    clean-up at a rank's exit cannot cut another rank's epoch short. The kill runs three times:
    - ``kill``: one Hydra proxy for all 4 ranks (plain ``mpiexec -n 4``). Hydra's proxy SIGKILLs
      every rank it started once it reaps a rank that died of a signal, with or without
      ``-disable-auto-cleanup``, at its next event (any rank's output or PMI call, or an exit). So
      the survivors finish only if nothing reaches the proxy first: this measures Hydra, not the cache.
    - ``kill-per-node``: one proxy per emulated node (``-launcher fork -hosts localhost:2,127.0.0.1:2``),
      as Hydra runs on real nodes. Node 1's proxy ends node 1; node 0 (ranks 0 and 1) must finish.
      MPICH then sees two nodes, and node 0 reads node 1 over UCX, which on one host copies with
      CMA (``process_vm_readv``): a read from a rank that is dying aborts the reader inside UCX.
    - ``kill-per-node-nocma``: the same with ``UCX_TLS=^cma``, so UCX reads through its other
      transports; the reader is not aborted, and the dead node is marked dead by the cache.
    Faults run with ``MPIR_CVAR_NO_COLLECTIVE_FINALIZE=1``: ``MPI_Finalize`` with a dead rank hangs.

Usage: python benchmarks/bench_partitioned.py [--quick] [--parts abcd] [--json PATH]
Prints tables and writes JSON (default benchmarks/out/bench_partitioned.json). Worker processes are
this script under mpiexec (``--worker PART``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
BIN = Path(sys.executable).parent


def _sample(i: int, size: int) -> bytes:
    return random.Random(i).randbytes(size)


class _Memory:
    """K samples of ``size`` bytes; the source behind the throttle."""

    def __init__(self, n: int, size: int):
        self.n, self.size = n, size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> bytes:
        return _sample(i, self.size)

    def key(self, i: int) -> str:
        return f"s{i}"


# ---- workers (under mpiexec) --------------------------------------------------------------------

def _epochs_worker(a: argparse.Namespace) -> None:
    from hpcstagger.cache import CachedDataset, PartitionedCache, ShmCache, ThrottledSource
    from hpcstagger.cache.nodes import discover
    from hpcstagger.comm import Comm

    comm = Comm.world()
    layout = discover(comm)
    m = layout.count
    cap = int(a.samples * a.size / m * a.slack)
    src = ThrottledSource(_Memory(a.samples, a.size), a.bandwidth, shared_name="bench-part")
    if a.mode == "partitioned":
        cache = PartitionedCache("bench", cap, comm, root=a.root, max_entries=2 * a.samples)
    else:
        root = os.path.join(a.root, f"node{layout.node}") if layout.emulated else a.root
        cache = ShmCache("bench", cap, root=root, max_entries=2 * a.samples)
    data = CachedDataset(src, cache)
    rows = []
    for epoch in range(a.epochs):
        order = list(range(a.samples))
        random.Random(epoch).shuffle(order)
        comm.barrier()
        before = cache.read_counters()[0]
        t, wrong = time.perf_counter(), 0
        for i in order[comm.rank::comm.size]:
            wrong += data[i] != _sample(i, a.size)
        seconds = time.perf_counter() - t
        if a.mode == "partitioned":
            for _ in range(20):  # the last inserts reach their owners before the epoch is measured
                cache.progress()
                time.sleep(0.002)
        comm.barrier()
        read = cache.read_counters()[0] - before
        rows.append({"seconds": seconds, "wrong": wrong, "read_bytes": read})
    per_epoch = comm.gather(rows)
    cache.close()
    if comm.rank == 0:
        assert per_epoch is not None
        # node-local read counters are per node: sum one rank per node (the first of each)
        firsts = [ranks[0] for ranks in layout.nodes]
        out = [{"seconds": max(r[e]["seconds"] for r in per_epoch), "wrong": sum(r[e]["wrong"] for r in per_epoch),
                "source_bytes": sum(per_epoch[f][e]["read_bytes"] for f in firsts)} for e in range(a.epochs)]
        Path(a.result).write_text(json.dumps({"nodes": m, "epochs": out}))


def _remote_worker(a: argparse.Namespace) -> None:
    from hpcstagger.cache import PartitionedCache
    from hpcstagger.comm import Comm

    comm = Comm.world()
    res = {}
    for size in (100_000, 1_000_000):
        n = max(8, a.samples * 100_000 // size)
        cache = PartitionedCache(f"rh{size}", n * size * 2, comm, root=a.root, max_entries=4 * n)
        for i in range(n):
            if cache.owner(i) == cache.layout.node:
                cache.put(i, _sample(i, size))
        comm.barrier()
        local = [i for i in range(n) if cache.owner(i) == cache.layout.node]
        remote = [i for i in range(n) if cache.owner(i) != cache.layout.node]
        rates = {}
        for name, keys in (("local", local), ("remote", remote)):
            t, nbytes = time.perf_counter(), 0
            for _ in range(a.reps):
                for i in keys:
                    nbytes += len(bytes(cache.get(i)))
            rates[name] = nbytes / (time.perf_counter() - t) / 1e6
        res[size] = rates
        comm.barrier()
        cache.close()
        res[size]["floor_us"] = _raw_parts(comm, size, a.root)
    all_res = comm.gather(res)
    if comm.rank == 0:
        Path(a.result).write_text(json.dumps(all_res))


def _raw_parts(comm, size: int, root: str, reps: int = 2000) -> dict | None:
    """Microseconds per ``size`` bytes for a raw one-sided read from the next rank's window, a copy
    and an xxh3 checksum. Rank 0 measures while the others wait in a barrier; None on other ranks."""
    import mmap

    from mpi4py import MPI

    from hpcstagger.cache._wire import _checksum

    span = 64 << 20
    path = os.path.join(root, f"raw-{comm.rank}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, span)
        mm = mmap.mmap(fd, span)
    finally:
        os.close(fd)
    mm[:] = os.urandom(1 << 20) * (span >> 20)
    mv = memoryview(mm)
    win = MPI.Win.Create(mv, 1, comm=comm.mpi)
    win.Lock_all()
    comm.mpi.Barrier()
    out = None
    if comm.rank == 0:
        offs = [(i * 131_072) % (span - size) for i in range(reps)]
        out = {}
        t = time.perf_counter()
        for off in offs:
            bytes(mv[off:off + size])
        out["copy"] = (time.perf_counter() - t) / reps * 1e6
        t = time.perf_counter()
        for off in offs:
            _checksum(mv[off:off + size])
        out["checksum"] = (time.perf_counter() - t) / reps * 1e6
        t = time.perf_counter()
        for off in offs:
            req = win.Rget(bytearray(size), 1, (off, size, MPI.BYTE))
            while not req.Test():
                pass
        out["read"] = (time.perf_counter() - t) / reps * 1e6
    comm.mpi.Barrier()
    win.Unlock_all()
    win.Free()
    mv.release()
    mm.close()
    os.unlink(path)
    return out


def _transport_worker(a: argparse.Namespace) -> None:
    import mmap
    import struct
    import threading

    import numpy as np
    from mpi4py import MPI

    from hpcstagger.comm import mpi_module

    mpi_module()
    comm, n, window = MPI.COMM_WORLD, 100_000, 1.0  # the measured seconds; the target stays out of MPI longer
    buf = mmap.mmap(-1, n)
    buf[:] = os.urandom(n)
    out: dict = {}
    for busy in (False, True):
        # one-sided
        win = MPI.Win.Create(np.frombuffer(buf, dtype=np.uint8), 1, MPI.INFO_NULL, comm)
        win.Lock_all(MPI.MODE_NOCHECK)
        comm.Barrier()
        if comm.rank == 1:
            _spin(busy, comm, window * 1.5)
        else:
            got, t, k = bytearray(n), time.perf_counter(), 0
            while time.perf_counter() - t < window:
                r = win.Rget(got, 1, (0, n, MPI.BYTE))
                while not r.Test():
                    pass
                k += 1
            out[f"rma_busy={busy}"] = k * n / (time.perf_counter() - t) / 1e6
            comm.send("done", dest=1, tag=9)
        win.Unlock_all()
        win.Free()
        # two-sided, a server thread on the target
        sc = comm.Dup()
        if comm.rank == 1:
            def serve(sc=sc):
                req = bytearray(8)
                while True:
                    st = MPI.Status()
                    sc.Recv(req, source=0, tag=1, status=st)
                    if struct.unpack("<Q", req)[0] == 0:
                        return
                    sc.Send(memoryview(buf), dest=0, tag=2)
            th = threading.Thread(target=serve)
            th.start()
            comm.Barrier()
            _spin(busy, comm, window * 1.5)
            th.join()
        else:
            comm.Barrier()
            got, t, k = bytearray(n), time.perf_counter(), 0
            while time.perf_counter() - t < window:
                sc.Send(struct.pack("<Q", n), dest=1, tag=1)
                sc.Recv(got, source=1, tag=2)
                k += 1
            out[f"p2p_busy={busy}"] = k * n / (time.perf_counter() - t) / 1e6
            sc.Send(struct.pack("<Q", 0), dest=1, tag=1)
            comm.send("done", dest=1, tag=9)
        sc.Free()
    if comm.rank == 0:
        Path(a.result).write_text(json.dumps(out))


def _spin(busy: bool, comm, seconds: float) -> None:
    """Rank 1 while rank 0 measures: ``seconds`` outside MPI, in pure Python work (holding the GIL)
    or asleep; then it waits for rank 0's word."""
    x, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        if busy:
            for i in range(20000):
                x += i
        else:
            time.sleep(0.001)
    comm.recv(source=0, tag=9)


# ---- the driver ---------------------------------------------------------------------------------

def _mpiexec(ranks: int, nodes: int, args: list[str], timeout: float = 600, extra: list[str] | None = None,
             env: dict | None = None) -> tuple[dict | list | None, str]:
    result = tempfile.mktemp(prefix="bench-part-", suffix=".json")
    e = {**os.environ, "MPIR_CVAR_NUM_CLIQUES": str(nodes), "MPIR_CVAR_CLIQUES_BY_BLOCK": "1", **(env or {})}
    e.pop("MPIR_CVAR_PMI_VERSION", None)
    cmd = [str(BIN / "mpiexec"), *(extra or []), "-n", str(ranks), sys.executable, __file__, *args,
           "--result", result]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=e)
        text = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        text = f"timed out after {timeout} s: {exc}"
    try:
        return json.loads(Path(result).read_text()), text
    except (OSError, ValueError):
        return None, text
    finally:
        if os.path.exists(result):
            os.unlink(result)


def part_epochs(a: argparse.Namespace) -> dict:
    out: dict = {}
    dataset = a.samples * a.size
    print(f"(a) epochs: {a.samples} samples x {a.size // 1000} KB, source {a.bandwidth / 1e6:g} MB/s shared, "
          f"node cache 1/M x {a.slack}")
    print(f"{'M':>2} {'mode':<12} {'epoch':>5} {'source %':>9} {'seconds':>8} {'wrong':>5}")
    for m in a.nodes:
        for mode in ("partitioned", "node-local"):
            root = tempfile.mkdtemp(prefix="bench-part-", dir="/dev/shm")
            try:
                res, text = _mpiexec(m * a.ranks_per_node, m, ["--worker", "epochs", "--mode", mode, "--root", root,
                                     *_common(a)], env={"HPCSTAGGER_THROTTLE_DIR": os.path.join(root, "throttle")})
            finally:
                shutil.rmtree(root, ignore_errors=True)
            if not isinstance(res, dict):
                print(f"{m:>2} {mode:<12} failed:\n{text[-2000:]}")
                continue
            for e, row in enumerate(res["epochs"]):
                row["source_percent"] = 100 * row["source_bytes"] / dataset
                print(f"{m:>2} {mode:<12} {e + 1:>5} {row['source_percent']:>8.1f}% {row['seconds']:>8.2f} "
                      f"{row['wrong']:>5}")
            out[f"{m}/{mode}"] = res["epochs"]
        p, n = out.get(f"{m}/partitioned"), out.get(f"{m}/node-local")
        if p and n and len(p) > 1:
            sp = sum(r["seconds"] for r in n[1:]) / sum(r["seconds"] for r in p[1:])
            out[f"{m}/speedup_epochs_2+"] = sp
            print(f"{m:>2} epochs 2+: partitioned is {sp:.2f}x faster than node-local caching")
    return out


def part_remote(a: argparse.Namespace) -> dict:
    root = tempfile.mkdtemp(prefix="bench-part-", dir="/dev/shm")
    try:
        res, text = _mpiexec(2, 2, ["--worker", "remote", "--root", root, *_common(a)])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("(b) remote-hit throughput per process (MB/s), rank 0 of 2 nodes")
    if not isinstance(res, list):
        print(f"failed:\n{text[-2000:]}")
        return {}
    for size, rates in res[0].items():
        print(f"  {int(size) // 1000:>5} KB: local {rates['local']:8.0f}  remote {rates['remote']:8.0f}  "
              f"ratio {rates['remote'] / rates['local']:.2f}")
        f = rates.get("floor_us")
        if f:
            ceiling = (f["checksum"] + f["copy"]) / (f["read"] + f["checksum"] + f["copy"])
            rates["ceiling"] = ceiling
            print(f"         raw parts (us): read {f['read']:.1f}  copy {f['copy']:.1f}  checksum {f['checksum']:.1f}"
                  f"  -> with nothing else costing anything: {ceiling:.2f}x")
    return {"per_rank": res}


def part_transport(a: argparse.Namespace) -> dict:
    res, text = _mpiexec(2, 2, ["--worker", "transport", *_common(a)])
    print("(c) transport, 100 KB per transfer (MB/s), target idle / busy in Python")
    if not isinstance(res, dict):
        print(f"failed:\n{text[-2000:]}")
        return {}
    for k, v in sorted(res.items()):
        print(f"  {k:<18} {v:8.0f}")
    return res


def part_faults(a: argparse.Namespace) -> dict:
    from hpcstagger.colocated._shm import remove_stale_mpich_segments

    job = HERE.parent / "tests" / "support" / "partitioned_job.py"
    out: dict = {}
    print("(d) faults: 2 nodes x 2 ranks, rank 3 (node 1) stopped or killed half way through epoch 2")
    for how in ("stop", "kill", "kill-per-node", "kill-per-node-nocma"):
        d = Path(tempfile.mkdtemp(prefix="bench-part-faults-"))
        root = tempfile.mkdtemp(prefix="bench-part-", dir="/dev/shm")
        env = {**os.environ, "HPCSTAGGER_CACHE_NODES": "2", "HPCSTAGGER_CACHE_REMOTE_TIMEOUT": "1",
               "HPCSTAGGER_COLLECTIVE_TIMEOUT": "5", "MPIR_CVAR_NO_COLLECTIVE_FINALIZE": "1"}
        env.pop("MPIR_CVAR_PMI_VERSION", None)
        if how.endswith("nocma"):
            env["UCX_TLS"] = "^cma"
        per_node = ["-launcher", "fork", "-hosts", "localhost:2,127.0.0.1:2"] if "per-node" in how else []
        cmd = [str(BIN / "mpiexec"), "-disable-auto-cleanup", *per_node, "-n", "4", sys.executable, str(job),
               str(d), root, "--epochs", "3", f"--{how.split('-')[0]}", "3:1"]
        t = time.monotonic()
        since = time.time()  # MPICH's segments that a killed or stopped rank leaves are removed after
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        try:
            while proc.poll() is None and len(list(d.glob("*.closed"))) < 3 and time.monotonic() - t < 120:
                time.sleep(0.2)
            if (d / "stopped.pid").exists():
                os.kill(int((d / "stopped.pid").read_text()), 9)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
            shutil.rmtree(root, ignore_errors=True)
            remove_stale_mpich_segments(since, settle=2.0)
        reports = [json.loads(p.read_text()) for p in d.glob("*.json")]
        shutil.rmtree(d, ignore_errors=True)
        done = sorted(r["rank"] for r in reports if len(r["epochs"]) == 3)
        row = {"finished_ranks": done, "survivors_finished": len(done),
               "wrong": sum(e["wrong"] for r in reports for e in r["epochs"]),
               "dead_nodes": sorted({n for r in reports for n in r["dead_nodes"]}),
               "seconds": time.monotonic() - t}
        out[how] = row
        print(f"  {how:<19} ranks that finished every epoch: {done} (of 0, 1, 2), wrong samples {row['wrong']}, "
              f"dead nodes seen {row['dead_nodes']}, {row['seconds']:.1f} s")
    return out


def _common(a: argparse.Namespace) -> list[str]:
    return ["--samples", str(a.samples), "--size", str(a.size), "--epochs", str(a.epochs), "--slack", str(a.slack),
            "--bandwidth", str(a.bandwidth), "--reps", str(a.reps)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (about a minute)")
    ap.add_argument("--parts", default="abcd", help="which parts to run (default: abcd)")
    ap.add_argument("--json", default=str(HERE / "out" / "bench_partitioned.json"), help="where to write the JSON")
    ap.add_argument("--nodes", type=int, nargs="+", default=[2, 4], help="emulated node counts (default: 2 4)")
    ap.add_argument("--ranks-per-node", type=int, default=1)
    ap.add_argument("--samples", type=int, default=400)
    ap.add_argument("--size", type=int, default=100_000, help="bytes per sample (default 100 KB)")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--slack", type=float, default=1.15, help="node cache = dataset / M x this")
    ap.add_argument("--bandwidth", type=float, default=20e6, help="the shared source's bytes/s")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        {"epochs": _epochs_worker, "remote": _remote_worker, "transport": _transport_worker}[a.worker](a)
        return 0
    if a.quick:
        a.samples, a.epochs, a.reps = 120, 3, 2
    out = {"args": {k: v for k, v in vars(a).items() if v is not None}, "host": os.uname().nodename,
           "cpus": os.cpu_count()}
    parts = {"a": ("epochs", part_epochs), "b": ("remote_hits", part_remote), "c": ("transport", part_transport),
             "d": ("faults", part_faults)}
    for p in a.parts:
        name, fn = parts[p]
        out[name] = fn(a)
    os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
