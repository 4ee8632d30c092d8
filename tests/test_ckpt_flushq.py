"""The flush queue: staged checkpoint shards flushed to the durable level by another process.

Real files in temporary directories and a real second process as the flusher (a small script run
with the test's interpreter), killed with SIGKILL or stopped with SIGSTOP mid-copy; the MPI test at
the end runs under ``mpiexec -n 2 python -m pytest --with-mpi -m mpi tests/test_ckpt_flushq.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch

from hpcstagger import config
from hpcstagger.checkpoint import AsyncCheckpointer, load
from hpcstagger.checkpoint import verify_checkpoint
from hpcstagger.checkpoint.flusher import IdleFlusher, idle_flusher
from hpcstagger.checkpoint.flushq import (FlushTask, live_flushers, open_queue, queue_path, register_flusher,
                                         unregister_flusher, write_record)
from hpcstagger._io import checksum
from hpcstagger.errors import CheckpointError, ConfigError, HpcstaggerError

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[1]
SHARD = "shard-00000-of-00001.h5"

# The flusher process: calls the idle flusher until the stop file exists, then prints its counts.
# Each chunk it writes marks <stop>.copying (with the copying thread's policy and the bytes copied
# so far) and then sleeps ``pause`` seconds, so a test can catch it mid-copy. A chunk of 0: the knob's.
CHILD = textwrap.dedent("""
    import json, os, sys, time
    from hpcstagger.checkpoint.flusher import IdleFlusher

    root, stop, pause, chunk = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])

    class Paced(IdleFlusher):
        def after_chunk(self, task, copied):
            with open(stop + ".copying", "a") as f:
                print(os.sched_getscheduler(0), copied, file=f)  # the copying thread's policy
            time.sleep(pause)

    f = Paced(root, chunk_bytes=chunk or None, nice=0)
    while not os.path.exists(stop):
        f(0.2)
    f.close()
    print(json.dumps({"flushed": f.flushed, "failed": f.failed}), flush=True)
""")


class Flusher:
    """A flusher in a second process, on the flush queue of ``root``."""

    def __init__(self, tmp: Path, root: Path, *, pause: float = 0.0, chunk: int = 1 << 20, env: dict | None = None):
        script = tmp / "flusher.py"
        script.write_text(CHILD)
        self.stop = tmp / "stop"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                   **(env or {}))
        self.proc = subprocess.Popen([sys.executable, str(script), str(root), str(self.stop), str(pause), str(chunk)],
                                     env=env, stdout=subprocess.PIPE, text=True)

    @property
    def copying(self) -> bool:
        return Path(str(self.stop) + ".copying").exists()

    def _marks(self) -> list[tuple[int, int]]:
        """(the copying thread's policy, bytes copied so far) after each chunk, in order (every task's)."""
        return [(int(p), int(c)) for p, c in (line.split() for line in
                                               Path(str(self.stop) + ".copying").read_text().splitlines())]

    def policies(self) -> set[int]:
        """The scheduling policies its copying thread had after each chunk."""
        return {p for p, _ in self._marks()}

    def copied(self) -> list[int]:
        """The bytes it had copied after each chunk, in order (every task's)."""
        return [c for _, c in self._marks()]

    def finish(self) -> dict:
        self.stop.touch()
        out, _ = self.proc.communicate(timeout=30)
        return json.loads(out.strip().splitlines()[-1])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


@pytest.fixture
def flushers():
    # A flusher process polls every 0.2 s; on a loaded machine its claim can come later than the
    # default claim wait of 1 s, and the owner would then flush itself before the test sees a copy.
    started: list[Flusher] = []
    with config.override(ckpt_flush_claim_wait=30.0):
        yield started
    for f in started:
        f.kill()


@pytest.fixture
def dirs(tmp_path):
    return tmp_path / "stage", tmp_path / "ckpt"


def _state(step: int, mb: float = 4) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(int(mb * (1 << 18)), generator=g), "b": torch.randn(7, generator=g), "step": step}


