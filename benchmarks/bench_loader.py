"""The shared loader: co-located prep-bound jobs on one node, one prep instead of one per job.

Results: benchmarks/RESULTS.md, section Shared loader.

    python benchmarks/bench_loader.py [--quick] [--workers 2] [--batches 150] [--repeat 3] [--out PATH]

Every consumer is a separate process training the way such a job is usually written: a map-style
Dataset whose ``__getitem__`` decodes and augments one 3x64x64 image on the CPU (a delta-decode of
seeded bytes, a few rounds of depthwise blur, affine and sigmoid, a random crop and flip: a few ms
per sample, the same work for every sample), batched by a DataLoader, and a small CNN (pooling,
one conv, two linear layers; ``torch.set_num_threads(1)``) with an SGD step per batch. Training a
batch costs a few percent of preparing it: the table prints both, measured alone in one process.

Throughput: the consumers of a configuration start together (each imports torch and builds its
model, then all are released at once); each trains ``--warmup`` batches, then ``--batches``
measured ones, stamping the end of every step on the node's monotonic clock, and writes its own
JSON result. The aggregate rate is the batches of all consumers stamped in the window where all of
them are measuring (from the last consumer's end of warm-up to the first one's last measured
batch), over that window's length. Configurations, each against a baseline run in the same round:

- 1 consumer: ``SharedLoader(num_workers=W)`` against ``DataLoader(num_workers=W, shuffle=True)``;
- 2 consumers sharing one pipeline (W workers, in the producer) against 2 independent DataLoaders;
- 3 consumers sharing against 3 independent DataLoaders.

The independent DataLoaders get the same W workers in total, split as evenly as it goes, the first
consumers getting the remainder (W=2: 1+1 for 2 consumers, 1+1+0 for 3: the third prepares its
batches in its own process, as a DataLoader with ``num_workers=0`` does; its CPU is in the "a
consumer" column). The 1-consumer target "within 5%" counts as met when shared is at least 0.95x
the plain DataLoader (faster is no failure). Each of ``--repeat`` rounds runs every configuration
shared and independent, alternating which goes first; the table gives the medians and ranges of
the per-round ratios.

CPU accounting, over each consumer's measured batches: the CPU seconds of the configuration's
processes (consumers, their DataLoader workers, the producer and its workers, from /proc) per
batch, and the machine's busy cores (/proc/stat) minus ours: the cores other users took. Every
configuration saturates the cores, so where others take some of them the rates fall with it; the
"per core used" ratio (batches per second per core our processes used, shared over independent)
is the comparison with that load taken out. The consumers run in the benchmark's session, the
producer in its own (it calls setsid): with the kernel's autogroup scheduling, each session is one
scheduling group, so the preparing processes are one group in both variants.

Faults (shared, 3 consumers, ``HPCSTAGGER_LOADER_LINGER=1`` for every process of the benchmark):

(a) one consumer (the one that started the producer) is killed with SIGKILL mid-epoch; the other two
    run 2 full epochs, and every epoch must hold every sample index exactly once (lost, duplicated);
(b) the producer is killed with SIGKILL: the time from the kill to each consumer's LoaderError;
(c) after every case (the throughput runs included), ``loader_linger`` + 1.5 s after the last
    consumer closed its loader, the shm root's ``.loader`` directory is listed: nothing may be left;
    the processes of the producer's session (the producer and its DataLoader workers) must be gone
    too (the table also gives how soon after that close both were gone, polled every 50 ms).

Everything runs under a private root in /dev/shm, removed at the end. Results go to
benchmarks/out/bench_loader.json and tables on stdout.
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
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "out")
REPO = os.path.dirname(HERE)
LINGER = 1.0  # HPCSTAGGER_LOADER_LINGER for the benchmark's processes


# ------------------------------------------------------------------------------------ the job
class Decode:
    """A map-style dataset: sample ``i`` is ``(image float32 3x64x64, label, i)``, decoded and augmented
    from seeded bytes on every access; ``rounds`` sets the cost (about 0.2 ms each, plus ~1 ms)."""

    def __init__(self, n: int, rounds: int):
        self.n, self.rounds = n, rounds

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[Any, int, int]:
        import numpy as np
        import torch
        import torch.nn.functional as F

        rng = np.random.default_rng(i)
        raw = rng.integers(0, 256, size=(72, 72, 3), dtype=np.uint8)        # the stored, encoded sample
        img = np.cumsum(raw.astype(np.int32), axis=1).astype(np.uint8)      # "decode": delta decoding
        x = torch.from_numpy(img).permute(2, 0, 1).float().unsqueeze(0) / 255
        w = torch.tensor([[1., 2., 1.], [2., 4., 2.], [1., 2., 1.]]).div(16).expand(3, 1, 3, 3).contiguous()
        for _ in range(self.rounds):                                        # "augment": blur, jitter
            x = torch.sigmoid(F.conv2d(x, w, padding=1, groups=3) * 1.01 + 0.001)
        oy, ox = (int(v) for v in rng.integers(0, 9, size=2))              # random crop, flip
        x = x[:, :, oy:oy + 64, ox:ox + 64]
        if rng.random() < 0.5:
            x = x.flip(3)
        return ((x[0] - 0.5) / 0.25).contiguous(), i % 10, i


def _model() -> tuple[Any, Any]:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.AvgPool2d(4), torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Linear(512, 64),
                                torch.nn.ReLU(), torch.nn.Linear(64, 10))
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def _step(model: Any, opt: Any, x: Any, y: Any) -> None:
    import torch.nn.functional as F

    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()


def consumer_main(spec_path: str) -> int:
    """One consumer process: train on its loader as ``spec`` says and write its result file.

    ``stop``: "count" (warm-up + measured batches), "epochs" (that many whole epochs), "error" (until
    LoaderError, at most ``max_s``). ``mark_at``: after that many batches, write ``<out>.mark``."""
    spec = json.load(open(spec_path))
    import torch
    from torch.utils.data import DataLoader

    from hpcstagger._io import atomic_write_json
    from hpcstagger.errors import LoaderError

    torch.set_num_threads(1)
    ds = Decode(spec["n"], spec["rounds"])
    model, opt = _model()
    dev = spec.get("device")
    if dev:  # CUDA in use before the loader is built, as in a GPU job
        model.to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    res: dict[str, Any] = {"pid": os.getpid(), "shared": spec["shared"], "workers": spec["workers"]}
    atomic_write_json(spec["out"] + ".ready", {"pid": os.getpid()}, durable=False)
    while not os.path.exists(spec["go"]):
        time.sleep(0.002)
    time.sleep(spec.get("attach_delay", 0.0))
    if spec["shared"]:
        from hpcstagger.loader import SharedLoader

        loader = SharedLoader(ds, spec["batch"], name=spec["name"], num_workers=spec["workers"], root=spec["root"],
                              device=dev)
    else:
        loader = DataLoader(ds, batch_size=spec["batch"], shuffle=True, num_workers=spec["workers"],
                            generator=torch.Generator().manual_seed(spec["seed"]), pin_memory=bool(dev))
    stamps: list[float] = []
    train_s: list[float] = []
    waits: list[float] = []
    epochs: list[list[int]] = []
    total = spec.get("count", 0)
    deadline = time.monotonic() + spec.get("max_s", 600)
    t = time.monotonic()
    res["t_start"] = t
    try:
        done = False
        while not done:
            seen: list[int] = []
            epochs.append(seen)
            for x, y, idx in loader:
                got = time.monotonic()
                waits.append(got - t)
                if spec["shared"] and "producer_pid" not in res:
                    res["producer_pid"] = loader.producer_pid
                    from hpcstagger.loader import _ring  # the control file's words (private; for the report only)

                    res["spawner"] = int(loader._ctl.w[_ring.H_SPAWNER]) == os.getpid()
                    res["first_batch"] = loader.stats()["first_batch"]
                    res["producer_sid"] = _sid(res["producer_pid"])  # its session: it and its workers
                    atomic_write_json(spec["out"] + ".producer", res["producer_sid"], durable=False)
                if dev:
                    x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)  # no-ops when shared
                _step(model, opt, x, y)
                if dev:
                    torch.cuda.synchronize()
                t = time.monotonic()
                stamps.append(t)
                train_s.append(t - got)
                seen += idx.tolist()
                if len(stamps) in (spec.get("warmup", -1), total):
                    res.setdefault("cpu", []).append(_cpu_snapshot(res.get("producer_pid", 0)))
                if len(stamps) == spec.get("mark_at", -1):
                    atomic_write_json(spec["out"] + ".mark", {"producer_pid": res.get("producer_pid", 0),
                                                              "spawner": res.get("spawner")}, durable=False)
                if spec["stop"] == "count" and len(stamps) >= total or time.monotonic() > deadline:
                    done = True
                    break
            if spec["stop"] == "epochs" and len(epochs) >= spec["epochs"]:
                done = True
    except LoaderError as exc:
        res["error_at"] = time.monotonic()
        res["error"] = str(exc)
    if spec["shared"]:
        res["stats"] = loader.stats()
        if res.get("producer_pid"):
            res["producer_cpu_s"] = _cpu_s(res["producer_pid"])
        loader.close()
    res["t_closed"] = time.monotonic()
    res.update(stamps=stamps, train_s=train_s, wait_s=waits, epochs=epochs if spec["stop"] != "count" else [],
               cpu_s=sum(os.times()[:2]))
    atomic_write_json(spec["out"], res, durable=False)
    return 0


def _cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a live process (None if gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError):
        return None


def _tree_cpu_s(pid: int, *, self_too: bool = True) -> float:
    """CPU seconds of process ``pid`` (if ``self_too``) and its live descendants (DataLoader workers)."""
    total = (_cpu_s(pid) or 0.0) if self_too else 0.0
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(x) for x in f.read().split()]
    except OSError:
        kids = []
    return total + sum(_tree_cpu_s(k) for k in kids)


def _cpu_snapshot(producer: int) -> dict[str, float]:
    """This consumer's CPU seconds, and its loader's: the producer and its workers, or its own workers."""
    me = os.getpid()
    return {"self": _cpu_s(me) or 0.0, "producer": (_cpu_s(producer) or 0.0) if producer else 0.0,
            "loader": _tree_cpu_s(producer) if producer else _tree_cpu_s(me, self_too=False),
            "machine": _busy()[0] / os.sysconf("SC_CLK_TCK")}


# ----------------------------------------------------------------------------------- the bench
def _sid(pid: int) -> int:
    """The session of process ``pid`` (0 if gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[3])
    except (OSError, IndexError, ValueError):
        return 0


