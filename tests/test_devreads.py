"""The bytes read from a dataset's block device, as the closed loop's watcher counts them: real
files, the kernel's own counters."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from hpcstagger.colocated.devreads import device_counter, device_stat_path
from hpcstagger.colocated.watcher import Watcher


def _spec(path):
    return SimpleNamespace(dataset=SimpleNamespace(path=str(path)), cache=SimpleNamespace(capacity=0))


def test_a_file_on_no_block_device_has_no_count(tmp_path):
    shm = "/dev/shm"
    assert device_stat_path(shm) is None and device_counter(shm) is None  # tmpfs: an anonymous device
    assert device_stat_path(str(tmp_path / "missing")) is None
    look = Watcher(_spec(shm), "", device=True).look(1.0, [])
    assert look.device_bytes is None
    assert Watcher(_spec(tmp_path), "", device=False).device is None  # not asked for


def test_reading_a_file_with_its_pages_dropped_is_counted_on_its_device(tmp_path):
    path = tmp_path / "data.bin"
    if device_stat_path(str(tmp_path)) is None:
        pytest.skip(f"{tmp_path} is on no block device (tmpfs, overlay or a network file system)")
    size = 4 << 20
    with open(path, "wb") as f:
        f.write(os.urandom(size))
        f.flush()
        os.fsync(f.fileno())
    watcher = Watcher(_spec(path), "", device=True)
    assert watcher.device is not None
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages: dropped
        before = watcher.look(0.0, []).device_bytes
        got = 0
        while chunk := os.read(fd, 1 << 20):
            got += len(chunk)
        after = watcher.look(1.0, []).device_bytes
    finally:
        os.close(fd)
    assert got == size and before is not None and after is not None
    assert after - before >= 0.9 * size  # others may read the device too: at least our bytes


def test_the_closed_loop_fits_to_the_device_where_the_page_cache_is_the_scenarios_cache(tmp_path, shm_root):
    """The scenario says which cache the model's source sits behind: a shared cache (the device is
    not asked) or the page cache (``coalesce``, with its readahead): then the device's bytes."""
    from dataclasses import replace

    from hpcstagger.colocated.watcher import _steering
    from hpcstagger.spec.jobspec import Spec
    from hpcstagger.stagger.delays import plan_run
    from support.spec_util import write_spec

    spec_path = write_spec(tmp_path, shm_root)

    def steering():
        spec = Spec.from_toml(spec_path)
        plan = plan_run(spec, list(spec.job_names), {}, "plan")
        plan = replace(plan, steer=plan.steer or {"interval": 1.0, "horizon": 10.0, "max_delay": None,
                                                  "min_delay": 0.0})
        return _steering(SimpleNamespace(spec=spec, plan=plan, jobs={n: [i] for i, n in enumerate(spec.job_names)},
                                         run_dir=""))

    st = steering()
    assert not st.device and st._readahead == 1.0
    scenario = tmp_path / "s.toml"
    text = scenario.read_text().replace("capacity = 2.0e5", 'capacity = 2.0e5\npolicy = "minio"\ncoalesce = true\n'
                                                            "readahead = 4.0")
    scenario.write_text(text)
    st = steering()
    assert st.device and st._readahead == 4.0


@pytest.mark.parametrize("knob, told, counts", [("1", True, True), ("0", True, False), ("1", False, False)])
def test_the_watcher_has_reads_counted_in_flight_unless_steer_count_is_off_or_it_is_told_not_to(
        shm_root, monkeypatch, knob, told, counts):
    import time

    from hpcstagger.cache import ShmCache

    monkeypatch.setenv("HPCSTAGGER_STEER_COUNT", knob)
    cache = ShmCache("counted", 1 << 20, root=shm_root)
    spec = SimpleNamespace(dataset=SimpleNamespace(path=""), cache=SimpleNamespace(capacity=1 << 20, name="counted",
                                                                                    root=shm_root))
    watcher = Watcher(spec, "", count=told)
    try:
        assert watcher.count is counts
        look = watcher.look(0.0, [])  # the watcher's look asks for counting, where the knob and the host let it
        assert look.flight is not None and sum(look.flight) == 0.0
        with cache.reading():  # a job's read from the source
            time.sleep(0.05)
        counted = sum(watcher.look(0.1, []).flight or [])
        if counts:
            assert counted >= 0.04
        else:
            assert counted == 0.0
    finally:
        watcher.close()
        cache.destroy()


@pytest.mark.parametrize("workers, main", [((2, 4), False), ((0, 2), True), ((0, 0), True)])
def test_the_host_counts_reads_in_flight_only_where_no_job_loads_in_its_main_process(workers, main):
    from hpcstagger.colocated.watcher import _main_loading
    from support.model_scenarios import scenario

    sc = scenario(jobs=((0.002, 1), (0.003, 1))).to_dict()
    for job, w in zip(sc["job"], workers, strict=True):
        job["workers"] = w
    session = SimpleNamespace(plan=SimpleNamespace(scenario=sc))
    assert _main_loading(session) is main
    assert _main_loading(SimpleNamespace(plan=SimpleNamespace(scenario={}))) is False  # no scenario: count
