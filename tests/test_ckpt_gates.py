"""Gates: in-process activity counting, and the /dev/shm gate fed by DataLoader worker processes."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import signal
import threading
import time

import pytest
import torch

from hpcstagger import comm as comm_module
from hpcstagger.checkpoint import gates as gates_module
from hpcstagger.checkpoint.gates import ActivityGate, AnyGate, Gate, SharedActivityGate, SourceReadHook, StepGate
from hpcstagger.errors import CheckpointError
from support.ckpt_util import FakeClock

pytestmark = pytest.mark.timeout(120)


def _gate_files() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"hpcstagger-gate-{os.getuid()}-{os.getpid()}-")}


def test_activity_gate_counts_across_threads():
    gate = ActivityGate()
    assert not gate.busy() and gate.wait_idle(0)
    inside = threading.Barrier(5)
    release = threading.Event()

    def work():
        with gate.active():
            inside.wait()
            release.wait()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    inside.wait()
    assert gate.busy() and gate.count == 4
    assert not gate.wait_idle(0.02)
    release.set()
    assert gate.wait_idle(10)  # wakes as the last one leaves
    for t in threads:
        t.join()
    assert gate.count == 0 and gate.entered == 4
    gate.exit()  # unmatched: ignored
    assert gate.count == 0


def test_any_gate_and_base_gate():
    a, b = ActivityGate(), ActivityGate()
    g = AnyGate(a, None, b)
    assert not g.busy()
    b.enter()
    assert g.busy() and not g.wait_idle(0.01)
    threading.Timer(0.05, b.exit).start()
    assert g.wait_idle(10)
    assert not Gate().busy()


class BusyFor(Gate):
    """Busy for the first ``n`` looks, then idle; counts the looks."""

    def __init__(self, n):
        self.n, self.looks = n, 0

    def busy(self):
        self.looks += 1
        return self.looks <= self.n


def test_polled_wait_idle_backs_off_and_stops_at_the_deadline(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(comm_module, "time", clock)
    monkeypatch.setattr(gates_module, "time", clock)
    g = BusyFor(10 ** 6)
    assert g.wait_idle(0.02) is False
    # 0.5 ms doubling to 5 ms, the last pause cut short at the deadline
    assert clock.slept == pytest.approx([0.0005, 0.001, 0.002, 0.004, 0.005, 0.005, 0.0025])
    assert clock.now == pytest.approx(0.02) and g.looks == 8
    clock.slept.clear()
    g = BusyFor(3)
    assert g.wait_idle(60) is True and g.looks == 4  # idle on the fourth look: back at once
    assert clock.slept == pytest.approx([0.0005, 0.001, 0.002])
    clock.slept.clear()
    assert BusyFor(0).wait_idle(0) is True and BusyFor(1).wait_idle(-1) is False
    assert clock.slept == []  # no pause when idle at once or out of time


class SourceStandIn(torch.utils.data.Dataset):
    """Stands in for CachedDataset: calls source_read_hook.enter()/exit() around every
    read that goes to the source (here: a slow read every third item)."""

    def __init__(self, hook, n=24, slow=0.05):
        self.hook, self.n, self.slow = hook, n, slow

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i % 3 == 0:  # a cache miss
            self.hook.enter()
            try:
                time.sleep(self.slow)
            finally:
                self.hook.exit()
        return torch.tensor([i])


@pytest.mark.parametrize("context", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_shared_gate_sees_dataloader_workers_reading(context):
    with SharedActivityGate() as gate:
        assert gate.path in {os.path.join("/dev/shm", n) for n in _gate_files()}
        ds = SourceStandIn(gate.source_read_hook())
        loader = torch.utils.data.DataLoader(ds, batch_size=1, num_workers=2,
                                             multiprocessing_context=context)
        busy_seen = set()
        stop = threading.Event()

        def watch():
            while not stop.is_set():
                busy_seen.update(gate.busy_processes())
                time.sleep(0.002)

        w = threading.Thread(target=watch)
        w.start()
        items = [int(b) for b in loader]
        stop.set()
        w.join()
        assert sorted(items) == list(range(24))
        assert busy_seen and os.getpid() not in busy_seen  # worker processes, not this one
        assert not gate.busy()
    assert not _gate_files()


def _hold(hook, entered, release):
    hook.enter()
    entered.set()
    release.wait(30)


@contextlib.contextmanager
def _reading(gate):
    """A spawned process inside a source read of ``gate``'s hook; killed and reaped on leaving."""
    ctx = mp.get_context("spawn")
    entered, release = ctx.Event(), ctx.Event()
    p = ctx.Process(target=_hold, args=(gate.source_read_hook(), entered, release))
    p.start()
    try:
        assert entered.wait(60)
        yield p
    finally:
        p.kill()
        p.join(30)


