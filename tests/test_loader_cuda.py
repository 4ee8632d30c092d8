"""The shared loader's GPU path on a real GPU: a stager process copies each batch to the device once,
and consumers take it through CUDA IPC.

Every test is marked ``gpu`` and skips, with the reason, where ``torch.cuda.is_available()`` is False
(CI has no GPU). Run them on a GPU machine with
``python -m pytest -p no:cacheprovider -m gpu tests/test_loader_cuda.py``.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from hpcstagger import config
from hpcstagger.loader import SharedLoader, StreamOrder, list_pipelines
from support.loader_job import Numbered, expected
from support.loader_util import (LINGER, FakeSession, built, check_epochs, gone, start_job, wait_loader_empty,
                                 wait_until)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: torch.cuda.is_available() is False"),
    pytest.mark.timeout(120),
]


@pytest.fixture
def no_new_torch_shm():
    """Nothing of torch's own IPC (``/dev/shm/torch_*`` reference counters) is created."""
    before = {n for n in os.listdir("/dev/shm") if n.startswith("torch_")}
    yield
    after = {n for n in os.listdir("/dev/shm") if n.startswith("torch_")}
    assert after <= before, sorted(after - before)


def _pipeline(root: str) -> dict:
    return wait_until(lambda: [p for p in list_pipelines(root) if p["stager_pid"]], 30, "the stager to start")[0]


def test_in_process_consumer_after_cuda_init_gets_device_batches(shm_root, no_new_torch_shm):
    torch.ones(1, device="cuda").sum().item()  # CUDA is in use before the producer is forked
    with config.override(loader_linger=LINGER):
        loader = SharedLoader(Numbered(64), 8, name="p", root=shm_root, segments=4, num_workers=1,
                              device="cuda")
        seen = []
        for x, i in loader:
            assert x.device.type == "cuda" and i.device.type == "cuda"
            assert torch.equal(x, expected(i))
            x.add_(1.0)  # private: the next consumer of this slot is not affected
            seen += i.tolist()
        assert sorted(seen) == list(range(64))
        info = _pipeline(shm_root)
        assert info["gpu"] and info["on_gpu"] >= 8 and loader.stats()["device"] == "cuda:0"
        stager = info["stager_pid"]
        loader.close()
        wait_loader_empty(shm_root)
        wait_until(lambda: gone(stager), 5, "the stager to exit")


@pytest.mark.parametrize("private", [True, False])
def test_two_consumers_that_used_cuda_first_get_whole_epochs_on_the_gpu(jobs, no_new_torch_shm, private):
    order = StreamOrder(96, 4, segments=6)
    kw = dict(segments=6, window=6, num_workers=1, device="cuda", cuda_first=True, private=private,
              inplace=private)
    a = start_job(jobs, "a", 96, 4, 3, sleep=0.01, **kw)
    b = start_job(jobs, "b", 96, 4, 2, sleep=0.02, **kw)
    built(a, b)
    jobs.open_gate()
    ra, rb = a.finish(), b.finish()
    check_epochs(ra, order, 3)  # every tensor matched its sample: the other's in-place change never showed
    check_epochs(rb, order, 2)
    assert {bt["dev"] for bt in ra["batches"] + rb["batches"]} == {"cuda:0"}
    assert ra["producer_pid"] == rb["producer_pid"] > 0
    assert ra["stats"]["own_prep"] == rb["stats"]["own_prep"] == 0
    jobs.assert_nothing_left()


def test_pace_ahead_moves_its_own_batches_to_the_device(jobs, no_new_torch_shm):
    order = StreamOrder(64, 4, segments=4)
    kw = dict(segments=4, window=4, device="cuda", cuda_first=True)
    slow = start_job(jobs, "slow", 64, 4, 1, sleep=0.06, **kw)
    fast = start_job(jobs, "fast", 64, 4, 2, pace="ahead", **kw)
    built(slow, fast)
    jobs.open_gate()
    rf, rs = fast.finish(), slow.finish()
    check_epochs(rf, order, 2)
    check_epochs(rs, order, 1)
    assert rf["stats"]["own_prep"] > 0
    assert {bt["dev"] for bt in rf["batches"]} == {"cuda:0"}
    jobs.assert_nothing_left()


@pytest.mark.parametrize("victim", ["stager", "producer"])
def test_a_killed_stager_or_producer_is_raised_by_every_consumer(jobs, no_new_torch_shm, victim):
    kw = dict(segments=4, window=4, device="cuda", cuda_first=True)
    cons = [start_job(jobs, name, 64, 4, 50, sleep=0.02, **kw) for name in ("a", "b")]
    built(*cons)
    jobs.open_gate()
    for c in cons:
        c.taken(3)
    info = _pipeline(jobs.root)
    pid = info[f"{victim}_pid"]
    jobs.producers.add(info["producer_pid"])
    jobs.producers.add(info["stager_pid"])
    os.kill(pid, signal.SIGKILL)
    killed_at = time.time()
    for c in cons:
        err = c.finish(30)["error"]
        assert err is not None, "the consumer finished its epochs without its " + victim
        assert err["at"] - killed_at < 5.0, err
        if victim == "stager":
            assert f"GPU stager (pid {pid}) exited" in err["message"], err
        else:
            assert f"(pid {pid}) died" in err["message"], err
    jobs.assert_nothing_left(timeout=LINGER + 5.0)  # the stager sees its producer gone within 0.25 s


def test_session_data_loader_delivers_on_the_device_shared_or_not(shm_root):
    from hpcstagger.colocated.dataloader import data_loader

    with config.override(loader_linger=LINGER):
        for share in (False, True):
            loader = data_loader(FakeSession(), Numbered(16), 4, share=share, device="cuda:0", root=shm_root)
            got = [(x, i) for x, i in loader]
            assert all(x.device.type == "cuda" and torch.equal(x, expected(i)) for x, i in got), share
            assert sorted(int(v) for _, i in got for v in i) == list(range(16))
            if share:
                loader.close()
    wait_loader_empty(shm_root)
