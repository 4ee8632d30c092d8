"""Benchmark asynchronous, sharded checkpoints against torch.save, DCP async_save and a bare copy.

    python benchmarks/bench_checkpoint.py [--quick] [--ranks 1,2,4] [--mb 200] [--dir DIR] [--repeat N]

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
(b2) the write path: ours with O_DIRECT writes against ours with buffered writes (the
    ``ckpt_direct_io`` knob), alternating save by save, every phase of a save timed on every rank
    (:mod:`hpcstagger.checkpoint.probe`: snapshot, xxh3, HDF5 structure, writes, fsync, rename,
    collectives, commit); ``--no-paths`` skips it;
(c) training step slowdown while a save is in flight: DDP training (gloo, gated all-reduce comm
    hook); step times while a save is in flight against steps without one, with the writer
    ungated (gate=None), gated on the all-reduces, gated on whole training steps, ungated at
    nice 19 (ckpt_writer_nice), and for comparison while a DCP async_save is in flight.

``--repeat N`` runs every rank count N times (interleaved: 1, 2, 4, 1, 2, 4, ...) and adds a
summary: per rank count the median of each headline figure over the N runs, with its range.

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
    # DCP's background thread runs collectives; on the group DDP uses from the main thread they
    # would interleave differently on each rank and hang, so DCP gets a group of its own.
    dcp_pg = dist.new_group(backend="gloo")
    reps = args.reps
    root = args.dir
    log = (lambda *a: print(f"[n={size}]", *a, file=sys.stderr, flush=True)) if rank == 0 else (lambda *a: None)

    def slowest(x: float) -> float:
        return comm.allreduce(x, "max")

    def sync() -> None:
        """A tight barrier before a timed section: MPI's own, which releases every rank at once
        (Comm.barrier polls with back-off and can release ranks milliseconds apart)."""
        if comm.is_mpi:
            comm.mpi.Barrier()

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

    def timed_save(ck, i: int) -> tuple[float, float]:
        """One save of ``state`` as step ``i``, all ranks starting together: this rank's seconds
        blocked in save() and until its handle's wait() returned (durable)."""
        state["step"] = i
        sync()
        t = time.perf_counter()
        h = ck.save(i, state)
        b = time.perf_counter() - t
        h.wait()
        return b, time.perf_counter() - t
    srcs = _tensors({"m": model.state_dict(), "o": opt.state_dict()})
    nbytes = sum(s_.numel() * s_.element_size() for s_ in srcs)
    log(f"state {nbytes / 1e6:.0f} MB ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters)")
    res: dict = {"ranks": size, "state_bytes": nbytes, "reps": reps}

    # (a) floor: a bare copy of the whole state into preallocated buffers, on every rank at once
    # (measured in each round below, the faster of numpy's and torch's copy).
    bufs = [torch.empty_like(t) for t in srcs]
    for b in bufs:
        b.zero_()

    def floor_copy(how: str) -> float:
        sync()
        t = time.perf_counter()
        if how == "numpy":
            for s_, b_ in zip(srcs, bufs, strict=True):
                np.copyto(b_.numpy(), s_.numpy())
        else:
            for s_, b_ in zip(srcs, bufs, strict=True):
                b_.copy_(s_)
        return slowest(time.perf_counter() - t)

    # (a)+(b) torch.save on rank 0, DCP async_save and ours, interleaved round by round so that all
    # three see the same machine (other jobs share this node). The first round only warms up (DCP
    # and ours allocate their staging buffers in it); ours' first blocking time is reported apart.
    import gc

    ck = AsyncCheckpointer(os.path.join(root, "ours"), comm=comm, keep=2, gate=None)  # no training runs here
    m = {k: [] for k in ("floor_numpy", "floor_torch", "ts_block", "ts_durable", "dcp_block", "dcp_durable",
                         "ours_block", "ours_durable")}
    first = None
    path = os.path.join(root, "torch_save.pt")
    for i in range(reps + 1):
        # torch.save of the whole state on rank 0 (blocking = the call; durable = + fsync)
        sync()
        if rank == 0:
            t = time.perf_counter()
            with open(path, "wb") as f:
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
                t1 = time.perf_counter()
                f.flush()
                os.fsync(f.fileno())
            if i:
                m["ts_block"].append(t1 - t)
                m["ts_durable"].append(time.perf_counter() - t)
            os.unlink(path)
        # DCP async_save (blocking = the call; durable = its future resolved), slowest rank
        msd, osd = get_state_dict(model, opt)
        sync()
        t = time.perf_counter()
        fut = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(root, f"dcp-{i}"),
                             process_group=dcp_pg)
        b = time.perf_counter() - t
        fut.result()
        dd = time.perf_counter() - t
        b, dd = slowest(b), slowest(dd)
        if i:
            m["dcp_block"].append(b)
            m["dcp_durable"].append(dd)
        del msd, osd, fut
        comm.barrier()
        if rank == 0:
            shutil.rmtree(os.path.join(root, f"dcp-{i}"), ignore_errors=True)
        # the floor right before ours (numpy's copy) and right after (torch's), so that both see the
        # machine as it is; the ratio ours/floor is taken per round
        fn = floor_copy("numpy")
        # ours (blocking = save(); durable = handle.wait() returned), slowest rank
        b, dd = timed_save(ck, i)
        ck.drain()  # retention (deleting the save before last) runs after durable; not timed here
        b, dd = slowest(b), slowest(dd)
        ft = floor_copy("torch")
        if i:
            m["ours_block"].append(b)
            m["ours_durable"].append(dd)
            m["floor_numpy"].append(fn)
            m["floor_torch"].append(ft)
        else:
            first = b
        gc.collect()
    ck.close()
    med = {k: (comm.bcast(statistics.median(v) if rank == 0 else None) if k.startswith("ts_")
               else statistics.median(v)) for k, v in m.items()}
    bufs.clear()  # free the copies (floor_copy above still refers to the lists)
    srcs.clear()
    res["floor_copy_by_method_s"] = {"numpy": med["floor_numpy"], "torch": med["floor_torch"]}
    res["floor_copy_s"] = min(med["floor_numpy"], med["floor_torch"])
    per_round = [o / min(a, b_) for o, a, b_ in zip(m["ours_block"], m["floor_numpy"], m["floor_torch"], strict=True)]
    res["ours_over_floor_per_round"] = per_round
    res["ours_over_floor_median"] = statistics.median(per_round)
    res.update(torch_save_blocking_s=med["ts_block"], torch_save_durable_s=med["ts_durable"],
               dcp_blocking_s=med["dcp_block"], dcp_durable_s=med["dcp_durable"],
               ours_first_blocking_s=first, ours_blocking_s=med["ours_block"], ours_durable_s=med["ours_durable"],
               samples={k: v for k, v in m.items() if rank == 0 or not k.startswith("ts_")})
    log(f"floor copy {res['floor_copy_s'] * 1e3:.1f} ms; torch.save {med['ts_block']:.3f} s "
        f"(+fsync {med['ts_durable']:.3f}); DCP async_save blocking "
        f"{med['dcp_block']:.3f} s, durable {med['dcp_durable']:.3f} s; ours blocking {med['ours_block'] * 1e3:.1f} ms "
        f"(first {first * 1e3:.1f}), durable {med['ours_durable']:.3f} s")

    # (b) the write path: O_DIRECT against buffered writes, alternating round by round, each save's
    # phases timed on every rank (hpcstagger.checkpoint.probe): the snapshot (save()'s blocking
    # time), xxh3, the HDF5 structure, the data writes, fsync, the rename, the collectives (waiting
    # for the slowest rank included) and the manifest's commit.
    if not args.no_paths:
        from hpcstagger.checkpoint import probe

        ck = AsyncCheckpointer(os.path.join(root, "ours-paths"), comm=comm, keep=1, gate=None)
        phases: dict[str, list[dict]] = {"direct": [], "buffered": []}
        durable: dict[str, list[float]] = {"direct": [], "buffered": []}
        for i in range(2 * (reps + 1)):
            how = "direct" if i % 2 == 0 else "buffered"
            with config.override(ckpt_direct_io=how == "direct"):
                probe.reset()
                probe.enable()
                b, dd = timed_save(ck, i)
                probe.disable()
                ck.drain()
            mine = {name: row["wall_s"] for name, row in probe.totals().items()}
            mine["snapshot"] = b
            mine["total"] = dd
            every = comm.allgather(mine)
            dd = slowest(dd)
            if i >= 2:  # the first round of each path warms up
                phases[how].append(every)
                durable[how].append(dd)
        ck.close()
        res["write_paths"] = {how: {"durable_s": statistics.median(durable[how]), "durable_samples": durable[how],
                                    "phases_by_rank": _phase_medians(phases[how])} for how in phases}
        for how, v in res["write_paths"].items():
            log(f"{how} writes: durable {v['durable_s']:.3f} s; rank 0 " + ", ".join(
                f"{k} {x * 1e3:.0f} ms" for k, x in v["phases_by_rank"][0].items()))

    # (b) ours with a /dev/shm staging level: time until staged, and until durable on disk.
    if not args.no_staging:
        shm = comm.bcast(tempfile.mkdtemp(prefix="hpcstagger-bench-", dir="/dev/shm") if rank == 0 else None)
        try:
            ck = AsyncCheckpointer(os.path.join(root, "ours-staged"), comm=comm, keep=1, staging_dir=shm, gate=None)
            st, sd = [], []
            for i in range(reps + 1):
                sync()
                t = time.perf_counter()
                h = ck.save(i, state)
                h.wait_staged()
                s1 = time.perf_counter() - t
                h.wait()
                s2 = time.perf_counter() - t
                ck.drain()
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

    # (c) step slowdown while a save is in flight. Each round runs every variant in turn: a few
    # quiet steps, then a save and the steps that start while it is in flight. A round's slowdown
    # is its mean in-flight step over its mean quiet step (so both see the same machine); the
    # result is the median over rounds.
    # Variants: our writer ungated; gated on DDP's all-reduces (the comm hook); gated on whole
    # training steps, the default (gate="auto": it writes a chunk between steps, or after
    # ckpt_gate_max_wait); ungated at nice 19; and DCP's async_save for comparison.
    variants = {"ungated": (None, 0), "allreduce-gated": (gate, 0), "step-gated": ("auto", 0),
                "nice19": (None, 19), "dcp": None}
    cks = {}
    for name, spec in variants.items():
        if spec is None:
            continue
        with config.override(ckpt_writer_nice=spec[1]):
            cks[name] = AsyncCheckpointer(os.path.join(root, f"ours-{name}"), comm=comm, keep=1, gate=spec[0])
        cks[name].prepare(state)
    per = {name: {"ratios": [], "quiet": [], "busy": [], "durable": []} for name in variants}
    step = 100
    train_step(step)
    for rnd in range(args.saves):
        for name in variants:
            quiet, busy = [], []
            for _ in range(args.quiet_steps):
                quiet.append(train_step(step))
                step += 1
            state["step"] = step
            t = time.perf_counter()
            if name == "dcp":
                msd, osd = get_state_dict(model, opt)
                fut = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(root, f"dcp-c{rnd}"),
                                     process_group=dcp_pg)
                done = fut.done
            else:
                h = cks[name].save(step, state)
                done = cks[name].idle  # in flight until the writer is idle, retention included
            while True:  # every rank follows rank 0's view of "in flight" (DDP needs equal step counts)
                flag[0] = 0.0 if done() else 1.0
                dist.broadcast(flag, 0)
                if flag[0] == 0.0:
                    break
                busy.append(train_step(step))
                step += 1
            if name == "dcp":
                fut.result()
                del msd, osd
                comm.barrier()
                if rank == 0:
                    shutil.rmtree(os.path.join(root, f"dcp-c{rnd}"), ignore_errors=True)
            else:
                h.wait()
            per[name]["durable"].append(time.perf_counter() - t)
            per[name]["quiet"] += quiet
            per[name]["busy"] += busy
            if busy:
                per[name]["ratios"].append(statistics.fmean(busy) / statistics.fmean(quiet) - 1)
    for c_ in cks.values():
        c_.close()
    out_c = {}
    for name in variants:
        v = per[name]
        ratios = comm.allgather(v["ratios"])  # every rank ran the same rounds; take the slowest rank per round
        worst = [max(r[k] for r in ratios) for k in range(len(ratios[0]))] if ratios[0] else []
        out_c[name] = {"slowdown": statistics.median(worst) if worst else None, "round_slowdowns": worst,
                       "quiet_step_s": slowest(statistics.median(v["quiet"])),
                       "inflight_step_s": slowest(statistics.median(v["busy"])) if v["busy"] else None,
                       "inflight_steps": len(v["busy"]), "quiet_steps": len(v["quiet"]),
                       "save_in_flight_s": slowest(statistics.median(v["durable"]))}
        log(f"{name}: quiet step {out_c[name]['quiet_step_s'] * 1e3:.0f} ms, in flight "
            f"{_fmt_ms(out_c[name]['inflight_step_s'])} ms over {len(v['busy'])} steps, save in flight "
            f"{out_c[name]['save_in_flight_s']:.2f} s -> slowdown {_fmt_pct(out_c[name]['slowdown'])}")
    res["step"] = out_c
    destroy_process_group(comm)
    if rank == 0:
        with open(args.worker_out, "w") as f:
            json.dump(res, f)


