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