def _session(sid: int) -> list[int]:
    """Pids of the processes in session ``sid`` (a producer's middle process calls setsid: the producer
    and its workers are in it); none for 0 (kernel threads) and for this benchmark's own session."""
    pids: list[int] = []
    if sid <= 0 or sid == os.getsid(0):
        return pids
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] not in "ZX":
                pids.append(int(d))
    return pids


def _busy() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine, all CPUs."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v) - v[3] - v[4], sum(v)


class Bench:
    def __init__(self, args: argparse.Namespace, root: str, work: str):
        self.args, self.root, self.work = args, root, work
        self.runs = 0
        self.env = dict(os.environ, HPCSTAGGER_LOADER_LINGER=str(LINGER), OMP_NUM_THREADS="1",
                        PYTHONPATH=os.pathsep.join([REPO] + ([os.environ["PYTHONPATH"]]
                                                           if os.environ.get("PYTHONPATH") else [])))
        self.sessions: set[int] = set()  # of the producers this benchmark started

    def group(self, specs: list[dict[str, Any]], action: Any = None, timeout: float = 600) -> dict[str, Any]:
        """Start one consumer per spec, release them together, run ``action(procs, specs)``, collect."""
        self.runs += 1
        tag = f"r{self.runs}"
        go = os.path.join(self.work, tag + ".go")
        procs = []
        for k, spec in enumerate(specs):
            spec.update(go=go, out=os.path.join(self.work, f"{tag}.c{k}.json"), root=self.root,
                        name=f"bench{self.runs}", seed=1000 * self.runs + k)
            with open(spec["out"] + ".spec", "w") as f:
                json.dump(spec, f)
            log = open(spec["out"] + ".log", "w")
            cmd = [sys.executable, os.path.abspath(__file__), "--consumer", spec["out"] + ".spec"]
            procs.append(subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT))
            log.close()
        out: dict[str, Any] = {"n_consumers": len(specs), "load_avg": os.getloadavg()[0]}
        try:
            end = time.monotonic() + 180
            while not all(os.path.exists(s["out"] + ".ready") for s in specs):
                if time.monotonic() > end or any(p.poll() is not None for p in procs):
                    raise RuntimeError("a consumer did not start; see " + self.work)
                time.sleep(0.01)
            b0 = _busy()
            open(go, "w").close()
            if action is not None:
                out.update(action(procs, specs))
            end = time.monotonic() + timeout
            clean_at = None
            while any(p.poll() is None for p in procs):
                if clean_at is None:
                    clean_at = self.clean_at(specs, procs)
                if time.monotonic() > end:
                    out["error"] = f"consumers still running after {timeout:.0f} s; killed"
                    break
                time.sleep(0.05)
            b1 = _busy()
            out["run_cpu_busy"] = (b1[0] - b0[0]) / max(1, b1[1] - b0[1])  # from the release to the end
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        out["consumers"] = []
        for s, p in zip(specs, procs, strict=True):
            if os.path.exists(s["out"]):
                r = json.load(open(s["out"]))
                if r.get("producer_sid"):
                    self.sessions.add(r["producer_sid"])
            else:
                r = {"missing": True, "returncode": p.returncode, "log": open(s["out"] + ".log").read()[-2000:]}
            out["consumers"].append(r)
        out["leftover"] = self.leftover(out, specs, procs, clean_at)
        return out

    def clean_at(self, specs: list[dict[str, Any]], procs: list[subprocess.Popen]) -> float | None:
        """Now, if every consumer has closed its loader (or is gone) and neither the pipeline's files
        nor the processes of its producer's session are left; else None."""
        if not all(os.path.exists(s["out"]) or p.poll() is not None for s, p in zip(specs, procs, strict=True)):
            return None
        d = os.path.join(self.root, ".loader")
        if os.path.isdir(d) and os.listdir(d):
            return None
        sids = {json.load(open(s["out"] + ".producer")) for s in specs if os.path.exists(s["out"] + ".producer")}
        return None if any(_session(sid) for sid in sids) else time.monotonic()

    def leftover(self, out: dict[str, Any], specs: list[dict[str, Any]], procs: list[subprocess.Popen],
                 clean_at: float | None) -> dict[str, Any]:
        """(c): the .loader listing loader_linger + 1.5 s after the last consumer closed its loader, and
        the producer's session: its processes then, after 15 s, and when both were first gone."""
        closed = [r["t_closed"] for r in out["consumers"] if "t_closed" in r]
        t0 = max(closed) if closed else time.monotonic()
        while clean_at is None and time.monotonic() < t0 + LINGER + 1.5:
            clean_at = self.clean_at(specs, procs)
            time.sleep(0.05)
        time.sleep(max(0.0, t0 + LINGER + 1.5 - time.monotonic()))
        d = os.path.join(self.root, ".loader")
        files = sorted(os.listdir(d)) if os.path.isdir(d) else []
        sids = {r["producer_sid"] for r in out["consumers"] if r.get("producer_sid")}
        procs_left = sorted(p for s in sids for p in _session(s))
        left = procs_left
        while left and time.monotonic() - t0 < 15:
            time.sleep(0.1)
            left = sorted(p for s in sids for p in _session(s))
        for pid in left:  # ours (a producer this benchmark started, or its workers): never leave them
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return {"files": files, "processes_at_listing": procs_left, "processes_after_15s": left,
                "clean_after_s": None if clean_at is None else max(0.0, clean_at - t0)}

    # ---- throughput --------------------------------------------------------------------------
    def rate_run(self, k: int, shared: bool) -> dict[str, Any]:
        a = self.args
        n = a.batch * (a.warmup + a.batches + 16)
        # Shared: every consumer passes W (the one producer runs W workers); independent: W split.
        split = [a.workers] * k if shared else [a.workers // k + (1 if i < a.workers % k else 0) for i in range(k)]
        specs = [{"device": a.device, "shared": shared, "workers": split[i], "n": n, "rounds": a.rounds,
                  "batch": a.batch, "stop": "count", "count": a.warmup + a.batches, "warmup": a.warmup}
                 for i in range(k)]
        out = self.group(specs)
        out.update(shared=shared, split=None if shared else split)
        cons = out["consumers"]
        if any("stamps" not in c or len(c["stamps"]) < a.warmup + a.batches for c in cons):
            out["error"] = "a consumer ended early: " + json.dumps([c.get("error") or c.get("log") for c in cons])
            return out
        lo = max(c["stamps"][a.warmup - 1] for c in cons)
        hi = min(c["stamps"][-1] for c in cons)
        if hi > lo:
            count = sum(sum(1 for t in c["stamps"] if lo < t <= hi) for c in cons)
            out["rate"] = count / (hi - lo)
            out["window_s"] = hi - lo
        out["sum_rates"] = sum(a.batches / (c["stamps"][-1] - c["stamps"][a.warmup - 1]) for c in cons)
        out.setdefault("rate", out["sum_rates"])
        out["window_batches"] = count if hi > lo else k * a.batches
        out["train_ms"] = statistics.median(x for c in cons for x in c["train_s"][a.warmup:]) * 1e3
        meas = [(sum(c["wait_s"][a.warmup:]), c["stamps"][-1] - c["stamps"][a.warmup - 1]) for c in cons]
        out["wait_frac"] = statistics.fmean(w / s for w, s in meas)
        # CPU per batch, all of the configuration's processes, over each consumer's measured batches
        # (the producer's, shared by all consumers, counted once: from the first consumer)
        own = sum(c["cpu"][1]["self"] - c["cpu"][0]["self"] for c in cons)
        loaders = [c["cpu"][1]["loader"] - c["cpu"][0]["loader"] for c in cons]
        out["cpu_ms_per_batch"] = (own + (loaders[0] if shared else sum(loaders))) / (k * a.batches) * 1e3
        out["consumer_cpu_ms_per_batch"] = own / (k * a.batches) * 1e3
        if shared:
            c = cons[0]
            out["producer_main_cpu_ms_per_batch"] = (c["cpu"][1]["producer"] - c["cpu"][0]["producer"]) \
                / a.batches * 1e3
        # Cores busy over the measured batches: the machine's (/proc/stat, in the first consumer's
        # window), ours (each consumer's processes over its own window), and the rest: other users.
        spans = [c["stamps"][-1] - c["stamps"][a.warmup - 1] for c in cons]
        d = [{key: c["cpu"][1][key] - c["cpu"][0][key] for key in c["cpu"][0]} for c in cons]
        ours = sum(x["self"] / span for x, span in zip(d, spans, strict=True))
        ours += d[0]["loader"] / spans[0] if shared else sum(x["loader"] / sp for x, sp in zip(d, spans, strict=True))
        out["cores_busy"] = d[0]["machine"] / spans[0]
        out["cores_ours"] = ours
        out["cores_other"] = max(0.0, out["cores_busy"] - ours)
        out["rate_per_core"] = out["rate"] / ours  # batches per second per core our processes used
        return out

    # ---- faults --------------------------------------------------------------------------------
    def kill_consumer(self) -> dict[str, Any]:
        """(a): 3 consumers, 2 epochs each; consumer 0 attaches first (it starts the producer) and is
        killed once it has taken ``kill_at`` batches and the others one each."""
        a = self.args
        epoch = 48
        kill_at = 12
        specs = [{"device": a.device, "shared": True, "workers": a.workers, "n": a.batch * epoch, "rounds": a.rounds,
                  "batch": a.batch, "stop": "epochs", "epochs": 2, "mark_at": kill_at if i == 0 else 1,
                  "attach_delay": 0.0 if i == 0 else 0.3} for i in range(3)]

        def action(procs: list[subprocess.Popen], specs: list[dict[str, Any]]) -> dict[str, Any]:
            end = time.monotonic() + 120
            while not all(os.path.exists(s["out"] + ".mark") for s in specs) and time.monotonic() < end:
                time.sleep(0.005)
            t = time.monotonic()
            procs[0].send_signal(signal.SIGKILL)
            mark = specs[0]["out"] + ".mark"
            return {"t_kill": t, "victim_spawned_producer": json.load(open(mark))["spawner"]
                    if os.path.exists(mark) else None}

        out = self.group(specs, action)
        samples = a.batch * epoch
        checks = []
        for c in out["consumers"][1:]:
            for e, seen in enumerate(c.get("epochs", [])):
                checks.append({"pid": c.get("pid"), "epoch": e, "seen": len(seen), "lost": samples - len(set(seen)),
                               "duplicated": len(seen) - len(set(seen)), "first_batch": c.get("first_batch")})
        out["checks"] = checks
        out["complete"] = all(len(c.get("epochs", [])) == 2 and not c.get("error") for c in out["consumers"][1:])
        for c in out["consumers"]:
            c.pop("epochs", None)
        return out

    def kill_producer(self) -> dict[str, Any]:
        """(b): 3 consumers train until LoaderError; the producer is killed once each took 10 batches."""
        a = self.args
        specs = [{"device": a.device, "shared": True, "workers": a.workers, "n": a.batch * 48, "rounds": a.rounds,
                  "batch": a.batch, "stop": "error", "max_s": 120, "mark_at": 10} for _ in range(3)]

        def action(procs: list[subprocess.Popen], specs: list[dict[str, Any]]) -> dict[str, Any]:
            end = time.monotonic() + 120
            while not all(os.path.exists(s["out"] + ".mark") for s in specs) and time.monotonic() < end:
                time.sleep(0.005)
            if not all(os.path.exists(s["out"] + ".mark") for s in specs):
                return {"t_kill": time.monotonic(), "error": "the consumers did not all take 10 batches in 120 s"}
            pid = json.load(open(specs[0]["out"] + ".mark"))["producer_pid"]
            t = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            return {"t_kill": t, "killed_pid": pid}

        out = self.group(specs, action)
        out["detect_s"] = [c["error_at"] - out["t_kill"] if "error_at" in c else None for c in out["consumers"]]
        out["errors"] = [c.get("error") for c in out["consumers"]]
        for c in out["consumers"]:
            c.pop("epochs", None)
        return out


def calibrate(args: argparse.Namespace) -> dict[str, float]:
    """Prep and train ms per batch, each measured alone in this process with one thread."""
    import torch
    from torch.utils.data import default_collate

    torch.set_num_threads(1)
    ds = Decode(args.batch * 64, args.rounds)
    model, opt = _model()
    prep, train = [], []
    for b in range(8):
        t = time.perf_counter()
        x, y, _ = default_collate([ds[i] for i in range(b * args.batch, (b + 1) * args.batch)])
        prep.append(time.perf_counter() - t)
        for _ in range(5):
            t = time.perf_counter()
            _step(model, opt, x, y)
            train.append(time.perf_counter() - t)
    return {"prep_ms_per_batch": statistics.median(prep[1:]) * 1e3,
            "train_ms_per_batch": statistics.median(train[5:]) * 1e3}


def _med(xs: list[float]) -> dict[str, float] | None:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)} if xs else None