def _until(pred, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def _finish(h) -> str:
    """Wait for a save without hurrying its writer (wait() would: the owner then flushes itself)."""
    _until(h.done)
    return h.wait()


def _registered(root: Path) -> None:
    """Wait until a flusher has registered in the queue of ``root`` (owners post only then)."""
    qfd = open_queue(root, create=False)
    try:
        _until(lambda: live_flushers(qfd) > 0)
    finally:
        os.close(qfd)


def _posted(root: Path) -> bool:
    """Whether a flush task waits in the queue of ``root``."""
    return any(n.endswith(".task") for n in os.listdir(queue_path(root)))


def _clean(stage: Path, ckpt: Path) -> None:
    """Nothing left over: the queue holds no file, no directory holds a temporary file."""
    assert os.listdir(queue_path(stage)) == []
    left = [p for p in (*stage.rglob(".*tmp-*"), *ckpt.rglob(".*tmp-*"))]
    assert not left, left


def _same(a: dict, b: dict) -> bool:
    return a["step"] == b["step"] and torch.equal(a["w"], b["w"]) and torch.equal(a["b"], b["b"])


# ------------------------------------------------------------------------------------ the happy path
def test_a_second_process_flushes_and_the_checkpoint_verifies(tmp_path, dirs, flushers):
    stage, ckpt = dirs
    flushers.append(f := Flusher(tmp_path, stage))
    with AsyncCheckpointer(ckpt, staging_dir=stage, flush_by="queue", keep=2) as ck:
        assert ck.flush_queue == str(stage)
        _registered(stage)
        for step in range(2):
            h = ck.save(step, _state(step))
            path = _finish(h)
            assert h.stats["flush"]["by"] == "queue" and h.stats["flush"]["pid"] == f.proc.pid, h.stats
            assert verify_checkpoint(path) == []
    assert _same(load(ckpt), _state(1))
    assert f.finish() == {"flushed": 2, "failed": 0}
    _clean(stage, ckpt)


@pytest.mark.parametrize("idle", [True, False])
def test_the_flusher_copies_under_sched_idle_unless_told_not_to(tmp_path, dirs, flushers, idle):
    # SCHED_IDLE: the copy takes only CPU time nobody else wants (benchmarks/RESULTS.md, bench_flush)
    stage, ckpt = dirs
    flushers.append(f := Flusher(tmp_path, stage, env={"HPCSTAGGER_CKPT_FLUSH_SCHED_IDLE": str(idle).lower()}))
    with AsyncCheckpointer(ckpt, staging_dir=stage, flush_by="queue") as ck:
        _registered(stage)
        h = ck.save(1, _state(1))
        _finish(h)
        assert h.stats["flush"]["by"] == "queue", h.stats
    assert f.finish() == {"flushed": 1, "failed": 0}
    assert f.policies() == {os.SCHED_IDLE if idle else os.SCHED_OTHER}


def test_the_flusher_copies_in_its_own_small_chunks(tmp_path, dirs, flushers):
    # ckpt_flush_chunk_bytes, not the writer's ckpt_chunk_bytes: on a kernel without preemption a
    # syscall copying 8 MB holds the core against the training's wakeups (RESULTS, bench_flush)
    stage, ckpt = dirs
    env = {"HPCSTAGGER_CKPT_FLUSH_CHUNK_BYTES": str(256 << 10), "HPCSTAGGER_CKPT_CHUNK_BYTES": str(4 << 20)}
    flushers.append(f := Flusher(tmp_path, stage, chunk=0, env=env))
    with AsyncCheckpointer(ckpt, staging_dir=stage, flush_by="queue") as ck:
        _registered(stage)
        h = ck.save(1, _state(1))
        path = _finish(h)
        assert h.stats["flush"]["by"] == "queue", h.stats
    assert f.finish() == {"flushed": 1, "failed": 0}
    copied = f.copied()
    steps = [b - a for a, b in zip([0] + copied[:-1], copied, strict=True)]
    assert len(steps) > 8 and set(steps[:-1]) == {256 << 10} and 0 < steps[-1] <= 256 << 10
    assert copied[-1] == os.path.getsize(os.path.join(path, SHARD)) and verify_checkpoint(path) == []


def test_without_a_flusher_the_owner_flushes_at_once(dirs):
    stage, ckpt = dirs
    with config.override(ckpt_flush_claim_wait=5.0):
        with AsyncCheckpointer(ckpt, staging_dir=stage, flush_by="queue") as ck:
            t = time.monotonic()
            h = ck.save(2, _state(2))
            _finish(h)
            assert time.monotonic() - t < 4.0  # it did not wait for a claim
            assert h.stats["flush"] == {"by": "self", "reason": "no idle process was flushing", "wait_s": 0.0}
    assert _same(load(ckpt), _state(2))
    _clean(stage, ckpt)


def test_a_registered_flusher_that_never_claims_costs_the_claim_wait(dirs):
    stage, ckpt = dirs
    with config.override(ckpt_flush_claim_wait=0.3):
        with AsyncCheckpointer(ckpt, staging_dir=stage, flush_by="queue") as ck:
            qfd = open_queue(stage, create=False)
            register_flusher(qfd)  # a flusher that is alive but busy elsewhere
            try:
                assert live_flushers(qfd) == 1
                t = time.monotonic()
                h = ck.save(3, _state(3))
                _finish(h)
                assert time.monotonic() - t >= 0.3
                assert h.stats["flush"]["by"] == "self"
                assert "no idle process claimed" in h.stats["flush"]["reason"]
                # a save the training waits for is not left waiting for a claim
                h = ck.save(4, _state(4))
                h.wait()
                assert "the training waits" in h.stats["flush"]["reason"]
            finally:
                unregister_flusher(qfd)
                os.close(qfd)
    assert _same(load(ckpt), _state(4))
    _clean(stage, ckpt)


# ------------------------------------------------------------------------------------ a flusher fails
def test_a_flusher_killed_mid_copy_leaves_the_owner_to_finish(tmp_path, dirs, flushers):
    stage, ckpt = dirs
    flushers.append(f := Flusher(tmp_path, stage, pause=0.05, chunk=256 << 10))
    with AsyncCheckpointer(ckpt, staging_dir=stage, flush_by="queue") as ck:
        _registered(stage)
        h = ck.save(5, _state(5))
        _until(lambda: f.copying)
        tmp = list((ckpt / "step-000000005").glob(".*tmp-*"))
        assert tmp, "the flusher writes a hidden temporary file"
        f.proc.send_signal(signal.SIGKILL)
        f.proc.wait(10)
        path = h.wait()
        assert h.stats["flush"]["by"] == "self" and "died" in h.stats["flush"]["reason"], h.stats
    assert verify_checkpoint(path) == []
    assert _same(load(ckpt), _state(5))
    _clean(stage, ckpt)


def test_a_stalled_flusher_loses_its_task_and_renames_nothing(tmp_path, dirs, flushers):
    stage, ckpt = dirs
    flushers.append(f := Flusher(tmp_path, stage, pause=0.05, chunk=256 << 10))
    # the flusher's copying thread runs under SCHED_IDLE: on a loaded machine its first chunk can come
    # later than a short stale limit, and the owner would take the task back before the test saw a copy
    with config.override(ckpt_flush_stale=5.0):
        with AsyncCheckpointer(ckpt, staging_dir=stage, flush_by="queue") as ck:
            _registered(stage)
            h = ck.save(6, _state(6))
            _until(lambda: f.copying)
            f.proc.send_signal(signal.SIGSTOP)
            try:
                path = _finish(h)
            finally:
                f.proc.send_signal(signal.SIGCONT)
            assert h.stats["flush"]["by"] == "self" and "no progress" in h.stats["flush"]["reason"], h.stats
            before = os.stat(Path(path) / SHARD).st_ino
            time.sleep(0.5)  # the flusher wakes up, finds its claim gone, and gives up
    assert f.finish() == {"flushed": 0, "failed": 0}
    assert os.stat(Path(path) / SHARD).st_ino == before
    assert verify_checkpoint(path) == []
    _clean(stage, ckpt)


def test_a_corrupted_staged_shard_is_an_error_not_wrong_bytes(dirs):
    stage, ckpt = dirs
    with config.override(ckpt_flush_claim_wait=60.0):
        with AsyncCheckpointer(ckpt, staging_dir=stage, flush_by="queue") as ck:
            f = idle_flusher(stage, linger=False)
            assert f(0.0) is False  # no task yet, but registered: the owner now posts its flush
            h = ck.save(1, _state(1))
            _until(lambda: _posted(stage))
            while f(1.0):
                pass
            _finish(h)
            h = ck.save(2, _state(2))
            _until(h.staged)  # not wait_staged(): it would hurry the writer into flushing itself
            shard = stage / "step-000000002" / SHARD
            with open(shard, "r+b") as fh:  # flip a byte in the middle of the tensor's data
                fh.seek(shard.stat().st_size // 2)
                byte = fh.read(1)
                fh.seek(-1, os.SEEK_CUR)
                fh.write(bytes([byte[0] ^ 0xFF]))
            _until(lambda: _posted(stage))
            while f(1.0):
                pass
            assert f.failed == 1 and f.flushed == 1
            _until(h.done)
            with pytest.raises(CheckpointError, match="changed before it was flushed"):
                h.wait()
            f.close()
    assert not (ckpt / "step-000000002" / SHARD).exists()
    assert _same(load(ckpt), _state(1))
    _clean(stage, ckpt)


# ------------------------------------------------------------------------------------ what a task may say
def _post(stage: Path, *, src: str, dst: str, owner: dict | None = None, tid: str = "s000000001-r00000-1-0a0b0c0d"):
    from hpcstagger.checkpoint.flushq import identity

    fd = open_queue(stage, create=True)
    task = FlushTask(id=tid, step=1, rank=0, src=src, dst=dst, size=4, checksum=checksum(b"abcd"),
                     owner=owner or identity(), posted=time.time())
    write_record(fd, tid + ".task", task.encode())
    os.close(fd)
    return queue_path(stage), tid


UNSAFE = {"outside": "not in a directory under", "dotdot": "not an absolute, normalised path",
          "renamed": "not a shard file copied under its name", "linked-source": "is a symbolic link",
          "linked-destination": "through a symbolic link", "foreign": "not a regular file of yours"}


@pytest.mark.parametrize("case", ["sound", *UNSAFE])
def test_unsafe_tasks_are_refused_and_marked_failed(tmp_path, case):
    stage, ckpt = tmp_path / "stage", tmp_path / "ckpt"
    for d in (stage / "step-000000001", ckpt / "step-000000001", tmp_path / "elsewhere" / "step-000000001"):
        d.mkdir(parents=True)
        (d / SHARD).write_bytes(b"abcd" if d.parts[-2] != "ckpt" else b"old!")
    src, dst = str(stage / "step-000000001" / SHARD), str(ckpt / "step-000000001" / SHARD)
    if case == "outside":
        src = str(tmp_path / "elsewhere" / "step-000000001" / SHARD)
    elif case == "dotdot":
        src = str(stage) + "/../elsewhere/step-000000001/" + SHARD
    elif case == "renamed":
        dst = str(ckpt / "step-000000001" / "manifest.json")
    elif case == "linked-source":
        (stage / "step-000000001" / SHARD).unlink()
        (stage / "step-000000001" / SHARD).symlink_to(tmp_path / "elsewhere" / "step-000000001" / SHARD)
    elif case == "linked-destination":
        shutil.rmtree(ckpt / "step-000000001")
        (ckpt / "step-000000001").symlink_to(tmp_path / "elsewhere" / "step-000000001")
    q, tid = _post(stage, src=src, dst=dst)
    if case == "foreign":
        if os.geteuid() != 0:
            pytest.skip("giving a file to another user needs root")
        os.chown(os.path.join(q, tid + ".task"), 12345, -1)
    f = IdleFlusher(stage, linger=False)
    while f(1.0):
        pass
    if case == "sound":  # the control: the same task, safe, is done
        assert f.flushed == 1 and Path(q, tid + ".done").exists()
        assert (ckpt / "step-000000001" / SHARD).read_bytes() == b"abcd"
        return
    failed = json.loads(Path(q, tid + ".failed").read_text())
    assert UNSAFE[case] in failed["error"], failed
    assert (tmp_path / "elsewhere" / "step-000000001" / SHARD).read_bytes() == b"abcd"
    assert (ckpt / "step-000000001" / SHARD).read_bytes() in (b"old!", b"abcd")  # b"abcd": linked elsewhere
    assert not list(tmp_path.rglob(".*tmp-*"))


def test_tasks_of_a_dead_owner_are_removed_not_done(tmp_path):
    stage = tmp_path / "stage"
    (stage / "step-000000001").mkdir(parents=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    from hpcstagger.checkpoint.flushq import identity

    owner = dict(identity(), pid=dead.pid, start=1)
    q, _ = _post(stage, src=str(stage / "step-000000001" / SHARD), dst=str(tmp_path / "d" / "step-000000001" / SHARD),
                 owner=owner)
    f = IdleFlusher(stage, linger=False)
    assert f(1.0) is False
    assert os.listdir(q) == [f"flusher-{os.getpid()}.live"] and f.flushed == 0  # registered until closed
    f.close()
    assert os.listdir(q) == []


# ------------------------------------------------------------------------------------ the queue and the hook
def test_the_queue_must_be_private(tmp_path):
    stage = tmp_path / "stage"
    q = Path(queue_path(stage))
    q.mkdir(parents=True)
    q.chmod(0o777)
    with pytest.raises(CheckpointError, match="writable by others"):
        open_queue(stage, create=True)
    f = idle_flusher(stage)
    assert f(0.1) is False  # unusable queue: logged, and the hook stops
    q.rmdir()
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    q.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(CheckpointError, match="symbolic link"):
        open_queue(stage, create=False)
    with pytest.raises(HpcstaggerError, match="symbolic link"):
        AsyncCheckpointer(tmp_path / "ckpt", staging_dir=stage, flush_by="queue", gate=None)


def test_the_idle_hook_sleeps_on_an_empty_queue_and_stops_when_told(tmp_path):
    f = idle_flusher(tmp_path / "nothing-yet")
    t = time.monotonic()
    assert f(0.1) is True
    assert 0.08 <= time.monotonic() - t < 0.5
    assert idle_flusher(tmp_path, linger=False)(5.0) is False
    f.close()
    assert f(1.0) is False


def test_flush_options_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="'self' or 'queue'"):
        AsyncCheckpointer(tmp_path / "c", staging_dir=tmp_path / "s", flush_by="other", gate=None)
    with pytest.raises(ConfigError, match="needs a staging_dir"):
        AsyncCheckpointer(tmp_path / "c", flush_by="queue", gate=None)
    with pytest.raises(ConfigError, match="directory above it"):
        AsyncCheckpointer(tmp_path / "c", staging_dir=tmp_path / "s", flush_by="queue", flush_queue=tmp_path / "c",
                          gate=None)
    with config.override(ckpt_flush_by="queue"):  # the knob matters only where there is a staging level
        with AsyncCheckpointer(tmp_path / "c", gate=None) as ck:
            assert ck.flush_queue is None
        with AsyncCheckpointer(tmp_path / "c", staging_dir=tmp_path / "s", flush_queue=tmp_path, gate=None) as ck:
            assert ck.flush_queue == str(tmp_path)


# ------------------------------------------------------------------------------------ MPI
@pytest.mark.mpi
def test_ranks_post_their_shards_and_one_idle_process_flushes_them():
    from hpcstagger.comm import Comm

    world = Comm.world()
    base = world.bcast(tempfile.mkdtemp(prefix="hpcstagger-test-flushq-") if world.rank == 0 else None)
    tmp = Path(base)
    stage, ckpt = tmp / "stage", tmp / "ckpt"
    f = Flusher(tmp, tmp) if world.rank == 0 else None  # the node's queue, above the staging level
    try:
        with config.override(ckpt_min_split_bytes=64 << 10):
            with AsyncCheckpointer(ckpt, comm=world, staging_dir=stage, flush_by="queue", flush_queue=tmp) as ck:
                if world.rank == 0:
                    _registered(tmp)
                world.barrier()
                h = ck.save(7, _state(7))
                _finish(h)
                assert h.stats["flush"]["by"] == "queue", h.stats
                pids = world.allgather(h.stats["flush"]["pid"])
        assert _same(load(ckpt, comm=world), _state(7))
        if world.rank == 0:
            assert f is not None
            assert set(pids) == {f.proc.pid}
            assert f.finish() == {"flushed": world.size, "failed": 0}
            assert verify_checkpoint(str(ckpt / "step-000000007")) == []
            assert os.listdir(queue_path(tmp)) == []
    finally:
        if f is not None:
            f.kill()
        world.barrier()
        if world.rank == 0:
            shutil.rmtree(base, ignore_errors=True)
