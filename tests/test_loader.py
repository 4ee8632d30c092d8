"""The shared loader for real: a detached producer process, consumers in this process and in their
own processes (support/loader_job.py), a private /dev/shm root per test.

Every test ends with nothing left: no producer, no DataLoader worker, no consumer process, and an
empty ``.loader`` directory (the producer lingers ``LINGER`` s, then removes its files).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import socket
import time

import pytest
import torch
from torch.utils.data import IterableDataset

from hpcstagger import config, nodeload
from hpcstagger.errors import ConfigError, LoaderError
from hpcstagger.loader import SharedLoader, StreamOrder, list_pipelines
from hpcstagger.loader.pipelines import producers_of, remove_stale
from support.loader_job import Numbered, expected
from support.loader_util import (LINGER, FakeSession, built, check_epochs, gone, loader_files, start_job,
                                 wait_loader_empty, wait_until)

pytestmark = pytest.mark.timeout(60)
FORK = mp.get_context("fork")


@pytest.fixture
def linger(shm_root):
    """Consumers in this process: their producers (forked from it) linger LINGER s."""
    with config.override(loader_linger=LINGER):
        yield shm_root


def _ended(loader: SharedLoader, root: str, pid: int = 0) -> None:
    """Close ``loader``; its producer (``pid``, default the loader's) stops within LINGER s and
    leaves an empty .loader directory."""
    pid = pid or loader.producer_pid
    assert pid > 0
    loader.close()
    wait_until(lambda: gone(pid), LINGER + 2, f"the producer pid {pid} to stop")
    wait_loader_empty(root)


def _consumers(root: str) -> list[dict]:
    return [c for p in list_pipelines(root) for c in p["consumers"]]


# ------------------------------------------------------------------------------- bad arguments
class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(10))


class _SizedStream(_Stream):
    def __len__(self):
        return 10


@pytest.mark.parametrize("dataset, kwargs, match", [
    (_Stream(), {}, "IterableDataset"),
    (_SizedStream(), {}, "IterableDataset"),
    (Numbered(10), {"pace": "fast"}, "pace"),
    (Numbered(10), {"hold": 0}, "hold"),
    (Numbered(10), {"hold": 8, "window": 8}, "hold"),
    (Numbered(10), {"hold": 1.5}, "hold"),
    (Numbered(10), {"rank": 2, "world": 2}, "rank"),
    (Numbered(10), {"rank": -1, "world": 2}, "rank"),
    (Numbered(10), {"world": 0}, "rank"),
    (Numbered(10), {"window": 1}, "window"),
    (Numbered(10), {"window": 257}, "window"),
    (Numbered(10), {"num_workers": -1}, "num_workers"),
    (Numbered(10), {"world": 4, "batch_size": 4}, "cannot be shared by 4 ranks"),
    (Numbered(10), {"name": "../up"}, "name"),
    (Numbered(10), {"batch_size": 0}, "batch_size"),
    (Numbered(10), {"device": "cpu"}, "not a CUDA device"),
    (Numbered(10), {"device": "nonsense"}, "not a device"),
    (Numbered(10), {"private": False}, "private=False needs device"),
    pytest.param(Numbered(10), {"device": "cuda"}, "CUDA is not available",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")),
])
def test_bad_arguments_raise_config_error(shm_root, dataset, kwargs, match):
    kwargs = {"batch_size": 2, "name": "p", **kwargs}
    with pytest.raises(ConfigError, match=match):
        SharedLoader(dataset, root=shm_root, **kwargs)
    assert not os.path.exists(os.path.join(shm_root, ".loader"))  # refused before touching shared memory


# ------------------------------------------------------------------------------------- safety
def test_a_symlinked_loader_directory_is_refused(shm_root, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    os.symlink(elsewhere, os.path.join(shm_root, ".loader"))
    loader = SharedLoader(Numbered(8), 2, name="p", root=shm_root)
    with pytest.raises(LoaderError, match="is a symbolic link"):
        loader.attach()
    with pytest.raises(LoaderError, match="is a symbolic link"):
        iter(loader)
    assert os.listdir(elsewhere) == [] and loader.producer_pid == 0


def test_a_temporary_directory_too_long_for_the_workers_sockets_is_refused(shm_root, tmp_path, monkeypatch):
    # DataLoader workers pass a batch's descriptors over a Unix socket under TMPDIR; a path past 107
    # bytes fails in the worker, whose error the detached producer cannot show: the jobs would hang
    deep = tmp_path / ("d" * max(80 - len(str(tmp_path)) - 1, 1))  # 80 bytes, or more where tmp_path is long
    deep.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(deep))
    t0 = time.monotonic()
    with pytest.raises(LoaderError, match=rf"\({len(os.fsencode(deep))} bytes\).*TMPDIR to a shorter one"):
        SharedLoader(Numbered(8), 2, name="p", num_workers=2, root=shm_root).attach()
    assert time.monotonic() - t0 < 5 and loader_files(shm_root) == []
    # no workers, no sockets: the same directory is fine
    loader = SharedLoader(Numbered(8), 2, name="q", num_workers=0, root=shm_root)
    assert sorted(int(i) for _, index in loader for i in index) == list(range(8))
    loader.close()


def test_a_group_writable_loader_directory_is_refused(shm_root):
    path = os.path.join(shm_root, ".loader")
    os.mkdir(path)
    os.chmod(path, 0o770)
    with pytest.raises(LoaderError, match="group- or world-writable.*chmod go-w"):
        SharedLoader(Numbered(8), 2, name="p", root=shm_root).attach()
    assert os.listdir(path) == []


def test_a_symlinked_control_file_is_refused(shm_root, tmp_path):
    loader = SharedLoader(Numbered(8), 2, name="p", root=shm_root)
    os.mkdir(os.path.join(shm_root, ".loader"), 0o700)
    target = tmp_path / "target"
    target.write_bytes(b"\0" * 32768)
    os.symlink(target, os.path.join(shm_root, ".loader", loader.key + ".ctl"))
    with pytest.raises(LoaderError, match="is a symbolic link"):
        loader.attach()
    assert target.read_bytes() == b"\0" * 32768 and loader.producer_pid == 0


def test_an_in_place_change_is_not_seen_by_another_consumer(linger):
    order = StreamOrder(64, 2, segments=16)
    a = SharedLoader(Numbered(64), 2, name="p", root=linger, segments=16)
    b = SharedLoader(Numbered(64), 2, name="p", root=linger, segments=16)
    ia, ib = iter(a), iter(b)
    assert a.producer_pid == b.producer_pid > 0  # one pipeline
    ga, gb = a.stats()["first_batch"], b.stats()["first_batch"]
    assert ga <= gb  # b attached second, at the same or a later segment boundary
    xa, sa = next(ia)
    while ga < gb:  # a takes batches up to b's first one
        xa, sa = next(ia)
        ga += 1
    before = sa.clone()
    xa.mul_(-1)  # in place, on tensors over the shared slot
    sa[0] = 10_000
    assert torch.equal(xa, -expected(before)) and int(sa[0]) == 10_000  # private copy-on-write pages
    xb, sb = next(ib)  # the same stream batch, taken after a's change
    assert sb.tolist() == before.tolist() == order.indices(gb)
    assert torch.equal(xb, expected(sb))
    a.close()
    _ended(b, linger)



def test_shuffle_false_gives_dataset_order_in_a_pipeline_of_its_own(linger):
    """As DataLoader(shuffle=False): every epoch in dataset order; the same name shuffled (the
    default) is another pipeline, with another producer."""
    plain = SharedLoader(Numbered(24), 4, name="p", root=linger, shuffle=False)
    mixed = SharedLoader(Numbered(24), 4, name="p", root=linger)
    try:
        for _ in range(2):
            ids = [i for x, s in plain for i in s.tolist()]
            assert ids == list(range(24))
        ids = [i for x, s in mixed for i in s.tolist()]
        assert sorted(ids) == list(range(24)) and ids != list(range(24))
        assert plain.key != mixed.key and plain.producer_pid != mixed.producer_pid
    finally:
        mixed.close()
    _ended(plain, linger)
    from hpcstagger.colocated.dataloader import data_loader

    for share in (False, True):  # session.data_loader passes it on, to a plain DataLoader or a shared one
        loader = data_loader(FakeSession(), Numbered(12), 4, share=share, shuffle=False, root=linger,
                             persistent_workers=False)
        assert [i for x, s in loader for i in s.tolist()] == list(range(12))
        if share:
            loader.close()


def test_a_shared_producer_runs_the_workers_its_sharing_ranks_asked_for_up_to_the_cpus(linger):
    from hpcstagger.colocated.dataloader import data_loader, producer_workers
    from hpcstagger.nodeload import usable_cores
    from hpcstagger.spec.jobspec import Spec

    # what the producer gets: the ranks' workers added up, bounded by the CPUs, never below one rank's
    assert producer_workers(2, 4, 16) == 8 and producer_workers(2, 4, 2) == 2 and producer_workers(4, 4, 2) == 4
    assert producer_workers(2, 3, 5) == 5 and producer_workers(0, 4, 16) == 0  # main-process loading stays so
    assert producer_workers(2, 4, 16, fixed=3) == 3 and producer_workers(1, 1, 16) == 1
    with pytest.raises(ConfigError, match=r"loader\.workers must be an integer >= 0"):
        Spec.from_dict({"job": [{"name": "a", "command": "x"}], "loader": {"workers": -1}})
    said = []

    class Job(FakeSession):
        def say(self, text: str) -> None:
            said.append(text)

    session = Job()
    session.job = "a"
    jobs = [{"name": n, "command": "x", "ranks": r} for n, r in (("a", 1), ("b", 2), ("c", 1))]
    jobs[2]["loader"] = "own"  # c shares nothing with a and b
    for fixed, expected_workers in ((0, max(1, min(3, usable_cores()))), (2, 2)):
        session.spec = Spec.from_dict({"run": {"name": f"w{fixed}"}, "loader": {"share": True, "workers": fixed},
                                       "job": jobs})
        loader = data_loader(session, Numbered(12), 4, shuffle=False, root=linger, num_workers=1)
        assert [i for x, s in loader for i in s.tolist()] == list(range(12))
        assert loader.producer_workers == expected_workers, (fixed, said)
        assert [p["workers"] for p in list_pipelines(linger)] == [expected_workers]
        assert f"runs {expected_workers} DataLoader worker(s) (3 sharing rank(s) asked for 1 each)" in said[-1], said
        _ended(loader, linger)


def test_a_data_loaders_pin_memory_is_taken_with_a_warning_naming_device(linger, caplog):
    with caplog.at_level("WARNING", logger="hpcstagger.loader.consumer"):
        loader = SharedLoader(Numbered(8), 4, name="p", root=linger, pin_memory=True, persistent_workers=True)
    assert "pin_memory=True has no effect" in caplog.text and "device=" in caplog.text
    assert sorted(i for x, s in loader for i in s.tolist()) == list(range(8))
    _ended(loader, linger)

def _with_a_set(samples):
    return {"x": torch.stack([s[0] for s in samples]), "ids": {s[1] for s in samples}}


def test_a_batch_with_a_set_is_refused_saying_what_passes(linger):
    loader = SharedLoader(Numbered(16), 4, name="p", root=linger, collate_fn=_with_a_set)
    loader.attach()
    pid = loader.producer_pid
    with pytest.raises(LoaderError) as info:
        next(iter(loader))
    text = str(info.value)
    assert f"(pid {pid}) failed" in text
    assert "a batch holds a set" in text and "tensors, numpy arrays" in text and "collate_fn" in text
    _ended(loader, linger, pid)


# ------------------------------------------------------------------------------- stale files
def _consume_until_killed(root: str, ready) -> None:
    it = iter(SharedLoader(Numbered(64), 4, name="p", root=root, segments=4))
    next(it)
    ready.set()
    time.sleep(60)


def _leave_stale(root: str) -> dict:
    """A pipeline whose consumer and producer were both killed (the producer lingers 30 s, so it
    has not removed its files); returns its list_pipelines entry from before the kills."""
    ready = FORK.Event()
    with config.override(loader_linger=30.0):
        child = FORK.Process(target=_consume_until_killed, args=(root, ready))
        child.start()
    try:
        assert ready.wait(30)
        [live] = list_pipelines(root)
        assert live["state"] == "running" and [c["pid"] for c in live["consumers"]] == [child.pid]
        assert remove_stale(root) == []  # in use: left alone
    finally:
        child.kill()
        t0 = time.monotonic()
        child.join(30)
    # multiprocessing joins by a pipe that the producer (forked from the child) must not hold open
    assert time.monotonic() - t0 < 5.0, "the producer holds its consumer's pipes open"
    assert not gone(live["producer_pid"])
    os.kill(live["producer_pid"], signal.SIGKILL)
    wait_until(lambda: gone(live["producer_pid"]), 5, "the killed producer to go")
    [dead] = list_pipelines(root)
    assert dead["state"] == "dead" and dead["key"] == live["key"]
    return live


def test_what_dead_processes_left_is_replaced_or_removed(linger):
    assert list_pipelines(linger) == [] and remove_stale(linger) == []
    stale = _leave_stale(linger)
    loader = SharedLoader(Numbered(64), 4, name="p", root=linger, segments=4)
    got = sorted(int(i) for _, s in loader for i in s)  # a new producer over the dead one's files
    assert got == list(range(64)) and loader.producer_pid not in (0, stale["producer_pid"])
    _ended(loader, linger)
    stale = _leave_stale(linger)
    assert remove_stale(linger) == [stale["key"]] and loader_files(linger) == []


def test_closing_after_the_root_was_removed_does_not_bring_it_back(linger):
    loader = SharedLoader(Numbered(16), 4, name="p", root=linger)
    next(iter(loader))
    pid = loader.producer_pid
    shutil.rmtree(linger)  # an admin (or a test's teardown) cleans up while the loader still exists
    loader.close()
    wait_until(lambda: gone(pid), LINGER + 2, f"the producer pid {pid} to stop")
    assert not os.path.exists(linger)


# ------------------------------------------------------------------- what the producer inherits
def test_the_producer_holds_no_inherited_pipe_or_socket_but_keeps_their_numbers_taken(linger):
    """The producer must not hold its consumer's pipes or sockets open (a dead rank's peers must see
    its connections close), yet it must not free their numbers: objects copied from the consumer (a
    multiprocessing connection, a subprocess pipe) still close them when collected, and a freed number
    would by then belong to the producer's own DataLoader queues (a worker waiting forever for indices
    sent to nowhere)."""
    r, w = os.pipe()
    near, far = socket.socketpair()
    try:
        loader = SharedLoader(Numbered(32), 4, name="p", root=linger, num_workers=1)
        it = iter(loader)
        seen = [int(i) for i in next(it)[1]]
        pid = loader.producer_pid
        for fd in (r, w, near.fileno(), far.fileno()):
            assert os.readlink(f"/proc/{pid}/fd/{fd}") == "/dev/null", fd
        os.close(w)
        w = -1
        assert os.read(r, 1) == b""  # no writer left anywhere: the producer let go of its copy
        near.close()
        far.settimeout(5)
        assert far.recv(1) == b""  # the peer sees the connection closed
        seen += [int(i) for _, ids in it for i in ids]
        assert sorted(seen) == list(range(32))
        del it
        _ended(loader, linger, pid)
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
        near.close()
        far.close()


class _HangsAfter(torch.utils.data.Dataset):
    """Samples 0 to 7, then a DataLoader worker that never answers (a dataset stuck on a dead mount)."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i):
        if i >= 8:
            time.sleep(3600)
        return torch.tensor([i])