def summarize(args: argparse.Namespace, rates: list[dict[str, Any]], fa: dict, fb: dict) -> dict[str, Any]:
    targets = {1: 0.95, 2: 1.8, 3: 2.5}
    configs = {}
    for k in (1, 2, 3):
        rows = [r for r in rates if r["n_consumers"] == k]
        by_rep: dict[int, dict[bool, dict]] = {}
        for r in rows:
            by_rep.setdefault(r["rep"], {})[r["shared"]] = r
        ratios = [q[True]["rate"] / q[False]["rate"] for q in by_rep.values()
                  if q.get(True, {}).get("rate") and q.get(False, {}).get("rate")]
        per_core = [q[True]["rate_per_core"] / q[False]["rate_per_core"] for q in by_rep.values()
                    if q.get(True, {}).get("rate") and q.get(False, {}).get("rate")]
        configs[k] = {"ratio": _med(ratios), "ratios": ratios, "target": targets[k],
                      "per_core_ratio": _med(per_core), "per_core_ratios": per_core}
        for shared in (True, False):
            sel = [r for r in rows if r["shared"] is shared and r.get("rate")]
            configs[k]["shared" if shared else "independent"] = {
                "rate": _med([r["rate"] for r in sel]), "train_ms": _med([r["train_ms"] for r in sel]),
                "wait_frac": _med([r["wait_frac"] for r in sel]),
                "cpu_ms_per_batch": _med([r["cpu_ms_per_batch"] for r in sel]),
                "consumer_cpu_ms_per_batch": _med([r["consumer_cpu_ms_per_batch"] for r in sel]),
                "producer_main_cpu_ms_per_batch": _med([r["producer_main_cpu_ms_per_batch"] for r in sel
                                                        if "producer_main_cpu_ms_per_batch" in r]),
                "cores_other": _med([r["cores_other"] for r in sel]),
                "errors": [r["error"] for r in rows if r["shared"] is shared and r.get("error")]}
    checks = fa.get("checks", [])
    detect = [d for d in fb.get("detect_s", []) if d is not None]
    runs = rates + [fa, fb]
    left_files = [f for r in runs for f in r.get("leftover", {}).get("files", [])]
    left_procs = [p for r in runs for p in r.get("leftover", {}).get("processes_after_15s", [])]
    clean = [r.get("leftover", {}).get("clean_after_s") for r in runs]
    return {"configs": configs,
            "fault_kill_consumer": {"lost": sum(c["lost"] for c in checks),
                                    "duplicated": sum(c["duplicated"] for c in checks),
                                    "epochs_checked": len(checks), "complete": fa.get("complete"),
                                    "victim_spawned_producer": fa.get("victim_spawned_producer")},
            "fault_kill_producer": {"detect_s": fb.get("detect_s"), "max_s": max(detect) if detect else None,
                                    "raised": len(detect)},
            "leftover": {"files": left_files, "processes": left_procs,
                         "processes_at_listing": sum(len(r.get("leftover", {}).get("processes_at_listing", []))
                                                     for r in runs),
                         "cases": len(runs), "clean_after_s": clean}}


