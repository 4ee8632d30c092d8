"""Where does the training lose time while a checkpoint save is in flight? (CPU only)

Results: benchmarks/RESULTS.md, section Checkpoints.

    python benchmarks/bench_ckpt_attrib.py [--quick] [--ranks 1,2,4] [--mb 200] [--rounds 6]
        [--gate auto|none|allreduce] [--switchinterval S] [--nice N] [--chunk-mb M] [--max-wait S]

For each rank count N it runs itself under ``mpiexec -n N`` with the DDP (gloo) training of
benchmarks/bench_checkpoint.py part (c) (same model, batches and OMP settings) and, in each round,
a quiet window (``--quiet-steps`` steps, no save) followed by an in-flight window (an
AsyncCheckpointer save, then the steps that start until its writer is idle, retention included).
Each window records:

- per step, the training (main) thread: wall, ``time.thread_time``, schedstat (on-CPU and
  runnable-but-waiting seconds), user/system seconds, voluntary/involuntary context switches,
  minor faults; on rank 0 the peak of nr_dirty / nr_writeback (/proc/vmstat);
- per window, every thread of every rank (schedstat on-CPU seconds; the writer thread apart), the
  writer's steps timed by :mod:`hpcstagger.checkpoint.probe` (pwrite, fsync, hash, h5py structure,
  collectives, commit, prune: calls, wall, CPU), the Pacer's gate waits and polls; on rank 0 the
  machine: /proc/stat by category, the kernel threads' CPU by kind, /proc/vmstat counters.

Attribution (an identity, core-seconds): over a window of wall W on C cores, C*W = CPU used by the
ranks' training threads + their writer threads + their other threads + kernel threads + everything
else (other processes, interrupts, steal) + idle. Against the same number of quiet steps (each
category scaled from the round's quiet window), C * lost time = the sum of every category's extra,
so each category's extra / C is its share of the lost wall time (idle is negative when the save ran
on cores the training left idle, positive when the training stalled: GIL, peers). Results (pooled
over rounds) go to benchmarks/out/bench_ckpt_attrib.json and a table on stdout.
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
sys.path.insert(0, HERE)
import procstat  # noqa: E402  (benchmarks/procstat.py)

OUT = os.path.join(HERE, "out")
PROBED = ("pwrite", "pwrite_direct", "hash", "h5_structure", "fsync", "pread", "publish", "commit", "collectives",
          "prune")
VM_COUNTERS = ("pgpgout", "nr_dirtied", "nr_written", "pgscan_kswapd", "pgscan_direct", "pgsteal_kswapd",
               "pgsteal_direct", "allocstall_normal", "pgfault", "pgmajfault", "pgfree")
MAIN_KEYS = ("wall", "thread_time", "oncpu", "rundelay", "utime", "stime", "vol", "invol", "minflt")


# ---------------------------------------------------------------------------------------- worker
class _Run:
    """The training, its checkpointer and the readings of one rank."""

    def __init__(self, args: argparse.Namespace):
        import threading

        import torch
        import torch.distributed as dist

        from bench_checkpoint import _batch, _model
        from hpcstagger.checkpoint import ActivityGate, AsyncCheckpointer, probe
        from hpcstagger.comm import Comm
        from hpcstagger.integrations.torch_ddp import gated_allreduce_hook, init_process_group

        self.args, self.dist, self.torch, self.batch = args, dist, torch, _batch
        self.comm = Comm.world()
        self.rank = self.comm.rank
        init_process_group(self.comm, timeout=600)
        self.model = _model(args.mb)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.ddp = torch.nn.parallel.DistributedDataParallel(self.model)
        ar_gate = ActivityGate()
        self.ddp.register_comm_hook(None, gated_allreduce_hook(ar_gate))
        self.flag = torch.zeros(1)
        self.main_tid = threading.get_native_id()
        self.step_no = 0
        self.train_step()  # Adam state exists from here on
        self.state = {"model": self.model, "optimizer": self.opt, "step": 0}
        gate = {"none": None, "auto": "auto", "allreduce": ar_gate}[args.gate]
        self.ck = AsyncCheckpointer(os.path.join(args.dir, "ours"), comm=self.comm, keep=1, gate=gate)
        self.ck.prepare(self.state)
        self.writer_tid = self.ck._worker.thread.native_id  # (no public handle on the writer thread)
        self.probe = probe

    def train_step(self) -> float:
        x, y = self.batch(self.step_no, self.rank, self.args.batch)
        self.step_no += 1
        t = time.perf_counter()
        self.opt.zero_grad(set_to_none=False)
        self.torch.nn.functional.mse_loss(self.ddp(x), y).backward()
        self.opt.step()
        return time.perf_counter() - t

    def main_reading(self) -> dict:
        r = procstat.thread(self.main_tid)
        r["wall"], r["thread_time"] = time.perf_counter(), time.thread_time()
        return r

    def snapshot(self) -> dict:
        snap = {"threads": procstat.own_threads(), "probe": self.probe.totals(), "t": time.perf_counter()}
        if self.rank == 0:
            snap["machine"] = procstat.machine()
        return snap

    def window(self, more, start=None) -> dict:
        """Run ``start()`` (the save; timed apart as ``save_main``), then train while ``more()``
        (rank 0's answer, broadcast) is true; the window's readings."""
        s0 = self.snapshot()  # before the save, so that no writer work is missed
        head = {}
        if start is not None:
            a = self.main_reading()
            head = start()
            b = self.main_reading()
            head["save_main"] = {k: b[k] - a[k] for k in MAIN_KEYS}
        steps, peak = [], [0, 0]
        while True:
            self.flag[0] = 1.0 if more() else 0.0
            self.dist.broadcast(self.flag, 0)
            if self.flag[0] == 0.0:
                break
            a = self.main_reading()
            train = self.train_step()
            b = self.main_reading()
            row = {k: b[k] - a[k] for k in MAIN_KEYS}
            row["train_step"] = train
            steps.append(row)
            if self.rank == 0:
                peak = [max(p, g) for p, g in zip(peak, procstat.vm_gauges(), strict=True)]
        return {"steps": steps, "peak_dirty_writeback_pages": peak, **head, **_window_deltas(s0, self.snapshot(), self)}

    def round(self) -> dict:
        n = self.args.quiet_steps
        count = iter(range(n))
        quiet = self.window(lambda: next(count, None) is not None)
        self.state["step"] = self.step_no
        handles = []

        def save() -> dict:
            handles.append(self.ck.save(self.step_no, self.state))
            return {}

        busy = self.window(lambda: not self.ck.idle(), start=save)
        handles[0].wait()
        busy["pacer"] = dict(handles[0].stats)
        return {"quiet": quiet, "busy": busy}


def _window_deltas(s0: dict, s1: dict, run: _Run) -> dict:
    """CPU seconds of this rank's threads (main / writer / other), its probe totals and, on rank 0,
    the machine's, between two snapshots."""
    cpu = {"main": 0.0, "writer": 0.0, "other_threads": 0.0}
    for tid, t in s1["threads"].items():
        on = t["oncpu"] - s0["threads"].get(tid, {}).get("oncpu", 0.0)
        kind = "main" if tid == run.main_tid else "writer" if tid == run.writer_tid else "other_threads"
        cpu[kind] += on
    p0 = s0["probe"]
    probe = {k: {f: v[f] - p0.get(k, {}).get(f, 0) for f in v} for k, v in s1["probe"].items()}
    out = {"wall": s1["t"] - s0["t"], "cpu": cpu, "probe": probe}
    if "machine" in s1:
        m0, m1 = s0["machine"], s1["machine"]
        out["machine_cpu"] = {k: m1["cpu"][k] - m0["cpu"][k] for k in m1["cpu"]}
        out["kthreads"] = {k: m1["kthreads"][k] - m0["kthreads"][k] for k in m1["kthreads"]}
        out["vm"] = {k: m1["vm"].get(k, 0) - m0["vm"].get(k, 0) for k in VM_COUNTERS}
    return out


def worker(args: argparse.Namespace) -> None:
    from hpcstagger import config
    from hpcstagger.integrations.torch_ddp import destroy_process_group

    if args.switchinterval:
        sys.setswitchinterval(args.switchinterval)
    knobs = {"ckpt_writer_nice": args.nice}
    if args.chunk_mb:
        knobs["ckpt_chunk_bytes"] = int(args.chunk_mb * (1 << 20))
    if args.max_wait is not None:
        knobs["ckpt_gate_max_wait"] = args.max_wait
    with config.override(**knobs):
        run = _Run(args)
        run.probe.enable()
        run.round()  # warm-up: first file creation, page cache, buffers
        rounds = [run.round() for _ in range(args.rounds)]
        run.ck.close()
    every = run.comm.gather(rounds)
    destroy_process_group(run.comm)
    if run.rank == 0:
        res = {"ranks": run.comm.size, "cores": len(os.sched_getaffinity(0)), "cpus_in_proc_stat": os.cpu_count(),
               "state_mb": args.mb, "settings": _settings(args), "rounds": every}
        res["attribution"] = attribute(every, os.cpu_count() or 1)
        with open(args.worker_out, "w") as f:
            json.dump(res, f)


def _settings(args: argparse.Namespace) -> dict:
    return {"gate": args.gate, "switchinterval": args.switchinterval or sys.getswitchinterval(), "nice": args.nice,
            "chunk_mb": args.chunk_mb, "max_wait": args.max_wait, "quiet_steps": args.quiet_steps,
            "batch": args.batch, "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}


# ------------------------------------------------------------------------------------ attribution
def buckets(ranks: list[dict], cores: int) -> dict[str, float]:
    """One window's CPU seconds by category, summed over ranks (``ranks``: each rank's window;
    rank 0's carries the machine readings). The categories sum to the machine's CPU time, less the
    save() call: its main threads' CPU comes off theirs, the rest of cores x its wall off idle."""
    m = ranks[0]
    total = sum(m["machine_cpu"].values())
    in_save = sum(r.get("save_main", {}).get("oncpu", 0.0) for r in ranks)
    total -= cores * m.get("save_main", {}).get("wall", 0.0)
    out = {"training main threads": sum(r["cpu"]["main"] for r in ranks) - in_save,
           "training other threads (OMP, gloo, MPI)": sum(r["cpu"]["other_threads"] for r in ranks)}
    writer = sum(r["cpu"]["writer"] for r in ranks)
    probed = 0.0
    for name in PROBED:
        c = sum(r["probe"].get(name, {}).get("cpu_s", 0.0) for r in ranks)
        out[f"writer: {name}"] = c
        probed += c
    out["writer: rest (Python, gate, queue)"] = writer - probed
    for kind, v in m["kthreads"].items():
        out[f"kernel threads: {kind}"] = v
    out["idle (+iowait)"] = m["machine_cpu"]["idle"] + m["machine_cpu"]["iowait"] \
        - (cores * m.get("save_main", {}).get("wall", 0.0) - in_save)
    out["other processes, interrupts, steal"] = total - sum(out.values())
    return out


def attribute(every: list[list[dict]], cores: int) -> dict:
    """Pool the rounds: each category's extra CPU seconds in flight over the same number of quiet
    steps, as seconds of lost training time (extra / cores) and as a share of the lost time."""
    extra: dict[str, float] = {}
    lost = base = 0.0
    per_round, main = [], {"quiet": {k: 0.0 for k in MAIN_KEYS}, "busy": {k: 0.0 for k in MAIN_KEYS}}
    nq = nb = 0
    load = {"other": 0.0, "idle": 0.0, "wall": 0.0}
    for i in range(len(every[0])):
        q = [rk[i]["quiet"] for rk in every]
        b = [rk[i]["busy"] for rk in every]
        n_q, n_b = len(q[0]["steps"]), len(b[0]["steps"])
        if not n_b or not n_q:
            continue
        scale = n_b / n_q
        bq, bb = buckets(q, cores), buckets(b, cores)
        load["other"] += bq["other processes, interrupts, steal"]
        load["idle"] += bq["idle (+iowait)"]
        load["wall"] += q[0]["wall"]
        for k in bb:
            extra[k] = extra.get(k, 0.0) + bb[k] - bq[k] * scale
        wall_b = b[0]["wall"] - b[0]["save_main"]["wall"]  # the steps in flight, not the save() call
        lost += wall_b - q[0]["wall"] * scale
        base += q[0]["wall"] * scale
        per_round.append(wall_b / n_b / (q[0]["wall"] / n_q) - 1)
        for w, key in ((q, "quiet"), (b, "busy")):
            for r in w:
                for s in r["steps"]:
                    for k in MAIN_KEYS:
                        main[key][k] += s[k] / len(w)
        nq, nb = nq + n_q, nb + n_b
    if not per_round:
        return {"error": "no save stayed in flight for a step"}
    total_extra = sum(extra.values())
    rows = {k: {"extra_cpu_s": v, "lost_s": v / cores, "share": v / total_extra if total_extra else None}
            for k, v in extra.items()}
    per_step = {w: {k: v / (nq if w == "quiet" else nb) for k, v in d.items()} for w, d in main.items()}
    return {"lost_s": lost, "lost_over_base": lost / base, "slowdown_per_round": per_round,
            "slowdown_median": statistics.median(per_round), "closure": total_extra / (cores * lost) if lost else None,
            "rows": rows, "main_thread_per_step": per_step, "quiet_steps": nq, "inflight_steps": nb,
            "load_in_quiet_cores": {"other": load["other"] / load["wall"], "idle": load["idle"] / load["wall"]}}


# ---------------------------------------------------------------------------------- orchestrator
def _pooled_probe(r: dict) -> dict:
    out: dict[str, dict] = {}
    for rk in r["rounds"]:
        for rnd in rk:
            for k, v in rnd["busy"]["probe"].items():
                row = out.setdefault(k, {"calls": 0, "wall_s": 0.0, "cpu_s": 0.0, "bytes": 0})
                for f in row:
                    row[f] += v[f]
    return out


def table(r: dict) -> str:
    a = r["attribution"]
    if "error" in a:
        return f"{r['ranks']} rank(s): {a['error']}"
    nsaves = len(r["rounds"][0])
    lines = [f"== {r['ranks']} rank(s), {r['state_mb']:.0f} MB, settings {r['settings']}",
             f"slowdown in flight: median {a['slowdown_median']:+.1%} over {nsaves} rounds "
             f"(per round {', '.join(f'{x:+.0%}' for x in a['slowdown_per_round'])}); lost "
             f"{a['lost_s'] / nsaves:.3f} s of training per save (pooled {a['lost_over_base']:+.1%}); "
             f"categories sum to {a['closure']:.2f} x the lost time (1.00 = identity closes)",
             f"{'cause (extra over the same quiet steps)':44s} {'core-s/save':>11s} {'lost s/save':>11s} {'share':>7s}"]
    rows = sorted(a["rows"].items(), key=lambda kv: -abs(kv[1]["extra_cpu_s"]))
    for k, v in rows:
        share = "-" if v["share"] is None else f"{v['share']:+.0%}"
        lines.append(f"{k:44s} {v['extra_cpu_s'] / nsaves:11.3f} {v['lost_s'] / nsaves:11.3f} {share:>7s}")
    groups: dict[str, float] = {}
    for k, v in a["rows"].items():
        g = k.split(":")[0] if ":" in k else k
        groups[g] = groups.get(g, 0.0) + v["lost_s"] / nsaves
    lines.append("grouped, lost s/save: " + ", ".join(f"{g} {v:+.3f}" for g, v in groups.items()))
    ld = a["load_in_quiet_cores"]
    lines.append(f"quiet windows: other processes used {ld['other']:.2f} cores, idle {ld['idle']:.2f} cores "
                 f"(of {r['cpus_in_proc_stat']}): noise on a shared machine shows up in the first")
    lines.append("training main thread, per step (mean over ranks):  quiet -> in flight")
    mq, mb = a["main_thread_per_step"]["quiet"], a["main_thread_per_step"]["busy"]
    for k in MAIN_KEYS:
        unit = 1e3 if k in ("wall", "thread_time", "oncpu", "rundelay", "utime", "stime") else 1
        lines.append(f"  {k:14s} {mq[k] * unit:10.2f} -> {mb[k] * unit:10.2f}" + (" ms" if unit > 1 else ""))
    blocked = [(m["wall"] - m["oncpu"] - m["rundelay"]) * 1e3 for m in (mq, mb)]
    lines.append(f"  {'blocked':14s} {blocked[0]:10.2f} -> {blocked[1]:10.2f} ms (GIL, peers, OMP barriers)")
    lines.append("writer steps in flight, all ranks, per save:  calls  wall s  cpu s  MB")
    for k, v in sorted(_pooled_probe(r).items()):
        lines.append(f"  {k:14s} {v['calls'] / nsaves:7.1f} {v['wall_s'] / nsaves:7.3f} {v['cpu_s'] / nsaves:6.3f} "
                     f"{v['bytes'] / nsaves / 1e6:6.1f}")
    pac = [rnd["busy"]["pacer"] for rk in r["rounds"] for rnd in rk]
    vm = [rnd["busy"]["vm"] for rnd in r["rounds"][0]]
    lines.append(f"gate per save and rank: waits {statistics.fmean(p.get('gate_waits', 0) for p in pac):.1f}, "
                 f"polls {statistics.fmean(p.get('gate_polls', 0) for p in pac):.1f}, waited "
                 f"{statistics.fmean(p.get('gate_wait_s', 0) for p in pac):.3f} s, chunks "
                 f"{statistics.fmean(p.get('chunks', 0) for p in pac):.1f}; in flight per save: "
                 + ", ".join(f"{k} {statistics.fmean(v[k] for v in vm):.0f}" for k in ("pgpgout", "nr_written",
                                                                                    "pgscan_kswapd", "pgscan_direct")))
    return "\n".join(lines)


def _env(n: int) -> dict:
    """bench_checkpoint.py's worker environment: one core's worth of threads per rank, passive OpenMP."""
    repo = os.path.dirname(HERE)
    return dict(os.environ,
                OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n))),
                OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
                PYTHONPATH=os.pathsep.join([repo] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH")
                                                     else [])))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="40 MB state, 2 rounds (a smoke run)")
    p.add_argument("--ranks", default="1,2,4", help="rank counts to run (default 1,2,4)")
    p.add_argument("--mb", type=float, help="state size in MB (default 200; --quick 40)")
    p.add_argument("--rounds", type=int, help="measured saves (default 6; --quick 2), after one warm-up")
    p.add_argument("--quiet-steps", type=int, default=4, help="steps of each round's quiet window")
    p.add_argument("--batch", type=int, default=32, help="training batch per rank")
    p.add_argument("--gate", choices=("auto", "none", "allreduce"), default="auto",
                   help="writer gate: auto (StepGate, the default), none, allreduce (DDP comm hook)")
    p.add_argument("--switchinterval", type=float, help="sys.setswitchinterval in the ranks (default 0.005)")
    p.add_argument("--nice", type=int, default=0, help="ckpt_writer_nice")
    p.add_argument("--chunk-mb", type=float, help="ckpt_chunk_bytes in MiB (default the knob's, 8)")
    p.add_argument("--max-wait", type=float, help="ckpt_gate_max_wait in seconds (default the knob's, 0.05)")
    p.add_argument("--dir", default=os.path.join(OUT, "ckpt-attrib"), help="where checkpoints are written")
    p.add_argument("--out", default=os.path.join(OUT, "bench_ckpt_attrib.json"), help="JSON result file")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    return p