def _phase_medians(rounds: list[list[dict]]) -> list[dict]:
    """Per rank, each phase's median wall seconds over rounds (a phase a round lacks counts 0)."""
    ranks = len(rounds[0]) if rounds else 0
    out = []
    for r in range(ranks):
        names = sorted({k for rnd in rounds for k in rnd[r]})
        out.append({k: statistics.median(rnd[r].get(k, 0.0) for rnd in rounds) for k in names})
    return out


# ---------------------------------------------------------------------------------- orchestrator
def _fmt_ms(x):
    return "-" if x is None else f"{x * 1e3:.1f}"


def _fmt_pct(x):
    return "-" if x is None else f"{x * 100:+.1f}%"


def table(results: list[dict]) -> str:
    rows = [("ranks", "state MB", "floor copy ms", "ours block ms", "first save ms", "torch.save ms", "DCP async ms",
             "ours/floor (per round)", "ours/torch.save", "ours durable s", "DCP durable s", "torch.save+fsync s",
             "staged s", "slowdown ungated", "allreduce-gated", "step-gated (default)", "nice19", "DCP")]
    for r in results:
        s = r["step"]
        rows.append((str(r["ranks"]), f"{r['state_bytes'] / 1e6:.0f}", _fmt_ms(r["floor_copy_s"]),
                     _fmt_ms(r["ours_blocking_s"]), _fmt_ms(r["ours_first_blocking_s"]),
                     _fmt_ms(r["torch_save_blocking_s"]), _fmt_ms(r["dcp_blocking_s"]),
                     f"{r['ours_over_floor_median']:.2f}",
                     f"{r['ours_blocking_s'] / r['torch_save_blocking_s']:.3f}",
                     f"{r['ours_durable_s']:.3f}", f"{r['dcp_durable_s']:.3f}", f"{r['torch_save_durable_s']:.3f}",
                     f"{r['ours_staged_s']:.3f}" if "ours_staged_s" in r else "-",
                     *(_fmt_pct(s.get(v, {}).get("slowdown"))
                       for v in ("ungated", "allreduce-gated", "step-gated", "nice19", "dcp"))))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows)