def tables(args: argparse.Namespace, cal: dict, s: dict) -> str:
    def rng(m: dict | None, fmt: str = "{:.2f}") -> str:
        if not m:
            return "-"
        return f"{fmt.format(m['median'])} ({fmt.format(m['min'])}-{fmt.format(m['max'])})"

    lines = [f"prep {cal['prep_ms_per_batch']:.1f} ms per batch of {args.batch}, train "
             f"{cal['train_ms_per_batch']:.2f} ms per batch (each alone, 1 thread): training is "
             f"{cal['train_ms_per_batch'] / cal['prep_ms_per_batch'] * 100:.1f}% of prep; W = {args.workers}, "
             f"{args.batches} measured batches per consumer after {args.warmup}, {args.repeat} round(s)", ""]
    def med(m: dict | None, fmt: str) -> str:
        return fmt.format(m["median"]) if m else "-"

    lines.append("medians over the rounds (range); train: wall ms of a step in the run; CPU per batch trained, "
                 "each consumer's own, the producer's main process per stream batch")
    rows = [("consumers", "variant", "batches/s, all consumers", "train ms", "consumer waiting",
             "CPU ms/batch: all processes", "a consumer", "producer main", "cores busy with others")]
    for k, c in s["configs"].items():
        for v in ("shared", "independent"):
            r = c[v]
            rows.append((str(k), v if v == "shared" else f"independent ({_split(args.workers, k)})",
                         rng(r["rate"], "{:.2f}"), med(r["train_ms"], "{:.2f}"), med(r["wait_frac"], "{:.0%}"),
                         med(r["cpu_ms_per_batch"], "{:.1f}"), med(r["consumer_cpu_ms_per_batch"], "{:.1f}"),
                         med(r["producer_main_cpu_ms_per_batch"], "{:.1f}"), rng(r["cores_other"], "{:.2f}")))
    lines += _fmt(rows) + [""]
    fa, fb, lo = s["fault_kill_consumer"], s["fault_kill_producer"], s["leftover"]
    rows = [("target", "figure", "met?", "per core used")]
    for k, c in s["configs"].items():
        want = f">= {c['target']}x (within 5%, or faster)" if k == 1 else f">= {c['target']}x"
        ok = c["ratio"] is not None and c["ratio"]["median"] >= c["target"]
        rows.append((f"{k} consumer(s): shared {want} independent", rng(c["ratio"], "{:.3f}") + "x",
                     "met" if ok else "not met", rng(c["per_core_ratio"], "{:.3f}") + "x"))
    ok = fa["epochs_checked"] == 4 and fa["lost"] == 0 and fa["duplicated"] == 0 and fa["complete"]
    rows.append(("(a) consumer SIGKILLed mid-epoch: survivors see each sample once per epoch",
                 f"lost {fa['lost']}, duplicated {fa['duplicated']} in {fa['epochs_checked']} epochs",
                 "met" if ok else "not met", ""))
    d = fb["detect_s"] or []
    ok = fb["raised"] == 3 and fb["max_s"] is not None and fb["max_s"] <= 5.0
    rows.append(("(b) producer SIGKILLed: LoaderError in every consumer <= 5 s",
                 ", ".join("-" if x is None else f"{x * 1e3:.0f} ms" for x in d) or "-", "met" if ok else "not met",
                 ""))
    ok = not lo["files"] and not lo["processes"]
    rows.append((f"(c) nothing left in .loader {LINGER + 1.5:g} s after each case ({lo['cases']} cases)",
                 f"{len(lo['files'])} files; processes: {lo['processes_at_listing']} at the listing, "
                 f"{len(lo['processes'])} after 15 s; clean after {_clean(lo['clean_after_s'])}",
                 "met" if ok else "not met", ""))
    return "\n".join(lines + _fmt(rows))