def test_a_producer_stuck_in_its_dataset_still_ends_once_nobody_is_attached(linger):
    loader = SharedLoader(_HangsAfter(), 4, name="p", root=linger, num_workers=1, shuffle=False, timeout=2.0)
    it = iter(loader)
    assert [int(x) for b in (next(it), next(it)) for x in b] == list(range(8))
    pid = loader.producer_pid
    workers = [int(c) for c in open(f"/proc/{pid}/task/{pid}/children").read().split()]
    with pytest.raises(LoaderError, match="no batch from its producer"):
        next(it)
    del it
    loader.close()
    # linger, then the grace for a DataLoader that never returns, then the workers' parent watchdog
    wait_until(lambda: gone(pid), LINGER + 8, f"the stuck producer pid {pid} to end")
    wait_until(lambda: all(gone(p) for p in workers), 10, "its DataLoader workers to end")
    wait_loader_empty(linger)


# --------------------------------------------------------------------------------------- hold
@pytest.mark.parametrize("hold", [1, 2])
def test_hold_keeps_the_previous_batch_valid(linger, hold):
    """window 3: with hold=2 the producer must not overwrite batch 0 while batch 1 is taken; with
    hold=1 it does (batch 3 goes to batch 0's slot), so the check would see a reuse."""
    order = StreamOrder(40, 4, segments=10)
    loader = SharedLoader(Numbered(40), 4, name="p", root=linger, window=3, hold=hold, segments=10)
    it = iter(loader)
    x0, s0 = next(it)
    keep, s0 = x0.clone(), s0.clone()  # s0 too lives in the slot
    assert s0.tolist() == order.indices(0)
    x1, s1 = next(it)
    assert s1.tolist() == order.indices(1)
    published = 3 if hold == 2 else 4  # the producer blocks at the slot of the batch still held
    wait_until(lambda: list_pipelines(linger)[0]["published"] >= published, 10, f"{published} batches")
    time.sleep(0.3)  # it would have gone on by now
    assert list_pipelines(linger)[0]["published"] == published
    if hold == 2:
        assert torch.equal(x0, keep) and torch.equal(x0, expected(s0))
    else:
        assert torch.equal(x0, expected(torch.tensor(order.indices(3))))  # batch 3 took batch 0's slot
    assert torch.equal(x1, expected(s1))
    x2, s2 = next(it)
    assert torch.equal(x2, expected(s2)) and s2.tolist() == order.indices(2)
    if hold == 2:
        assert torch.equal(x1, expected(s1)) and s1.tolist() == order.indices(1)
    _ended(loader, linger)