# the figures the summary gives per rank count: name -> how to read it from one run's result
FIGURES = {
    "ours blocking ms": lambda r: r["ours_blocking_s"] * 1e3,
    "ours durable s": lambda r: r["ours_durable_s"],
    "DCP durable s": lambda r: r["dcp_durable_s"],
    "durable / DCP": lambda r: r["ours_durable_s"] / r["dcp_durable_s"],
    "direct durable s": lambda r: r.get("write_paths", {}).get("direct", {}).get("durable_s"),
    "buffered durable s": lambda r: r.get("write_paths", {}).get("buffered", {}).get("durable_s"),
    "step-gated slowdown %": lambda r: _pct(r["step"].get("step-gated", {}).get("slowdown")),
    "DCP slowdown %": lambda r: _pct(r["step"].get("dcp", {}).get("slowdown")),
}


def _pct(x):
    return None if x is None else x * 100


def summary(results: list[dict]) -> dict:
    """Per rank count and figure: the median over repeats, its range and the values."""
    out: dict = {}
    for n in sorted({r["ranks"] for r in results}):
        runs = [r for r in results if r["ranks"] == n]
        row = {}
        for name, read in FIGURES.items():
            values = [v for v in (read(r) for r in runs) if v is not None]
            if values:
                row[name] = {"median": statistics.median(values), "min": min(values), "max": max(values),
                             "values": values}
        out[str(n)] = row
    return out


