"""Benchmark asynchronous, sharded checkpoints against torch.save, DCP async_save and a bare copy.

    python benchmarks/bench_checkpoint.py [--quick] [--ranks 1,2,4] [--mb 200] [--dir DIR]

For each rank count N it runs itself under ``mpiexec -n N`` (the worker) with a data-parallel
model whose state (parameters + Adam moments) is about --mb MB, replicated on every rank, and
measures, repeating each measurement and taking medians:

(a) blocking time per save: AsyncCheckpointer.save (slowest rank), torch.save of the whole state on
    rank 0 (the others would wait for it), torch.distributed.checkpoint.async_save (gloo process
    group from hpcstagger.integrations.torch_ddp.init_process_group; slowest rank), and the floor:
    a bare copy of the whole state into preallocated host buffers, every rank at once (the faster
    of numpy's and torch's copy);
(b) time until durable: save() until the manifest is committed and fsynced (slowest rank), DCP's
    future resolved, torch.save + fsync; and with a /dev/shm staging level, time until staged;
(c) training step slowdown while a save is in flight: DDP training (gloo, gated all-reduce comm
    hook); step times while a save is in flight against steps without one, with the writer
    ungated (gate=None) and gated on the all-reduces.

Results go to benchmarks/out/bench_checkpoint.json and a table on stdout. Checkpoints are written
under --dir (default benchmarks/out/ckpt-bench, removed afterwards), staging under /dev/shm.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "out")


# ---------------------------------------------------------------------------------------- worker
def _model(mb: float):
    """An MLP whose parameters + Adam state are about ``mb`` MB (3 x 4 bytes per parameter)."""
    import torch

    params = mb * 1e6 / 12
    width = int(((params - 2 * 512 * 1024) / 3) ** 0.5)  # in, 3 hidden square layers, out
    width = max(64, width // 64 * 64)
    layers = [torch.nn.Linear(512, width), torch.nn.ReLU()]
    for _ in range(3):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    layers += [torch.nn.Linear(width, 512)]
    torch.manual_seed(0)
    return torch.nn.Sequential(*layers)


def _batch(step: int, rank: int, batch: int):
    import torch

    g = torch.Generator().manual_seed(step * 1000 + rank)
    return torch.randn(batch, 512, generator=g), torch.randn(batch, 512, generator=g)


def _nbytes(state) -> int:
    import torch

    total = 0

    def walk(o):
        nonlocal total
        if isinstance(o, torch.Tensor):
            total += o.numel() * o.element_size()
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)

    walk(state)
    return total


def _tensors(state):
    import torch

    out = []

    def walk(o):
        if isinstance(o, torch.Tensor):
            out.append(o)
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)

    walk(state)
    return out


def worker(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from hpcstagger import config
    from hpcstagger.checkpoint import ActivityGate, AsyncCheckpointer
    from hpcstagger.comm import Comm
    from hpcstagger.integrations.torch_ddp import destroy_process_group, gated_allreduce_hook, init_process_group

    comm = Comm.world()
    rank, size = comm.rank, comm.size
    init_process_group(comm, timeout=600)
    reps = args.reps
    root = args.dir
    log = (lambda *a: print(f"[n={size}]", *a, file=sys.stderr, flush=True)) if rank == 0 else (lambda *a: None)

    def slowest(x: float) -> float:
        return comm.allreduce(x, "max")

    model = _model(args.mb)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    gate = ActivityGate()
    ddp.register_comm_hook(None, gated_allreduce_hook(gate))
    flag = torch.zeros(1)

    def train_step(step: int) -> float:
        x, y = _batch(step, rank, args.batch)
        t = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        return time.perf_counter() - t

    train_step(0)  # Adam state exists from here on
    state = {"model": model, "optimizer": opt, "step": 0}
    nbytes = _nbytes({"m": model.state_dict(), "o": opt.state_dict()})
    log(f"state {nbytes / 1e6:.0f} MB ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters)")
    res: dict = {"ranks": size, "state_bytes": nbytes, "reps": reps}

    # (a) floor: a bare copy of the whole state into preallocated buffers, on every rank at once.
    srcs = _tensors({"m": model.state_dict(), "o": opt.state_dict()})
    bufs = [torch.empty_like(t) for t in srcs]
    for b in bufs:
        b.zero_()
    floor = {}
    for how in ("numpy", "torch"):
        times = []
        for _ in range(reps + 1):
            comm.barrier()
            t = time.perf_counter()
            if how == "numpy":
                for s, b in zip(srcs, bufs):
                    np.copyto(b.numpy(), s.numpy())
            else:
                for s, b in zip(srcs, bufs):
                    b.copy_(s)
            times.append(slowest(time.perf_counter() - t))
        floor[how] = statistics.median(times[1:])
    del bufs
    res["floor_copy_s"] = min(floor.values())
    res["floor_copy_by_method_s"] = floor
    log(f"floor copy {res['floor_copy_s'] * 1e3:.1f} ms {floor}")

    # (a)+(b) torch.save of the whole state on rank 0 (blocking = the call; durable = + fsync).
    ts_block, ts_durable = [], []
    path = os.path.join(root, "torch_save.pt")
    for _ in range(reps):
        comm.barrier()
        if rank == 0:
            t = time.perf_counter()
            with open(path, "wb") as f:
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
                t1 = time.perf_counter()
                f.flush()
                os.fsync(f.fileno())
            ts_block.append(t1 - t)
            ts_durable.append(time.perf_counter() - t)
            os.unlink(path)
    comm.barrier()
    res["torch_save_blocking_s"] = comm.bcast(statistics.median(ts_block) if rank == 0 else None)
    res["torch_save_durable_s"] = comm.bcast(statistics.median(ts_durable) if rank == 0 else None)
    log(f"torch.save {res['torch_save_blocking_s']:.3f} s, +fsync {res['torch_save_durable_s']:.3f} s")

    # (a)+(b) DCP async_save.
    d_block, d_durable = [], []
    for i in range(reps + 1):
        msd, osd = get_state_dict(model, opt)
        comm.barrier()
        t = time.perf_counter()
        fut = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(root, f"dcp-{i}"))
        b = time.perf_counter() - t
        fut.result()
        dd = time.perf_counter() - t
        if i:  # the first call sets DCP up (and allocates its staging copy)
            d_block.append(slowest(b))
            d_durable.append(slowest(dd))
        else:
            slowest(b), slowest(dd)
        comm.barrier()
        if rank == 0:
            shutil.rmtree(os.path.join(root, f"dcp-{i}"), ignore_errors=True)
    res["dcp_blocking_s"] = statistics.median(d_block)
    res["dcp_durable_s"] = statistics.median(d_durable)
    log(f"DCP async_save blocking {res['dcp_blocking_s']:.3f} s, durable {res['dcp_durable_s']:.3f} s")
    del msd, osd
    import gc

    gc.collect()

    # (a)+(b) ours: blocking and durable, with the first save (buffer allocation) apart.
    ck = AsyncCheckpointer(os.path.join(root, "ours"), comm=comm, keep=2)
    o_block, o_durable, first = [], [], None
    for i in range(reps + 1):
        state["step"] = i
        comm.barrier()
        t = time.perf_counter()
        h = ck.save(i, state)
        b = time.perf_counter() - t
        h.wait()
        dd = time.perf_counter() - t
        b, dd = slowest(b), slowest(dd)
        if i == 0:
            first = b
        else:
            o_block.append(b)
            o_durable.append(dd)
    ck.close()
    res["ours_first_blocking_s"] = first
    res["ours_blocking_s"] = statistics.median(o_block)
    res["ours_durable_s"] = statistics.median(o_durable)
    log(f"ours blocking {res['ours_blocking_s'] * 1e3:.1f} ms (first {first * 1e3:.1f}), "
        f"durable {res['ours_durable_s']:.3f} s")

    # (b) ours with a /dev/shm staging level: time until staged, and until durable on disk.
    if not args.no_staging:
        shm = comm.bcast(tempfile.mkdtemp(prefix="hpcstagger-bench-", dir="/dev/shm") if rank == 0 else None)
        try:
            ck = AsyncCheckpointer(os.path.join(root, "ours-staged"), comm=comm, keep=1, staging_dir=shm)
            st, sd = [], []
            for i in range(reps + 1):
                comm.barrier()
                t = time.perf_counter()
                h = ck.save(i, state)
                h.wait_staged()
                s1 = time.perf_counter() - t
                h.wait()
                s2 = time.perf_counter() - t
                s1, s2 = slowest(s1), slowest(s2)
                if i:
                    st.append(s1)
                    sd.append(s2)
            ck.close()
            res["ours_staged_s"] = statistics.median(st)
            res["ours_staged_then_durable_s"] = statistics.median(sd)
            log(f"ours with /dev/shm staging: staged {res['ours_staged_s']:.3f} s, "
                f"durable {res['ours_staged_then_durable_s']:.3f} s")
        finally:
            comm.barrier()
            if rank == 0:
                shutil.rmtree(shm, ignore_errors=True)

    # (c) step slowdown while a save is in flight, ungated and gated.
    def steps_while(ck_, nsaves: int, base_step: int) -> tuple[list[float], list[float]]:
        """Train; start a save every few steps; step times split into (quiet, in flight)."""
        quiet, busy = [], []
        step = base_step
        for n in range(nsaves):
            for _ in range(args.quiet_steps):  # quiet steps, the previous save long done
                dt = train_step(step)
                step += 1
                quiet.append(dt)
            state["step"] = step
            h = ck_.save(step, state)
            while True:  # every rank follows rank 0's view of "in flight" (DDP needs equal step counts)
                flag[0] = 0.0 if h.done() else 1.0
                dist.broadcast(flag, 0)
                if flag[0] == 0.0:
                    break
                busy.append(train_step(step))
                step += 1
            h.wait()
        return quiet, busy

    out_c = {}
    step0 = 100
    for variant, g in (("ungated", None), ("gated", gate)):
        ck = AsyncCheckpointer(os.path.join(root, f"ours-{variant}"), comm=comm, keep=1, gate=g)
        ck.prepare(state)
        train_step(step0)
        quiet, busy = steps_while(ck, args.saves, step0)
        step0 += 1000
        ck.close()
        q = slowest(statistics.median(quiet))
        b = slowest(statistics.median(busy)) if busy else None  # equal step counts on every rank
        out_c[variant] = {"quiet_step_s": q, "inflight_step_s": b, "inflight_steps": len(busy),
                          "quiet_steps": len(quiet), "slowdown": (b / q - 1) if busy else None}
        log(f"{variant}: quiet step {q * 1e3:.0f} ms, in flight {_fmt_ms(b)} ms over {len(busy)} steps "
            f"-> slowdown {_fmt_pct(out_c[variant]['slowdown'])}")
    res["step"] = out_c
    destroy_process_group(comm)
    if rank == 0:
        with open(args.worker_out, "w") as f:
            json.dump(res, f)


# ---------------------------------------------------------------------------------- orchestrator
def _fmt_ms(x):
    return "-" if x is None else f"{x * 1e3:.1f}"


def _fmt_pct(x):
    return "-" if x is None else f"{x * 100:+.1f}%"


def table(results: list[dict]) -> str:
    rows = [("ranks", "state MB", "floor copy ms", "ours block ms", "first save ms", "torch.save ms", "DCP async ms",
             "ours/floor", "ours/torch.save", "ours durable s", "DCP durable s", "torch.save+fsync s",
             "staged s", "step slow ungated", "step slow gated")]
    for r in results:
        s = r["step"]
        rows.append((str(r["ranks"]), f"{r['state_bytes'] / 1e6:.0f}", _fmt_ms(r["floor_copy_s"]),
                     _fmt_ms(r["ours_blocking_s"]), _fmt_ms(r["ours_first_blocking_s"]),
                     _fmt_ms(r["torch_save_blocking_s"]), _fmt_ms(r["dcp_blocking_s"]),
                     f"{r['ours_blocking_s'] / r['floor_copy_s']:.2f}",
                     f"{r['ours_blocking_s'] / r['torch_save_blocking_s']:.3f}",
                     f"{r['ours_durable_s']:.3f}", f"{r['dcp_durable_s']:.3f}", f"{r['torch_save_durable_s']:.3f}",
                     f"{r['ours_staged_s']:.3f}" if "ours_staged_s" in r else "-",
                     _fmt_pct(s["ungated"]["slowdown"]), _fmt_pct(s["gated"]["slowdown"])))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small state, fewer repeats (a smoke run)")
    p.add_argument("--ranks", default="1,2,4", help="rank counts to run (default 1,2,4)")
    p.add_argument("--mb", type=float, help="state size in MB (default 200; --quick 40)")
    p.add_argument("--reps", type=int, help="repeats per measurement (default 5; --quick 2)")
    p.add_argument("--saves", type=int, help="saves per step-slowdown variant (default 3; --quick 2)")
    p.add_argument("--quiet-steps", type=int, default=4, help="steps without a save in flight between saves")
    p.add_argument("--batch", type=int, default=32, help="training batch per rank")
    p.add_argument("--dir", default=os.path.join(OUT, "ckpt-bench"), help="where checkpoints are written")
    p.add_argument("--no-staging", action="store_true", help="skip the /dev/shm staging measurement")
    p.add_argument("--out", default=os.path.join(OUT, "bench_checkpoint.json"), help="JSON result file")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.mb = args.mb or (40 if args.quick else 200)
    args.reps = args.reps or (2 if args.quick else 5)
    args.saves = args.saves or (2 if args.quick else 3)
    if args.worker:
        worker(args)
        return 0

    results = []
    started = time.time()
    for n in [int(x) for x in args.ranks.split(",")]:
        root = os.path.join(args.dir, f"n{n}")
        os.makedirs(root, exist_ok=True)
        fd, wout = tempfile.mkstemp(prefix="bench-ckpt-", suffix=".json")
        os.close(fd)
        cmd = ["mpiexec", "-n", str(n), sys.executable, os.path.abspath(__file__), "--worker", "--worker-out", wout,
               "--mb", str(args.mb), "--reps", str(args.reps), "--saves", str(args.saves),
               "--quiet-steps", str(args.quiet_steps), "--batch", str(args.batch), "--dir", root]
        if args.no_staging:
            cmd.append("--no-staging")
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n))))
        print(f"running: {' '.join(cmd)}", file=sys.stderr, flush=True)
        try:
            subprocess.run(cmd, check=True, env=env, timeout=1800)
            with open(wout) as f:
                results.append(json.load(f))
        finally:
            os.unlink(wout)
            shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(args.dir, ignore_errors=True)
    doc = {"benchmark": "bench_checkpoint", "command": " ".join([os.path.relpath(__file__, os.getcwd())] + sys.argv[1:]),
           "date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "host": platform.node(), "cpus": os.cpu_count(),
           "load_avg_at_end": os.getloadavg(), "wall_s": time.time() - started, "quick": args.quick, "results": results}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(table(results))
    print(f"\nwrote {args.out} in {doc['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
