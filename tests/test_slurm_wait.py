"""The schedule of `slurm.wait_for_job`'s controller queries, on a scripted clock.

The queries themselves run against the real test cluster in tests/test_slurm_cluster.py and
tests/test_slurm_launch.py; here the controller's answers and the clock are scripted, so that the
schedule (back-off, the end marker's quick queries, the deadline) is checked exactly.
"""

from __future__ import annotations

import pytest

from hpcstagger import slurm
from hpcstagger.errors import LaunchError


class Script:
    """A clock that sleeps by jumping, and a controller whose job ends at ``end_at`` seconds."""

    def __init__(self, end_at: float, *, marker_at: float | None = None) -> None:
        self.now, self.end_at, self.marker_at = 0.0, end_at, marker_at
        self.asked: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.now += seconds

    def records(self, job_id, env=None):
        self.asked.append(round(self.now, 3))
        return [{"JobId": str(job_id), "JobState": "COMPLETED" if self.now >= self.end_at else "RUNNING"}]

    def ended(self) -> bool:
        return self.marker_at is not None and self.now >= self.marker_at


@pytest.fixture
def script(monkeypatch):
    def make(end_at: float, **kw) -> Script:
        s = Script(end_at, **kw)
        monkeypatch.setattr(slurm, "job_records", s.records)
        monkeypatch.setattr(slurm.time, "monotonic", s.monotonic)
        monkeypatch.setattr(slurm.time, "sleep", s.sleep)
        return s
    return make


def test_without_max_poll_the_controller_is_asked_every_poll_seconds(script):
    s = script(end_at=3.0)
    record = slurm.wait_for_job(7, 60, poll=0.2)
    assert record["JobState"] == "COMPLETED"
    gaps = [round(b - a, 3) for a, b in zip(s.asked, s.asked[1:], strict=False)]
    assert set(gaps) == {0.2} and len(s.asked) == 16


def test_queries_back_off_to_max_poll(script):
    s = script(end_at=60.0)
    slurm.wait_for_job(7, 120, poll=0.2, max_poll=2.0)
    gaps = [round(b - a, 3) for a, b in zip(s.asked, s.asked[1:], strict=False)]
    assert gaps[0] == 0.2 and gaps == sorted(gaps) and max(gaps) == 2.0
    assert len(s.asked) < 40  # a fixed 0.2 s would have asked 300 times in the 60 s
    assert s.asked[-1] - 60.0 <= 2.0  # the end is seen within one longest interval


def test_the_end_marker_brings_the_quick_queries_back(script):
    # the script writes its marker at 30.0 s; the controller calls the job ended 0.5 s later
    s = script(end_at=30.5, marker_at=30.0)
    slurm.wait_for_job(7, 120, poll=0.2, max_poll=10.0, ended=s.ended)
    assert s.asked[-1] - 30.5 <= 0.2 + 1e-9  # seen within one short interval, not one of 10 s
    before = [t for t in s.asked if t < 30.0]
    assert len(before) < 15 and before[-1] < 25.0  # backed off while the marker was absent
    after = [t for t in s.asked if t >= 30.0]
    assert after[0] <= 30.2 + 1e-9 and len(after) >= 3  # asked at once, then every poll


def test_a_job_that_ends_without_its_marker_is_still_seen(script):
    s = script(end_at=5.0, marker_at=None)  # killed, say, before the script's last line
    record = slurm.wait_for_job(7, 60, poll=0.2, max_poll=2.0, ended=s.ended)
    assert record["JobState"] == "COMPLETED" and s.asked[-1] - 5.0 <= 2.0


def test_the_deadline_holds_with_a_long_max_poll(script):
    s = script(end_at=1e9)
    with pytest.raises(LaunchError, match="still RUNNING after 7 s"):
        slurm.wait_for_job(7, 7, poll=0.2, max_poll=30.0, ended=s.ended)
    assert s.asked[-1] == pytest.approx(7.0)  # the last query at the deadline, not one interval past it
