"""Driving shared-loader consumers in their own processes (support/loader_job.py) and checking that
they leave nothing behind: no process, no file under the shm root's ``.loader`` directory.

Every process a test starts (its jobs, the producers they fork, the producers' DataLoader workers)
carries the test's tag in its environment, so :meth:`Jobs.tagged` finds them by their
``/proc/<pid>/environ`` even after they left the job's process tree.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpcstagger.loader import StreamOrder

JOB_SCRIPT = Path(__file__).with_name("loader_job.py")
REPO = Path(__file__).resolve().parents[2]
TAG_VAR = "HPCSTAGGER_TEST_LOADER_TAG"
LINGER = 0.5


def wait_until(pred: Callable[[], Any], timeout: float, what: str, every: float = 0.02) -> Any:
    """Poll ``pred`` until it returns something true; fail naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(every)


def loader_files(root: str) -> list[str]:
    path = os.path.join(root, ".loader")
    return sorted(os.listdir(path)) if os.path.isdir(path) else []


def wait_loader_empty(root: str, timeout: float = LINGER + 2) -> None:
    """The producer lingers ``LINGER`` s without consumers, then removes its files."""
    try:
        wait_until(lambda: not loader_files(root), timeout, "the .loader directory to empty")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {loader_files(root)}") from None


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return True


class Job:
    """One consumer process; ``spec`` as support/loader_job.py reads it."""

    def __init__(self, jobs: Jobs, name: str, spec: dict[str, Any]):
        self.jobs, self.name, self.spec = jobs, name, spec
        self.out = jobs.tmp / f"{name}.json"
        self.log = jobs.tmp / f"{name}.log"
        spec.update(out=str(self.out), root=jobs.root)
        (jobs.tmp / f"{name}.spec.json").write_text(json.dumps(spec))
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, str(JOB_SCRIPT), str(jobs.tmp / f"{name}.spec.json")],
                                         stdout=log, stderr=subprocess.STDOUT, env=jobs.env, cwd=REPO)

    def read(self) -> dict[str, Any] | None:
        try:
            record = json.loads(self.out.read_text())
        except FileNotFoundError:
            return None
        if record.get("producer_pid"):
            self.jobs.producers.add(record["producer_pid"])
        return record

    def wait_for(self, pred: Callable[[dict[str, Any]], Any], what: str, timeout: float = 30) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            exited = self.proc.poll() is not None
            r = self.read()
            if r and pred(r):
                return r
            if exited:
                raise AssertionError(f"{self.name} exited ({self.proc.returncode}) before {what}:\n{self.output()}")
            return None
        return wait_until(check, timeout, f"{self.name}: {what}")

    def taken(self, n: int, timeout: float = 30) -> dict[str, Any]:
        return self.wait_for(lambda r: len(r["batches"]) >= n, f"{n} batches taken", timeout)

    def finish(self, timeout: float = 60) -> dict[str, Any]:
        """Wait for a clean exit; return the job's record."""
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} still runs after {timeout} s:\n{self.output()}") from None
        assert rc == 0, f"{self.name} exited with {rc}:\n{self.output()}"
        record = self.read()
        assert record is not None, self.output()
        return record

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def output(self) -> str:
        return self.log.read_text()[-4000:] if self.log.exists() else ""