def summary_table(summ: dict) -> str:
    """Medians over repeats, with their ranges, per rank count."""
    names = [k for k in FIGURES if any(k in row for row in summ.values())]
    rows = [("ranks", "runs", *names)]
    for n, row in summ.items():
        runs = max((len(v["values"]) for v in row.values()), default=0)
        cells = []
        for k in names:
            v = row.get(k)
            digits = 0 if k.endswith("ms") else 1 if k.endswith("%") else 3 if k.endswith("s") else 2
            d = digits
            cells.append("-" if v is None else f"{v['median']:.{d}f} [{v['min']:.{d}f}, {v['max']:.{d}f}]")
        rows.append((n, str(runs), *cells))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small state, fewer repeats (a smoke run)")
    p.add_argument("--ranks", default="1,2,4", help="rank counts to run (default 1,2,4)")
    p.add_argument("--mb", type=float, help="state size in MB (default 200; --quick 40)")
    p.add_argument("--reps", type=int, help="repeats per measurement (default 7; --quick 2)")
    p.add_argument("--saves", type=int, help="saves per step-slowdown variant (default 4; --quick 1)")
    p.add_argument("--quiet-steps", type=int, default=2, help="steps without a save in flight between saves")
    p.add_argument("--batch", type=int, default=32, help="training batch per rank")
    p.add_argument("--dir", default=os.path.join(OUT, "ckpt-bench"), help="where checkpoints are written")
    p.add_argument("--no-staging", action="store_true", help="skip the /dev/shm staging measurement")
    p.add_argument("--no-paths", action="store_true",
                   help="skip the O_DIRECT against buffered comparison with per-phase timing")
    p.add_argument("--repeat", type=int, default=1,
                   help="run every rank count this many times (interleaved) and report medians with ranges")
    p.add_argument("--out", default=os.path.join(OUT, "bench_checkpoint.json"), help="JSON result file")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.mb = args.mb or (40 if args.quick else 200)
    args.reps = args.reps or (2 if args.quick else 7)
    args.saves = args.saves or (1 if args.quick else 4)
    if args.worker:
        worker(args)
        return 0

    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    results = []
    started = time.time()
    for rep, n in [(r, int(x)) for r in range(args.repeat) for x in args.ranks.split(",")]:
        root = os.path.join(args.dir, f"n{n}")
        os.makedirs(root, exist_ok=True)
        fd, wout = tempfile.mkstemp(prefix="bench-ckpt-", suffix=".json")
        os.close(fd)
        cmd = ["mpiexec", "-n", str(n), sys.executable, os.path.abspath(__file__), "--worker", "--worker-out", wout,
               "--mb", str(args.mb), "--reps", str(args.reps), "--saves", str(args.saves),
               "--quiet-steps", str(args.quiet_steps), "--batch", str(args.batch), "--dir", root]
        if args.no_staging:
            cmd.append("--no-staging")
        if args.no_paths:
            cmd.append("--no-paths")
        # One core's worth of threads per rank (2 at 1 rank here), and sleeping rather than spinning
        # OpenMP waits: other jobs share this machine, and a spinning thread that loses its core
        # stretches a step several-fold at random.
        repo = os.path.dirname(HERE)  # this checkout's hpcstagger for the workers
        env = dict(os.environ,
                   OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n))),
                   OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
                   PYTHONPATH=os.pathsep.join(
                       [repo] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
        print(f"running ({rep + 1} of {args.repeat}): {' '.join(cmd)}", file=sys.stderr, flush=True)
        try:
            subprocess.run(cmd, check=True, env=env, timeout=1800)
            with open(wout) as f:
                results.append(dict(json.load(f), repeat=rep))
        finally:
            os.unlink(wout)
            shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(args.dir, ignore_errors=True)
    doc = {"benchmark": "bench_checkpoint",
           "command": " ".join([os.path.relpath(__file__, os.getcwd())] + sys.argv[1:]),
           "date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "host": platform.node(), "cpus": os.cpu_count(),
           "load_avg_at_end": os.getloadavg(), "wall_s": time.time() - started, "quick": args.quick,
           "repeat": args.repeat, "results": results, "summary": summary(results)}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(table(results))
    print()
    print(summary_table(doc["summary"]))
    print(f"\nwrote {args.out} in {doc['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
