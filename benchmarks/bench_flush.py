"""Benchmark who flushes a staged checkpoint: the running job's own writer, or an idle process.

    python benchmarks/bench_flush.py [--quick] [--pin] [--mb 150] [--rounds 7] [--dir DIR]

A running "training" job (this process: an MLP with Adam whose state is about --mb MB, trained on
random batches, every step timed) saves with a /dev/shm staging level. Its step times are compared:

(a) with no save in flight (the steps just before each save, after the previous one was drained);
(b) while its own writer flushes the staged checkpoint to disk (``flush_by="self"``, today's default);
(c) while a separate idle process, standing in for a co-located job waiting out its delay, flushes
    it through the node's flush queue (``flush_by="queue"``; the other process calls
    :func:`hpcstagger.checkpoint.flusher.idle_flusher` in a loop as the waiting job's idle work does),
    with the flusher's copying thread at nice ``ckpt_flush_nice`` (19) and, for comparison, at nice 0.

The flush phase is from the moment the save is committed in /dev/shm until it is durable on disk;
a step belongs to it when it starts in it. The writing of the staged level comes first in every
variant and is not counted. A round runs every variant in turn (the order rotates each round), each
as: drain, --quiet-steps steps (a), a save, the steps until it is durable. A variant's in-flight
slowdown in a round is its mean flush-phase step over its mean quiet step, minus 1; the figure is
the median over rounds. Results go to benchmarks/out/bench_flush.json and a table on stdout; the
checkpoints go under --dir (default benchmarks/out/flush-bench) and /dev/shm, both removed afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "out")
REPO = os.path.dirname(HERE)
VARIANTS = ("self", "queue", "queue-nice0")  # (b), (c), and (c) with the flusher thread at nice 0


def flusher_main(root: str, stop: str, nice: int, cpu: int | None) -> int:
    """The waiting job: call the idle flusher until the file ``stop`` exists; print what it did."""
    from hpcstagger.checkpoint.flusher import idle_flusher

    if cpu is not None:
        os.sched_setaffinity(0, {cpu})

    flush = idle_flusher(root, nice=nice)
    try:
        while not os.path.exists(stop):
            flush(3600.0)
    finally:
        flush.close()
    print(json.dumps({"flushed": flush.flushed, "failed": flush.failed}), flush=True)
    return 0


def _model(mb: float):
    """An MLP whose parameters + Adam moments are about ``mb`` MB (3 x 4 bytes per parameter)."""
    import torch

    width = max(64, int((mb * 1e6 / 12 / 4) ** 0.5) // 64 * 64)  # four square layers
    torch.manual_seed(0)
    layers: list = []
    for _ in range(4):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1]), width


def _start_flushers(shm: str, stop: str, cpu: int | None) -> dict[str, subprocess.Popen]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO] + ([os.environ["PYTHONPATH"]]
                                                               if os.environ.get("PYTHONPATH") else [])))
    procs = {}
    for name, nice in (("queue", None), ("queue-nice0", 0)):
        cmd = [sys.executable, os.path.abspath(__file__), "--flusher", os.path.join(shm, name), "--stop", stop]
        if nice is not None:
            cmd += ["--nice", str(nice)]
        if cpu is not None:
            cmd += ["--cpu", str(cpu)]
        procs[name] = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    return procs


def run(args: argparse.Namespace, shm: str, root: str) -> dict:
    import torch

    from hpcstagger import AsyncCheckpointer

    torch.set_num_threads(args.threads)
    model, width = _model(args.mb)
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(args.batch, width, generator=g), torch.randn(args.batch, width, generator=g)

    def train_step() -> float:
        t = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        return time.perf_counter() - t

    train_step()
    state = {"model": model, "optimizer": opt, "step": 0}
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3
    cks = {}
    for name in VARIANTS:
        stage = os.path.join(shm, name)
        cks[name] = AsyncCheckpointer(os.path.join(root, name), staging_dir=stage, keep=1,
                                      flush_by="self" if name == "self" else "queue")
        cks[name].prepare(state)
    per: dict[str, dict[str, list]] = {n: {"ratios": [], "quiet": [], "flush": [], "flush_s": [], "by": []}
                                       for n in VARIANTS}
    step = 0
    for _ in range(3):
        train_step()
    for rnd in range(args.rounds):
        order = VARIANTS[rnd % len(VARIANTS):] + VARIANTS[:rnd % len(VARIANTS)]
        for name in order:
            ck = cks[name]
            ck.drain()
            quiet = [train_step() for _ in range(args.quiet_steps)]
            step += 1
            state["step"] = step
            h = ck.save(step, state)
            flush, t_staged = [], None
            while not h.done():
                staged = h.staged()
                if staged and t_staged is None:
                    t_staged = time.perf_counter()
                dt = train_step()
                if staged:
                    flush.append(dt)
            h.wait()
            t_done = time.perf_counter()
            v = per[name]
            v["quiet"] += quiet
            v["flush"] += flush
            v["flush_s"].append(t_done - t_staged if t_staged is not None else 0.0)
            v["by"].append(h.stats.get("flush", {}).get("by", "self"))
            if flush:
                v["ratios"].append(statistics.fmean(flush) / statistics.fmean(quiet) - 1)
            print(f"round {rnd} {name:12s} quiet {statistics.fmean(quiet) * 1e3:6.1f} ms, flush phase "
                  f"{len(flush):3d} steps {statistics.fmean(flush) * 1e3 if flush else 0:6.1f} ms, flush "
                  f"{v['flush_s'][-1]:.2f} s by {v['by'][-1]}", file=sys.stderr, flush=True)
    for ck in cks.values():
        ck.close()
    out = {}
    for name, v in per.items():
        out[name] = {"slowdown": statistics.median(v["ratios"]) if v["ratios"] else None,
                     "round_slowdowns": v["ratios"], "quiet_step_s": statistics.median(v["quiet"]),
                     "flush_step_s": statistics.median(v["flush"]) if v["flush"] else None,
                     "flush_steps": len(v["flush"]), "flush_s": statistics.median(v["flush_s"]),
                     "flushed_by": {b: v["by"].count(b) for b in set(v["by"])}}
    return {"state_bytes": nbytes, "threads": args.threads, "batch": args.batch, "rounds": args.rounds,
            "quiet_steps": args.quiet_steps, "variants": out}


def table(res: dict) -> str:
    rows = [("variant", "quiet step ms", "flush-phase step ms", "steps", "flush s", "in-flight slowdown",
             "flushed by")]
    for name, r in res["variants"].items():
        rows.append((name, f"{r['quiet_step_s'] * 1e3:.1f}",
                     "-" if r["flush_step_s"] is None else f"{r['flush_step_s'] * 1e3:.1f}", str(r["flush_steps"]),
                     f"{r['flush_s']:.2f}", "-" if r["slowdown"] is None else f"{r['slowdown'] * 100:+.1f}%",
                     ", ".join(f"{k} x{n}" for k, n in sorted(r["flushed_by"].items()))))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small state, few rounds (a smoke run)")
    p.add_argument("--mb", type=float, help="state size in MB (default 150; --quick 40)")
    p.add_argument("--rounds", type=int, help="rounds, each running every variant (default 7; --quick 2)")
    p.add_argument("--quiet-steps", type=int, default=5, help="steps without a save in flight before each save")
    p.add_argument("--batch", type=int, default=64, help="training batch")
    p.add_argument("--threads", type=int, help="torch threads of the training job (default: all cores; --pin 1)")
    p.add_argument("--pin", action="store_true",
                   help="bind the training job to core 0 and the flushers to core 1, as Slurm binds each "
                        "co-located job to its own cores (--cpu-bind); default: no binding")
    p.add_argument("--dir", default=os.path.join(OUT, "flush-bench"), help="where the durable checkpoints go")
    p.add_argument("--out", default=os.path.join(OUT, "bench_flush.json"), help="JSON result file")
    p.add_argument("--flusher", help=argparse.SUPPRESS)
    p.add_argument("--stop", help=argparse.SUPPRESS)
    p.add_argument("--nice", type=int, help=argparse.SUPPRESS)
    p.add_argument("--cpu", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.flusher:
        return flusher_main(args.flusher, args.stop, args.nice, args.cpu)
    cores = sorted(os.sched_getaffinity(0))
    if args.pin:
        if len(cores) < 2:
            p.error("--pin needs at least 2 cores")
        os.sched_setaffinity(0, {cores[0]})
    args.threads = args.threads or (1 if args.pin else os.cpu_count() or 1)
    args.mb = args.mb or (40 if args.quick else 150)
    args.rounds = args.rounds or (2 if args.quick else 7)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    started = time.time()
    load_start = os.getloadavg()
    shm = tempfile.mkdtemp(prefix="hpcstagger-bench-flush-", dir="/dev/shm")
    stop = os.path.join(shm, "stop")
    root = args.dir
    os.makedirs(root, exist_ok=True)
    procs = _start_flushers(shm, stop, cores[-1] if args.pin else None)
    try:
        res = run(args, shm, root)
        with open(stop, "w"):
            pass
        for name, proc in procs.items():
            out, _ = proc.communicate(timeout=60)
            res["variants"][name]["flusher_process"] = json.loads(out.strip().splitlines()[-1])
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(10)
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
    doc = {"benchmark": "bench_flush", "command": " ".join([os.path.relpath(__file__, os.getcwd())] + sys.argv[1:]),
           "date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "host": platform.node(), "cpus": os.cpu_count(),
           "load_avg_at_start": load_start, "load_avg_at_end": os.getloadavg(), "wall_s": time.time() - started,
           "quick": args.quick, "mb": args.mb, "pin": args.pin, "result": res}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(table(res))
    print(f"\nwrote {args.out} in {doc['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
