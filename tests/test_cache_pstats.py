"""The partitioned cache's per-process stats files: ended processes' files are folded into one and
removed when the stats are read, the totals stay right, and ``cache clear`` removes them with the
cache. Real processes (fork), real /dev/shm; no MPI."""

from __future__ import annotations

import os

from hpcstagger.cache import _pstats
from hpcstagger.cache.admin import clear_cache
from hpcstagger.cache.store import ShmCache


def _count_in_child(root: str, name: str, **counts: int) -> int:
    """A process that counts into its own stats file and ends; returns its pid."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            c = _pstats.Counters(root, name, {"node": 0, "nodes": 2})
            for field, n in counts.items():
                c.add(field, n)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    return pid


def _pid_files(root: str, name: str) -> list[str]:
    return sorted(e for e in os.listdir(_pstats.stats_dir(root, name)) if e.isdigit())


def test_ended_processes_files_are_folded_once_and_the_totals_stay_right(shm_root):
    mine = _pstats.Counters(shm_root, "p", {"node": 0, "nodes": 2})
    mine.add("local_hits", 5)
    dead = [_count_in_child(shm_root, "p", local_hits=3, remote_hits=2),
            _count_in_child(shm_root, "p", remote_hits=4, source_reads=1)]
    assert set(map(str, dead)) <= set(_pid_files(shm_root, "p"))
    first = _pstats.totals(shm_root, "p")
    assert first is not None
    assert (first["local_hits"], first["remote_hits"], first["source_reads"]) == (8, 6, 1)
    assert first["partition_nodes"] == 2
    assert _pid_files(shm_root, "p") == [str(os.getpid())]  # the ended ones were pruned; the live one stays
    mine.add("local_hits", 1)
    again = _pstats.totals(shm_root, "p")
    assert (again["local_hits"], again["remote_hits"], again["source_reads"]) == (9, 6, 1)  # counted once
    assert _pstats.prune(shm_root, "p") == 0
    dead.append(_count_in_child(shm_root, "p", remote_hits=10))
    assert _pstats.prune(shm_root, "p") == 1
    assert _pstats.totals(shm_root, "p")["remote_hits"] == 16


def test_a_file_left_under_this_pid_is_folded_before_it_is_reused(shm_root):
    """A pid file whose writer has ended, found by a new process that got the same pid: its old
    counts are kept, and the new process counts from zero in a file of its own."""
    path = _pstats.stats_dir(shm_root, "r")
    os.makedirs(path, mode=0o700)
    words = bytearray(8 * 16)
    words[0:8] = (7).to_bytes(8, "little")  # local_hits = 7, start time 0: a file from before start times
    with open(os.path.join(path, str(os.getpid())), "wb") as f:
        f.write(words)
    c = _pstats.Counters(shm_root, "r", {"node": 0, "nodes": 1})
    assert c.snapshot()["local_hits"] == 0
    c.add("local_hits", 2)
    assert _pstats.totals(shm_root, "r")["local_hits"] == 9


def test_cache_clear_removes_the_stats_with_the_cache(shm_root):
    ShmCache("gone", 1 << 20, root=shm_root).close()
    _count_in_child(shm_root, "gone", local_hits=3)
    assert _pstats.totals(shm_root, "gone")["local_hits"] == 3
    assert clear_cache("gone", shm_root)["action"] == "removed"
    assert not os.path.exists(_pstats.stats_dir(shm_root, "gone"))
    assert _pstats.totals(shm_root, "gone") is None  # a new cache of that name starts from zero


def test_cache_clear_of_a_cache_in_use_keeps_the_counts_and_prunes_the_ended(shm_root):
    cache = ShmCache("used", 1 << 20, root=shm_root)
    try:
        cache.put("k", b"v")  # this process is attached: the cache is cleared, not removed
        mine = _pstats.Counters(shm_root, "used", {"node": 0, "nodes": 1})
        mine.add("source_reads", 2)
        _count_in_child(shm_root, "used", source_reads=3)
        assert clear_cache("used", shm_root)["action"] == "cleared"
        assert _pid_files(shm_root, "used") == [str(os.getpid())]
        assert _pstats.totals(shm_root, "used")["source_reads"] == 5
    finally:
        cache.close()