def _forward(args: argparse.Namespace) -> list[str]:
    out = ["--mb", str(args.mb), "--rounds", str(args.rounds), "--quiet-steps", str(args.quiet_steps),
           "--batch", str(args.batch), "--gate", args.gate, "--nice", str(args.nice)]
    for flag, v in (("--switchinterval", args.switchinterval), ("--chunk-mb", args.chunk_mb),
                    ("--max-wait", args.max_wait)):
        if v is not None:
            out += [flag, str(v)]
    return out


def main() -> int:
    args = _parser().parse_args()
    args.mb = args.mb or (40 if args.quick else 200)
    args.rounds = args.rounds or (2 if args.quick else 6)
    if args.worker:
        worker(args)
        return 0
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or "mpiexec"
    results, started = [], time.time()
    for n in [int(x) for x in args.ranks.split(",")]:
        root = os.path.join(args.dir, f"n{n}")
        os.makedirs(root, exist_ok=True)
        fd, wout = tempfile.mkstemp(prefix="bench-attrib-", suffix=".json")
        os.close(fd)
        cmd = [mpiexec, "-n", str(n), sys.executable, os.path.abspath(__file__), "--worker", "--worker-out", wout,
               "--dir", root, *_forward(args)]
        print(f"running: {' '.join(cmd)}", file=sys.stderr, flush=True)
        try:
            subprocess.run(cmd, check=True, env=_env(n), timeout=1800)
            with open(wout) as f:
                results.append(json.load(f))
        finally:
            os.unlink(wout)
            shutil.rmtree(root, ignore_errors=True)
        print(table(results[-1]), flush=True)
    shutil.rmtree(args.dir, ignore_errors=True)
    command = " ".join([os.path.relpath(__file__, os.getcwd())] + sys.argv[1:])
    doc = {"benchmark": "bench_ckpt_attrib", "command": command,
           "date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "host": platform.node(), "cpus": os.cpu_count(),
           "load_avg_at_end": os.getloadavg(), "wall_s": time.time() - started, "quick": args.quick, "results": results}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"\nwrote {args.out} in {doc['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