class Jobs:
    """The consumer processes of one test, their shm root and their tag (the fixture ``jobs``)."""

    def __init__(self, tmp: Path, root: str):
        self.tmp, self.root = tmp, root
        self.tag = uuid.uuid4().hex
        self.env = {**os.environ, TAG_VAR: self.tag, "HPCSTAGGER_SHM_ROOT": root, "HPCSTAGGER_THROTTLE_DIR": "",
                    "HPCSTAGGER_LOADER_LINGER": str(LINGER), "PYTHONPATH": str(REPO)}
        self.started: list[Job] = []
        self.producers: set[int] = set()  # every producer pid a job's record named

    def start(self, label: str, spec: dict[str, Any]) -> Job:
        """Start the consumer ``label`` (its files are <tmp>/<label>.*) with ``spec``."""
        job = Job(self, label, spec)
        self.started.append(job)
        return job

    def gate(self, name: str = "go") -> str:
        return str(self.tmp / f"{name}.gate")

    def open_gate(self, name: str = "go") -> None:
        Path(self.gate(name)).touch()

    def tagged(self) -> list[int]:
        """Live processes (not zombies) that carry this test's tag: jobs, producers, workers."""
        needle = f"{TAG_VAR}={self.tag}".encode()
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    env = f.read()
            except OSError:
                continue
            if needle in env.split(b"\0") and not gone(int(entry)):
                pids.append(int(entry))
        return pids

    def assert_nothing_left(self, timeout: float = LINGER + 2) -> None:
        """No process of this test runs and the .loader directory is empty, within ``timeout`` s.

        A process that is exiting may no longer show its environment, so the producers the jobs
        named are waited for by pid as well."""
        wait_loader_empty(self.root, timeout)

        def left() -> list[int]:
            return self.tagged() + [p for p in sorted(self.producers) if not gone(p)]
        try:
            wait_until(lambda: not left(), timeout, "the test's processes to end")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {left()}") from None

    def cleanup(self) -> None:
        """After a failed test: kill whatever it left running (its own processes, by pid)."""
        for job in self.started:
            if job.proc.poll() is None:
                job.kill()
        for pid in self.tagged():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def start_job(jobs: Jobs, label: str, n: int, batch_size: int, epochs: int, gate: str = "go", **loader: Any) -> Job:
    """Start consumer ``label`` over ``Numbered(n)``; keys the job itself reads (``sleep``, ``fail_at``,
    ``cuda_first``, ``inplace``) are taken from ``loader``, the rest are SharedLoader arguments."""
    spec = {"n": n, "batch_size": batch_size, "epochs": epochs, "name": "pipe",
            "gate": jobs.gate(gate) if gate else None, "sleep": loader.pop("sleep", 0.0),
            "fail_at": loader.pop("fail_at", -1), "cuda_first": loader.pop("cuda_first", False),
            "inplace": loader.pop("inplace", False), "loader": loader}
    return jobs.start(label, spec)


def built(*js: Job) -> None:
    """Wait until the jobs have imported torch and built their loaders (they wait at their gate)."""
    for j in js:
        j.wait_for(lambda r: "len" in r, "its loader built")


class FakeSession:
    """What ``colocated.dataloader.data_loader`` needs of a Session (a LoaderOwner): no spec, job "j", one rank."""

    spec, job = None, "j"
    comm = type("Comm", (), {"size": 1, "rank": 0})()

    def say(self, text: str) -> None:
        pass


def stream_batch(order: StreamOrder, first: int, epoch: int, j: int, rank: int = 0, world: int = 1) -> int:
    """The stream batch that a consumer attached at ``first`` takes as batch ``j`` of ``epoch``."""
    return first + epoch * order.batches + rank + j * world


def check_epochs(record: dict[str, Any], order: StreamOrder, epochs: int, rank: int = 0, world: int = 1) -> None:
    """Every batch is the stream batch it should be and its tensors match; whole epochs (for world 1)."""
    per_epoch = order.batches // world
    batches = record["batches"]
    assert record["error"] is None and record["done"], record["error"]
    assert record["len"] == per_epoch and len(batches) == epochs * per_epoch
    assert all(b["ok"] for b in batches), "a tensor did not match its sample index"
    first = record["first"]
    assert order.is_boundary(first), f"attached at batch {first}, not at a segment boundary"
    for e in range(epochs):
        mine = batches[e * per_epoch:(e + 1) * per_epoch]
        assert all(b["e"] == e for b in mine)
        for j, b in enumerate(mine):
            assert b["i"] == order.indices(stream_batch(order, first, e, j, rank, world)), (e, j)
        if world == 1:
            assert sorted(i for b in mine for i in b["i"]) == list(range(order.n)), f"epoch {e}"
