"""Benchmark the checkpointer's CUDA path on one GPU: AsyncCheckpointer against a pinned copy, torch.save
and DCP async_save.

    python benchmarks/bench_ckpt_gpu.py [--gb 1.2] [--rounds 5] [--batch 4096] [--dir /tmp] [--out FILE]
    python benchmarks/bench_ckpt_gpu.py --device cpu --gb 0.05 --rounds 1 --batch 64   # smoke run, no GPU

One process trains a stack of fp32 Linear layers on --device (default cuda:0) whose state
(parameters + Adam moments, 12 bytes a parameter) is about --gb GB, every step timed with
``torch.cuda.synchronize()``. It measures, repeating each measurement --rounds times (after one
warm-up round) and taking medians:

(a) blocking time of ``AsyncCheckpointer.save`` against the floor: a device-to-host copy of the whole
    state into preallocated pinned buffers (non-blocking copies, then one synchronize); also the
    blocking time of ``torch.save`` and of ``torch.distributed.checkpoint.async_save`` (no process
    group: single process; a gloo group of one process if this torch needs one). The GPU is idle
    when each timed call starts. The ratio ours/floor is taken per round, floor copied right before;
(b) time until durable: ``save()`` until the manifest is committed and fsynced, DCP's future
    resolved, ``torch.save`` + fsync;
(c) training step slowdown while a save is in flight: per round and variant, --quiet-steps steps
    without a save, then a save and the steps that start while it is in flight; the round's
    slowdown is the mean in-flight step over the mean quiet step, minus 1, and the figure is the
    median over rounds. Variants: AsyncCheckpointer as constructed by default (``gate="auto"``),
    ungated (``gate=None``), and DCP's async_save.

Targets (pass/fail in the table): blocking <= 1.5x the pinned copy; slowdown in flight <= 3.5%
(default checkpointer); time until durable <= DCP async_save's. Results go to
benchmarks/out/bench_ckpt_gpu.json (rewritten after each part, ``complete`` set at the end) and a
table on stdout. Checkpoints go to a fresh directory under --dir, removed afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "out")
TARGETS = {"blocking_over_floor": 1.5, "slowdown": 0.035}


def log(*a: Any) -> None:
    print(*a, file=sys.stderr, flush=True)


class Bench:
    """The model, optimizer and data on the device, and the timed pieces every part uses."""

    def __init__(self, args: argparse.Namespace, root: str):
        import torch

        self.torch, self.args, self.root = torch, args, root
        self.dev = torch.device(args.device)
        self.cuda = self.dev.type == "cuda"
        params = args.gb * 1e9 / 12
        width = min(args.width, max(64, int((params / 2) ** 0.5) // 64 * 64))  # at least 2 layers
        layers = max(2, round(params / (width * width + width)))
        torch.manual_seed(0)
        mods: list[Any] = []
        for i in range(layers):
            mods.append(torch.nn.Linear(width, width))
            if i < layers - 1:
                mods.append(torch.nn.ReLU())
        self.model = torch.nn.Sequential(*mods).to(self.dev)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-5)
        g = torch.Generator(device=self.dev).manual_seed(1)
        self.x = torch.randn(args.batch, width, device=self.dev, generator=g)
        self.y = torch.randn(args.batch, width, device=self.dev, generator=g)
        self.width, self.layers = width, layers
        for _ in range(3):  # Adam's state exists from here on; cuBLAS and the allocator warmed up
            self.step()
        self.state = {"model": self.model, "optimizer": self.opt, "step": 0}
        self.srcs = [t for t in _tensors({"m": self.model.state_dict(), "o": self.opt.state_dict()})]
        self.nbytes = sum(t.numel() * t.element_size() for t in self.srcs)
        self.nparams = sum(p.numel() for p in self.model.parameters())
        self.dcp_kwargs: dict[str, Any] = {"no_dist": True}
        self.pg_initialised = False

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.dev)

    def step(self) -> float:
        """One training step; its wall time, from an idle device until the device is idle again."""
        torch = self.torch
        t = time.perf_counter()
        self.opt.zero_grad(set_to_none=False)
        torch.nn.functional.mse_loss(self.model(self.x), self.y).backward()
        self.opt.step()
        self.sync()
        return time.perf_counter() - t

    # -------------------------------------------------------------------- the floor
    def floor_buffers(self) -> list[Any]:
        torch = self.torch
        bufs = [torch.empty(t.shape, dtype=t.dtype, pin_memory=self.cuda) for t in self.srcs]
        for b in bufs:
            b.zero_()  # pages mapped now, not during the first timed copy
        return bufs

    def floor_copy(self, bufs: list[Any]) -> float:
        """Pinned D2H copy of the whole state (on a CPU device: a plain copy into host buffers)."""
        self.sync()
        t = time.perf_counter()
        for s, b in zip(self.srcs, bufs, strict=True):
            b.copy_(s, non_blocking=self.cuda)
        self.sync()
        return time.perf_counter() - t

    # -------------------------------------------------------------------- DCP
    def dcp_start(self, path: str) -> tuple[Any, Any]:
        """Start a DCP async_save of the state; returns (object to wait on, done())."""
        import torch.distributed.checkpoint as dcp

        sd = {"model": self.model.state_dict(), "optim": self.opt.state_dict()}
        try:
            res = dcp.async_save(sd, checkpoint_id=path, **self.dcp_kwargs)
        except TypeError:  # a torch without no_dist
            self.dcp_kwargs = {}
            res = dcp.async_save(sd, checkpoint_id=path)
        fut = getattr(res, "upload_completion", res)  # AsyncSaveResponse (async staging) or a Future
        return fut, fut.done

    def init_gloo(self) -> None:
        """A gloo process group of this one process, for a DCP that refuses to run without one."""
        import torch.distributed as dist

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        self.dcp_kwargs = {}
        self.pg_initialised = True

    def dcp_save(self, path: str) -> tuple[float, float]:
        """(blocking, until durable) of one DCP async_save; the checkpoint is removed afterwards."""
        self.sync()
        t = time.perf_counter()
        try:
            fut, _ = self.dcp_start(path)
        except Exception as exc:
            if self.pg_initialised:
                raise
            log(f"DCP async_save without a process group failed ({type(exc).__name__}: {exc}); using gloo")
            shutil.rmtree(path, ignore_errors=True)
            self.init_gloo()
            self.sync()
            t = time.perf_counter()
            fut, _ = self.dcp_start(path)
        b = time.perf_counter() - t
        fut.result()
        d = time.perf_counter() - t
        shutil.rmtree(path, ignore_errors=True)
        return b, d

    def torch_save(self, path: str) -> tuple[float, float]:
        """(blocking, until durable) of torch.save of the state to one file, + fsync."""
        self.sync()
        t = time.perf_counter()
        with open(path, "wb") as f:
            self.torch.save({"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}, f)
            b = time.perf_counter() - t
            f.flush()
            os.fsync(f.fileno())
        d = time.perf_counter() - t
        os.unlink(path)
        return b, d


def _tensors(obj: Any) -> list[Any]:
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _pinned_bytes(torch: Any) -> int | None:
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None or not torch.cuda.is_available():
        return None
    try:
        return stats().get("allocated_bytes.current")
    except Exception:  # an allocator without statistics
        return None


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def part_ab(b: Bench) -> dict[str, Any]:
    """(a) blocking and (b) until durable: torch.save, DCP async_save, the floor, ours, round by round."""
    from hpcstagger.checkpoint import AsyncCheckpointer

    torch = b.torch
    bufs = b.floor_buffers()
    pinned_before, rss_before = _pinned_bytes(torch), _rss()
    ck = AsyncCheckpointer(os.path.join(b.root, "ours"), keep=1, gate=None)  # nothing trains in this part
    m: dict[str, list[float]] = {k: [] for k in ("floor", "ts_block", "ts_durable", "dcp_block", "dcp_durable",
                                                 "ours_block", "ours_durable", "ratio")}
    first = first_durable = pinned_ours = rss_ours = None
    for i in range(b.args.rounds + 1):  # round 0 warms up (ours allocates its pinned buffer there)
        tb, td = b.torch_save(os.path.join(b.root, "torch_save.pt"))
        db, dd = b.dcp_save(os.path.join(b.root, f"dcp-{i}"))
        fl = b.floor_copy(bufs)
        b.state["step"] = i
        b.sync()
        t = time.perf_counter()
        h = ck.save(i, b.state)
        ob = time.perf_counter() - t
        h.wait()
        od = time.perf_counter() - t
        ck.drain()  # retention of the previous save runs after durable; not timed
        if i == 0:
            first, first_durable = ob, od
            pinned_ours, rss_ours = _pinned_bytes(torch), _rss()
        else:
            for k, v in (("floor", fl), ("ts_block", tb), ("ts_durable", td), ("dcp_block", db),
                         ("dcp_durable", dd), ("ours_block", ob), ("ours_durable", od), ("ratio", ob / fl)):
                m[k].append(v)
        log(f"round {i}: floor {fl * 1e3:.1f} ms | ours {ob * 1e3:.1f} ms, durable {od:.2f} s | torch.save "
            f"{tb:.2f} s (+fsync {td:.2f}) | DCP {db:.2f} s, durable {dd:.2f} s")
    pinned = {"snapshot_buffer_bytes": ck._buffers.nbytes, "snapshot_pinned": ck._buffers.pinned,
              "pinned_allocator_bytes_for_snapshot":
                  None if pinned_before is None or pinned_ours is None else pinned_ours - pinned_before,
              "rss_growth_first_round_bytes": None if rss_ours is None else rss_ours - rss_before}
    ck.close()
    del bufs
    med = {k: statistics.median(v) for k, v in m.items()}
    return {"floor_copy_s": med["floor"], "ours_blocking_s": med["ours_block"], "ours_over_floor": med["ratio"],
            "ours_first_blocking_s": first, "ours_first_durable_s": first_durable,
            "ours_durable_s": med["ours_durable"], "torch_save_blocking_s": med["ts_block"],
            "torch_save_durable_s": med["ts_durable"], "dcp_blocking_s": med["dcp_block"],
            "dcp_durable_s": med["dcp_durable"], "pinned": pinned, "samples": m}


def part_c(b: Bench) -> dict[str, Any]:
    """(c) step slowdown while a save is in flight: ours (default gate, ungated) and DCP, round by round."""
    from hpcstagger.checkpoint import AsyncCheckpointer

    cks = {"ours": AsyncCheckpointer(os.path.join(b.root, "c-ours"), keep=1),  # gate="auto", the default
           "ours-ungated": AsyncCheckpointer(os.path.join(b.root, "c-ungated"), keep=1, gate=None)}
    for ck in cks.values():
        ck.prepare(b.state)
    per = {n: {"ratios": [], "counts": [], "quiet": [], "busy": [], "in_flight": [], "blocking": []}
           for n in ("ours", "ours-ungated", "dcp")}
    step = 100
    for rnd in range(b.args.rounds + 1):  # round 0 warms up
        for name, v in per.items():
            quiet = [b.step() for _ in range(b.args.quiet_steps)]
            b.state["step"] = step = step + 1
            path = os.path.join(b.root, f"c-dcp-{rnd}")
            t = time.perf_counter()
            if name == "dcp":
                fut, done = b.dcp_start(path)
            else:
                h = cks[name].save(step, b.state)
                done = cks[name].idle  # in flight until the writer is idle, retention included
            blocking = time.perf_counter() - t
            busy = []
            while not done():
                busy.append(b.step())
            if name == "dcp":
                fut.result()
                shutil.rmtree(path, ignore_errors=True)
            else:
                h.wait()
            if rnd == 0 or not busy:
                continue
            v["in_flight"].append(time.perf_counter() - t)
            v["blocking"].append(blocking)
            v["quiet"] += quiet
            v["busy"] += busy
            v["ratios"].append(statistics.fmean(busy) / statistics.fmean(quiet) - 1)
            v["counts"].append(len(busy))
        log(f"round {rnd}: " + " | ".join(
            f"{n} {v['ratios'][-1] * 100:+.2f}% over {v['counts'][-1]} steps" if v["ratios"] and rnd else n
            for n, v in per.items()))
    for ck in cks.values():
        ck.close()
    out = {}
    for name, v in per.items():
        out[name] = {"slowdown": statistics.median(v["ratios"]) if v["ratios"] else None,
                     "round_slowdowns": v["ratios"], "round_inflight_steps": v["counts"],
                     "quiet_step_s": statistics.median(v["quiet"]) if v["quiet"] else None,
                     "inflight_step_s": statistics.median(v["busy"]) if v["busy"] else None,
                     "inflight_steps": len(v["busy"]), "quiet_steps": len(v["quiet"]),
                     "save_in_flight_s": statistics.median(v["in_flight"]) if v["in_flight"] else None,
                     "blocking_s": statistics.median(v["blocking"]) if v["blocking"] else None}
    return out


def verdicts(res: dict[str, Any]) -> dict[str, Any]:
    """Each target with its figure and whether it is met."""
    ab, c = res["ab"], res.get("c", {})
    slow = c.get("ours", {}).get("slowdown")
    return {
        "blocking_over_floor": {"figure": ab["ours_over_floor"], "target": f"<= {TARGETS['blocking_over_floor']}",
                                "met": ab["ours_over_floor"] <= TARGETS["blocking_over_floor"]},
        "slowdown_in_flight": {"figure": slow, "target": f"<= {TARGETS['slowdown'] * 100:.1f}%",
                               "met": None if slow is None else slow <= TARGETS["slowdown"]},
        "durable_vs_dcp": {"figure": ab["ours_durable_s"], "target": f"<= DCP {ab['dcp_durable_s']:.3f} s",
                           "met": ab["ours_durable_s"] <= ab["dcp_durable_s"]},
    }


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f} ms"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:+.2f}%"


def table(res: dict[str, Any]) -> str:
    ab, c, v = res["ab"], res.get("c", {}), res.get("targets", {})

    def met(k: str) -> str:
        m = v.get(k, {}).get("met")
        return "-" if m is None else ("yes" if m else "NO")

    rows = [("measurement", "AsyncCheckpointer", "floor / torch.save / DCP async_save", "target", "met")]
    rows.append(("(a) blocking", _ms(ab["ours_blocking_s"]),
                 f"{_ms(ab['floor_copy_s'])} / {_ms(ab['torch_save_blocking_s'])} / {_ms(ab['dcp_blocking_s'])}",
                 f"<= 1.5x floor ({ab['ours_over_floor']:.2f}x)", met("blocking_over_floor")))
    rows.append(("(a) first save (allocates)", _ms(ab["ours_first_blocking_s"]), "", "", ""))
    rows.append(("(b) until durable", f"{ab['ours_durable_s']:.3f} s",
                 f"- / {ab['torch_save_durable_s']:.3f} s / {ab['dcp_durable_s']:.3f} s", "<= DCP",
                 met("durable_vs_dcp")))
    for name, label in (("ours", "(c) slowdown, default gate"), ("ours-ungated", "(c) slowdown, gate=None")):
        s = c.get(name)
        if s:
            rows.append((label, f"{_pct(s['slowdown'])} ({s['inflight_steps']} steps in all)",
                         f"DCP {_pct(c['dcp']['slowdown'])} ({c['dcp']['inflight_steps']} steps)" if name == "ours"
                         else "", "<= 3.5%" if name == "ours" else "", met("slowdown_in_flight") if name == "ours"
                         else ""))
    if c.get("ours"):
        rows.append(("(c) quiet step / in-flight step", f"{_ms(c['ours']['quiet_step_s'])} / "
                     f"{_ms(c['ours']['inflight_step_s'])}",
                     f"DCP {_ms(c['dcp']['quiet_step_s'])} / {_ms(c['dcp']['inflight_step_s'])}", "", ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)) for r in rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda:0", help="where the model trains (default cuda:0; cpu for a smoke run)")
    p.add_argument("--gb", type=float, default=1.2, help="state size (parameters + Adam moments) in GB (default 1.2)")
    p.add_argument("--width", type=int, default=4096, help="width of the Linear layers (default 4096)")
    p.add_argument("--batch", type=int, default=4096, help="training batch (default 4096)")
    p.add_argument("--rounds", type=int, default=5, help="measured rounds, after one warm-up round (default 5)")
    p.add_argument("--quiet-steps", type=int, default=5, help="steps without a save in flight per round")
    p.add_argument("--dir", default="/tmp", help="checkpoints go to a fresh directory under it (default /tmp)")
    p.add_argument("--out", default=os.path.join(OUT, "bench_ckpt_gpu.json"), help="JSON result file")
    args = p.parse_args()
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"--device {args.device}: this torch ({torch.__version__}) sees no CUDA device; "
              "use --device cpu for a smoke run", file=sys.stderr)
        return 2
    # DCP warns, from its writer thread, that it assumes a single process: it is one
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    started = time.time()
    root = tempfile.mkdtemp(prefix="hpcstagger-bench-ckpt-gpu-", dir=args.dir)
    doc: dict[str, Any] = {"benchmark": "bench_ckpt_gpu",
                           "command": " ".join([os.path.relpath(__file__, os.getcwd())] + sys.argv[1:]),
                           "date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "host": platform.node(),
                           "cpus": os.cpu_count(), "torch": torch.__version__, "cuda": torch.version.cuda,
                           "device": args.device, "complete": False,
                           "gpu": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else None}

    def write() -> None:
        doc["wall_s"] = time.time() - started
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)

    try:
        b = Bench(args, root)
        quiet = [b.step() for _ in range(5)]
        doc["setup"] = {"state_bytes": b.nbytes, "params": b.nparams, "layers": b.layers, "width": b.width,
                        "batch": args.batch, "rounds": args.rounds, "quiet_steps": args.quiet_steps,
                        "step_s": statistics.median(quiet), "dir": root}
        log(f"{doc['gpu'] or args.device}, torch {torch.__version__}: state {b.nbytes / 1e9:.3f} GB "
            f"({b.layers} x Linear({b.width}, {b.width})), step {statistics.median(quiet) * 1e3:.1f} ms")
        doc["ab"] = part_ab(b)
        doc["targets"] = verdicts(doc)
        write()
        doc["c"] = part_c(b)
        doc["targets"] = verdicts(doc)
        doc["dcp_process_group"] = "gloo, world size 1" if b.pg_initialised else "none (no_dist)"
        doc["complete"] = True
        write()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{doc['gpu'] or args.device}; torch {doc['torch']}; state {doc['setup']['state_bytes'] / 1e9:.3f} GB; "
          f"{args.rounds} rounds (medians)")
    print(table(doc))
    print(f"\nwrote {args.out} in {doc['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