def _clean(xs: list[float | None]) -> str:
    done = [x for x in xs if x is not None]
    text = f"{min(done):.1f}-{max(done):.1f} s" if done else "-"
    return text + (f" ({len(xs) - len(done)} never)" if len(done) < len(xs) else "")


def _split(w: int, k: int) -> str:
    return "+".join(str(w // k + (1 if i < w % k else 0)) for i in range(k))


def _fmt(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]


def _commit() -> str | None:
    try:
        head = subprocess.run(["git", "-C", REPO, "log", "-1", "--format=%h"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--", "hpcstagger"],
                               capture_output=True, text=True).stdout.strip()
        return head + ("+dirty (hpcstagger/)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="few batches, 1 round (a smoke run)")
    p.add_argument("--workers", type=int, default=2, help="W: DataLoader workers in total per configuration")
    p.add_argument("--batches", type=int, help="measured batches per consumer (default 150; --quick 20)")
    p.add_argument("--warmup", type=int, help="batches per consumer before measuring (default 5; --quick 3)")
    p.add_argument("--repeat", type=int, help="rounds of every configuration (default 3; --quick 1)")
    p.add_argument("--batch", type=int, default=16, help="samples per batch")
    p.add_argument("--rounds", type=int, default=15, help="augment rounds per sample (its cost)")
    p.add_argument("--device", default=None,
                   help="train on this CUDA device: shared consumers take batches placed there once (device=), "
                        "independent ones copy from pinned memory (default: CPU)")
    p.add_argument("--out", default=os.path.join(OUT, "bench_loader.json"), help="JSON result file")
    p.add_argument("--consumer", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.consumer:
        return consumer_main(args.consumer)
    args.batches = args.batches or (20 if args.quick else 150)
    args.warmup = args.warmup or (3 if args.quick else 5)
    args.repeat = args.repeat or (1 if args.quick else 3)
    os.environ["HPCSTAGGER_LOADER_LINGER"] = str(LINGER)
    started = time.time()
    load_start = os.getloadavg()
    cal = calibrate(args)
    print(f"[bench_loader] prep {cal['prep_ms_per_batch']:.1f} ms/batch, train {cal['train_ms_per_batch']:.2f} "
          f"ms/batch; load {load_start[0]:.2f}", file=sys.stderr, flush=True)
    root = tempfile.mkdtemp(prefix="hpcstagger-bench-loader-", dir="/dev/shm")
    work = tempfile.mkdtemp(prefix="hpcstagger-bench-loader-")
    bench = Bench(args, root, work)
    rates: list[dict[str, Any]] = []
    try:
        for rep in range(args.repeat):
            for k in (1, 2, 3):
                for shared in ((True, False) if (rep + k) % 2 == 0 else (False, True)):
                    r = bench.rate_run(k, shared)
                    r["rep"] = rep
                    rates.append(r)
                    print(f"[bench_loader] round {rep} {k} consumer(s) {'shared' if shared else 'independent'}: "
                          f"{r.get('rate', 0):.2f} batches/s, train {r.get('train_ms', 0):.2f} ms, waiting "
                          f"{r.get('wait_frac', 0):.0%}, {r.get('cpu_ms_per_batch', 0):.1f} CPU ms/batch, cores "
                          f"busy {r.get('cores_busy', 0):.2f} (others {r.get('cores_other', 0):.2f}), load "
                          f"{r['load_avg']:.2f}{', ' + r['error'] if r.get('error') else ''}",
                          file=sys.stderr, flush=True)
                    for c in r["consumers"]:
                        c.pop("stamps", None)
                        c["train_s"] = c["wait_s"] = None
        fa = bench.kill_consumer()
        print(f"[bench_loader] (a) {fa['checks']}", file=sys.stderr, flush=True)
        fb = bench.kill_producer()
        print(f"[bench_loader] (b) detection {fb['detect_s']}", file=sys.stderr, flush=True)
        for r in (fa, fb):
            for c in r["consumers"]:
                c.pop("stamps", None)
                c["train_s"] = c["wait_s"] = None
    finally:
        for sid in bench.sessions:  # normally long gone (checked after each case)
            for q in _session(sid):
                try:
                    os.kill(q, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    s = summarize(args, rates, fa, fb)
    doc = {"benchmark": "bench_loader", "command": " ".join([os.path.relpath(__file__, os.getcwd())] + sys.argv[1:]),
           "commit": _commit(), "date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "host": platform.node(),
           "cpus": os.cpu_count(), "load_avg_at_start": load_start, "load_avg_at_end": os.getloadavg(),
           "wall_s": time.time() - started, "args": {k: v for k, v in vars(args).items() if k != "consumer"},
           "linger_s": LINGER, "calibration": cal, "summary": s, "rate_runs": rates,
           "fault_kill_consumer": fa, "fault_kill_producer": fb}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(tables(args, cal, s))
    print(f"\nwrote {args.out} in {doc['wall_s']:.0f} s (load average {load_start[0]:.2f} at start, "
          f"{doc['load_avg_at_end'][0]:.2f} at end)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