# ------------------------------------------------------------------------ consumers in processes


@pytest.mark.slow
def test_two_consumers_and_a_late_joiner_get_whole_epochs(jobs):
    order = StreamOrder(96, 4, segments=6)  # 24 batches an epoch, a boundary every 4
    kw = dict(segments=6, window=8, num_workers=1)
    a = start_job(jobs, "a", 96, 4, 3, sleep=0.01, **kw)
    late = start_job(jobs, "late", 96, 4, 2, gate="late", **kw)
    built(a, late)
    jobs.open_gate()
    a.taken(10)
    jobs.open_gate("late")
    ra, rl = a.finish(), late.finish()
    assert ra["producer_pid"] == rl["producer_pid"] > 0
    check_epochs(ra, order, 3)
    check_epochs(rl, order, 2)
    assert ra["first"] == 0 and rl["first"] > 0  # the late one joined at a later segment boundary
    assert ra["stats"]["own_prep"] == rl["stats"]["own_prep"] == 0  # pace="wait": the producer made all
    jobs.assert_nothing_left()
    assert gone(ra["producer_pid"])


@pytest.mark.slow
def test_data_parallel_ranks_split_each_epoch_beside_a_plain_consumer(jobs):
    order = StreamOrder(60, 4, segments=5)  # 15 batches an epoch: 7 per rank, the 15th unused by the job
    kw = dict(segments=5, window=8, group="job", world=2)
    r0 = start_job(jobs, "r0", 60, 4, 2, rank=0, **kw)
    r1 = start_job(jobs, "r1", 60, 4, 2, rank=1, **kw)
    plain = start_job(jobs, "plain", 60, 4, 2, segments=5, window=8, sleep=0.005)
    built(r0, r1, plain)
    jobs.open_gate()
    rec0, rec1, recp = r0.finish(), r1.finish(), plain.finish()
    assert rec0["first"] == rec1["first"] and rec0["len"] == rec1["len"] == 7
    check_epochs(rec0, order, 2, rank=0, world=2)
    check_epochs(rec1, order, 2, rank=1, world=2)
    for e in range(2):
        mine = [[b["i"] for b in rec["batches"] if b["e"] == e] for rec in (rec0, rec1)]
        s0, s1 = ({i for b in m for i in b} for m in mine)
        assert not s0 & s1
        start = rec0["first"] + e * order.batches
        stream = [order.indices(g) for g in range(start, start + 2 * (order.batches // 2))]
        assert sorted(mine[0] + mine[1]) == sorted(stream)
    check_epochs(recp, order, 2)
    assert recp["producer_pid"] == rec0["producer_pid"] == rec1["producer_pid"]
    jobs.assert_nothing_left()


@pytest.mark.slow
def test_a_killed_consumer_is_detached_and_a_restarted_one_attaches(jobs):
    order = StreamOrder(64, 4, segments=4)  # 16 batches an epoch
    kw = dict(segments=4, window=4)
    a = start_job(jobs, "a", 64, 4, 4, sleep=0.01, **kw)
    victim = start_job(jobs, "victim", 64, 4, 5, sleep=0.05, **kw)  # the slowest: it holds the producer back
    again = start_job(jobs, "again", 64, 4, 2, gate="again", **kw)
    built(a, victim, again)
    jobs.open_gate()
    rv = victim.taken(5)
    assert {c["pid"]: c["alive"] for c in _consumers(jobs.root)}[rv["pid"]] is True
    victim.kill()  # mid-epoch, holding a batch the producer waits for
    assert not a.read()["done"]  # a can be at most a window ahead of it
    wait_until(lambda: rv["pid"] not in {c["pid"] for c in _consumers(jobs.root)}, 3, "the victim detached")
    jobs.open_gate("again")
    ra, rg = a.finish(), again.finish()
    check_epochs(ra, order, 4)  # every batch the stream batch it should be: none lost, none twice
    check_epochs(rg, order, 2)
    assert all(b["ok"] for b in victim.read()["batches"])
    jobs.assert_nothing_left()


@pytest.mark.slow
def test_a_killed_producer_is_raised_by_every_consumer(jobs):
    kw = dict(segments=4, window=4)
    cons = [start_job(jobs, name, 64, 4, 50, sleep=0.02, **kw) for name in ("a", "b")]
    built(*cons)
    jobs.open_gate()
    records = [c.taken(3) for c in cons]
    pid = records[0]["producer_pid"]
    assert records[1]["producer_pid"] == pid and list_pipelines(jobs.root)[0]["producer_pid"] == pid
    os.kill(pid, signal.SIGKILL)
    killed_at = time.time()
    for c in cons:
        err = c.finish(30)["error"]
        assert err is not None, "the consumer finished its epochs without a producer"
        assert f"(pid {pid}) died" in err["message"]
        assert err["at"] - killed_at < 5.0, err
    jobs.assert_nothing_left(timeout=2.0)  # no linger: the last consumer removes a dead producer's files


@pytest.mark.slow
def test_a_failing_dataset_is_raised_with_its_error(jobs):
    order = StreamOrder(32, 4)
    bad = order.indices(2)[1]  # in the third batch the producer's worker prepares
    job = start_job(jobs, "a", 32, 4, 2, gate="", fail_at=bad, num_workers=1)
    rec = job.finish()
    assert rec["error"] is not None and not rec["done"]
    message = rec["error"]["message"]
    assert f"sample {bad} is corrupt (planted by the test)" in message
    assert f"(pid {rec['producer_pid']}) failed" in message
    assert len(rec["batches"]) <= 2
    jobs.assert_nothing_left()


@pytest.mark.slow
def test_pace_ahead_runs_at_its_own_speed(jobs):
    order = StreamOrder(64, 4, segments=4)
    kw = dict(segments=4, window=4)
    slow = start_job(jobs, "slow", 64, 4, 2, sleep=0.06, **kw)
    fast = start_job(jobs, "fast", 64, 4, 2, pace="ahead", **kw)
    built(slow, fast)
    jobs.open_gate()
    rf, rs = fast.finish(), slow.finish()
    check_epochs(rf, order, 2)  # the batches it prepared itself are the stream's batches too
    check_epochs(rs, order, 2)
    assert rf["stats"]["own_prep"] > 0 and rs["stats"]["own_prep"] == 0
    # with pace="wait" it could not be more than a window ahead of the slow one; it is two epochs ahead
    end_of_first_epoch = rs["batches"][order.batches - 1]["t"]
    assert rf["finished_at"] < end_of_first_epoch, (rf["finished_at"], end_of_first_epoch)
    jobs.assert_nothing_left()


# ------------------------------------------------------------------------- session.data_loader
def test_a_plain_data_loader_with_a_device_moves_every_batch(shm_root):
    from hpcstagger.colocated.dataloader import data_loader

    loader = data_loader(FakeSession(), Numbered(12), 4, share=False, device="cpu", hold=2, num_workers=0)
    assert len(loader) == 3 and loader.batch_size == 4  # the DataLoader's attributes pass through
    seen = []
    for x, i in loader:
        assert x.device.type == "cpu" and torch.equal(x, expected(i))
        seen += i.tolist()
    assert sorted(seen) == list(range(12))
    with pytest.raises(ConfigError, match="not a CUDA device"):  # the shared loader says what is wrong
        data_loader(FakeSession(), Numbered(12), 4, share=True, device="cpu", root=shm_root)


# ------------------------------------------------------------------------------- memory
def test_a_consumers_detached_producer_is_found_and_its_memory_followed(linger):
    """Calibration follows a job's process tree for its memory; the producer its consumer starts is
    detached from that tree, so calibration asks producers_of for it and follows it too."""
    # with a DataLoader worker: in the full suite this hung once the producer freed the numbers of
    # the pipes it inherited (test_the_producer_holds_no_inherited_pipe_or_socket_but_keeps_their_numbers_taken)
    loader = SharedLoader(Numbered(64), 4, name="p", root=linger, num_workers=1)
    it = iter(loader)
    next(it)
    pid = loader.producer_pid
    assert producers_of({os.getpid()}, linger) == [pid]
    assert producers_of({os.getpid() + 10**7}, linger) == []          # not a consumer of it
    alone, seen = nodeload.PeakMemory(), nodeload.PeakMemory(adopted=lambda pids: producers_of(pids, linger))
    alone.sample(os.getpid())
    seen.sample(os.getpid())
    assert alone.adopted_peak == 0 and seen.adopted_peak > 1 << 20     # the producer
    assert seen.peak >= alone.peak + seen.adopted_peak // 2
    del it
    _ended(loader, linger, pid)
