"""The writer's optional timing probe: off by default and then inert; on, it counts a real save's steps.
Also the /proc parsers of benchmarks/procstat.py (used by bench_ckpt_attrib.py), on literal text."""

from __future__ import annotations

import importlib.util
import sys
import threading
from pathlib import Path

import pytest

from hpcstagger.checkpoint import AsyncCheckpointer, load
from hpcstagger.checkpoint import probe
from support.ckpt_util import same, trained

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def fresh_probe():
    probe.disable()
    probe.reset()
    yield probe
    probe.disable()
    probe.reset()


def test_off_by_default_and_inert(fresh_probe):
    assert not probe.enabled()
    a, b = probe.timed("x"), probe.timed("y", 5)
    assert a is b  # one shared do-nothing context manager, no per-call object
    with a:
        pass
    assert probe.totals() == {}


def test_counts_calls_wall_cpu_bytes_across_threads(fresh_probe):
    probe.enable()

    def work():
        for _ in range(3):
            with probe.timed("spin", 10):
                sum(range(20000))

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    t = probe.totals()["spin"]
    assert t["calls"] == 6 and t["bytes"] == 60
    assert 0 < t["cpu_s"] and 0 < t["wall_s"]
    probe.disable()
    with probe.timed("spin", 10):
        pass
    assert probe.totals()["spin"]["calls"] == 6  # disabled: totals kept, nothing added
    probe.reset()
    assert probe.totals() == {}


def test_a_probed_save_is_unchanged_and_counted(tmp_path, fresh_probe):
    model, opt = trained()
    probe.enable()
    with AsyncCheckpointer(tmp_path / "ck", keep=1, gate=None) as ck:
        ck.save(1, {"model": model, "optimizer": opt}).wait()
        ck.save(2, {"model": model, "optimizer": opt})
        ck.drain()
    t = probe.totals()
    for name in ("pwrite", "fsync", "hash", "h5_structure", "publish", "collectives", "commit", "prune"):
        assert t[name]["calls"] >= 1, (name, t)
    assert t["pwrite"]["bytes"] > 0 and t["hash"]["bytes"] >= t["pwrite"]["bytes"]
    same(load(tmp_path / "ck")["model"], model.state_dict())


# ------------------------------------------------------------------ benchmarks/procstat.py
def _procstat():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "procstat.py"
    spec = importlib.util.spec_from_file_location("bench_procstat", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_procstat", mod)
    spec.loader.exec_module(mod)
    return mod


def test_parse_proc_stat_cpu_line():
    ps = _procstat()
    text = "cpu  6502114 25081 967215 9586524 44159 0 23282 10111 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\nintr 1\n"
    assert ps.parse_cpu(text, hz=100) == {"user": 65021.14, "nice": 250.81, "system": 9672.15, "idle": 95865.24,
                                         "iowait": 441.59, "irq": 0.0, "softirq": 232.82, "steal": 101.11}


def test_parse_task_stat_with_spaces_in_the_name():
    ps = _procstat()
    # pid (comm) state ppid ... minflt(10) ... utime(14) stime(15)
    text = "4242 (py thr (x)) S 2 1 1 0 -1 4194560 77 0 3 0 150 25 0 0 20 0 1 0 9 0 0"
    assert ps.parse_task_stat(text, hz=100) == {"comm": "py thr (x)", "ppid": 2, "minflt": 77, "majflt": 3,
                                               "utime": 1.5, "stime": 0.25}


def test_parse_schedstat_status_and_vmstat():
    ps = _procstat()
    assert ps.parse_schedstat("478988 113794 12\n") == {"oncpu": 478988e-9, "rundelay": 113794e-9, "slices": 12}
    status = "Name:\tpython\nvoluntary_ctxt_switches:\t150\nnonvoluntary_ctxt_switches:\t545\n"
    assert ps.parse_ctxt(status) == {"vol": 150, "invol": 545}
    assert ps.parse_vmstat("nr_dirty 163\nnr_writeback 0\npgpgout 87667920\n") == \
        {"nr_dirty": 163, "nr_writeback": 0, "pgpgout": 87667920}


# ------------------------------------------------------------ benchmarks/bench_checkpoint.py summary
def _bench_checkpoint():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_checkpoint.py"
    spec = importlib.util.spec_from_file_location("bench_checkpoint_summary", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(ranks: int, durable: float, dcp: float, slowdown: float | None) -> dict:
    step = {"step-gated": {"slowdown": slowdown}, "dcp": {"slowdown": 0.5}}
    return {"ranks": ranks, "ours_blocking_s": 0.02, "ours_durable_s": durable, "dcp_durable_s": dcp, "step": step,
            "write_paths": {"direct": {"durable_s": durable}, "buffered": {"durable_s": durable * 2}}}


def test_repeat_summary_gives_medians_with_ranges_per_rank_count():
    bc = _bench_checkpoint()
    runs = [_run(1, 1.0, 2.0, 0.05), _run(2, 3.0, 2.0, 0.10), _run(1, 1.4, 2.0, None), _run(1, 1.2, 2.0, 0.01)]
    summ = bc.summary(runs)
    one = summ["1"]
    assert one["ours durable s"] == {"median": 1.2, "min": 1.0, "max": 1.4, "values": [1.0, 1.4, 1.2]}
    assert one["durable / DCP"]["median"] == pytest.approx(0.6)
    assert one["step-gated slowdown %"]["values"] == pytest.approx([5.0, 1.0])  # a run without a figure is left out
    assert one["buffered durable s"]["max"] == pytest.approx(2.8)
    assert summ["2"]["durable / DCP"]["values"] == [1.5]
    table = bc.summary_table(summ).splitlines()
    assert table[0].split()[:2] == ["ranks", "runs"] and len(table) == 3
    assert "1.200 [1.000, 1.400]" in table[1] and "3.0 [1.0, 5.0]" in table[1]


def test_phase_medians_per_rank():
    bc = _bench_checkpoint()
    rounds = [[{"fsync": 0.1, "pwrite": 1.0}, {"fsync": 0.3}], [{"fsync": 0.2, "pwrite": 3.0}, {"fsync": 0.5}],
              [{"fsync": 0.9, "pwrite": 2.0}, {"fsync": 0.4, "pwrite": 1.0}]]
    assert bc._phase_medians(rounds) == [{"fsync": 0.2, "pwrite": 2.0}, {"fsync": 0.4, "pwrite": 0.0}]