def test_a_process_killed_inside_a_read_does_not_hold_the_gate():
    with SharedActivityGate() as gate:
        with _reading(gate) as p:
            assert gate.busy_processes() == [p.pid]
        assert not gate.busy()


def test_a_killed_process_not_yet_reaped_does_not_hold_the_gate():
    # a DataLoader worker killed inside a read is a zombie until its loader notices: it holds nothing
    with SharedActivityGate() as gate, _reading(gate) as p:
        assert gate.busy()
        os.kill(p.pid, signal.SIGKILL)  # not joined: the child stays a zombie
        deadline = time.monotonic() + 30
        while _state(p.pid) != "Z" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _state(p.pid) == "Z"
        assert not gate.busy() and gate.busy_processes() == []


def _state(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_shared_gate_in_this_process_and_threads():
    with SharedActivityGate() as gate:
        hook = gate.source_read_hook()
        assert pickle.loads(pickle.dumps(hook)).path == hook.path
        gate.enter()
        with hook.active():
            assert gate.busy_processes() == [os.getpid()]
        assert gate.busy()
        threading.Timer(0.05, gate.exit).start()
        assert gate.wait_idle(10)
        hook.exit()  # unmatched: ignored
        assert not gate.busy()
    with pytest.raises(CheckpointError, match="gone"):
        SourceReadHook("/dev/shm/hpcstagger-gate-does-not-exist").enter()


def test_shared_gate_file_is_removed_when_collected():
    gate = SharedActivityGate()
    path = gate.path
    assert os.path.exists(path)
    del gate
    import gc

    gc.collect()
    assert not os.path.exists(path)


def test_shared_gate_in_a_bad_directory(tmp_path):
    with pytest.raises(CheckpointError, match="cannot create the shared gate file"):
        SharedActivityGate(directory=str(tmp_path / "missing"))


def test_step_gate_is_busy_from_forward_to_optimizer_step():
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gate = StepGate()
    import numpy as np

    gate.watch_state({"model": model, "optimizer": opt, "step": 3, "a": np.ones(2), "d": {}})
    assert not gate.watch(model) and not gate.watch(3)  # once only; other values ignored
    assert not gate.busy()
    for _ in range(2):  # gradient accumulation: one busy window up to the step
        model(torch.randn(3, 4)).sum().backward()
        assert gate.busy()
    opt.step()
    assert not gate.busy() and gate.entered == 1
    model(torch.randn(3, 4))
    gate.close()  # hooks removed, gate idle
    assert not gate.busy()
    model(torch.randn(3, 4))
    opt.step()
    assert not gate.busy() and gate.entered == 2


def test_checkpointer_gates_on_training_steps_by_default(tmp_path):
    from hpcstagger import config
    from hpcstagger.checkpoint import AsyncCheckpointer, load

    model = torch.nn.Linear(64, 64)
    opt = torch.optim.Adam(model.parameters())
    with config.override(ckpt_chunk_bytes=4096, ckpt_gate_max_wait=0.005):
        ck = AsyncCheckpointer(tmp_path)
        assert isinstance(ck.gate, StepGate)
        ck.save(0, {"model": model, "optimizer": opt})
        ck.wait()
        model(torch.randn(2, 64)).sum().backward()  # a step in progress: the writer defers to it
        h = ck.save(1, {"model": model, "optimizer": opt})
        while not h.done():
            time.sleep(0.001)
        assert h.stats["gate_waits"] >= 1
        opt.step()
        ck.close()
    assert ck.gate._hooks == [] and not ck.gate.busy()
    assert load(tmp_path)["model"]["weight"].shape == (64, 64)
    with pytest.raises(Exception, match="gate must be"):
        AsyncCheckpointer(tmp_path, gate="sometimes")
