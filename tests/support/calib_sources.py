"""Test-only sources for calibration: real HDF5 rows behind an emulated shared source.

``ThrottledH5Source`` reads row i of an HDF5 dataset with h5py (the file is opened lazily in each
process) and then holds the reader for as long as a source whose aggregate bandwidth is
``bandwidth[k-1]`` with k concurrent readers would: processor sharing, re-evaluated every 2 ms
from a counter of active readers shared by all processes. It is picklable, so calibrate can hand
it to spawned reader processes.
"""

from __future__ import annotations

import time
from typing import Any


class ThrottledH5Source:
    def __init__(self, path: str, dataset: str, bandwidth: list[float], active: Any):
        self.path, self.dataset, self.bandwidth, self.active = path, dataset, list(bandwidth), active
        self._file = None
        self._len = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_file"] = None
        return state

    def _ds(self) -> Any:
        if self._file is None:
            import h5py

            self._file = h5py.File(self.path, "r")
        return self._file[self.dataset]

    def __len__(self) -> int:
        if self._len is None:
            self._len = int(self._ds().shape[0])
        return self._len

    def key(self, i: int) -> str:
        return f"{self.dataset}/{i}"

    def __getitem__(self, i: int) -> bytes:
        data = self._ds()[i].tobytes()
        self._throttle(len(data))
        return data

    def _throttle(self, nbytes: float) -> None:
        with self.active.get_lock():
            self.active.value += 1
        try:
            left = float(nbytes)
            while left > 0:
                k = max(1, self.active.value)
                rate = self.bandwidth[min(k, len(self.bandwidth)) - 1] / k
                chunk = min(left, rate * 0.002)
                time.sleep(chunk / rate)
                left -= chunk
        finally:
            with self.active.get_lock():
                self.active.value -= 1


class DictCache:
    """A dict-backed stand-in for a cache with put/get."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def put(self, key: str, data: bytes) -> None:
        self.data[key] = bytes(data)

    def get(self, key: str) -> bytes | None:
        return self.data.get(key)


def sleepy_step(per_sample: float):
    """A job step that takes ``per_sample`` seconds per sample (and touches the bytes)."""
    def step(samples: list[bytes]) -> None:
        assert all(isinstance(s, bytes) and s for s in samples)
        time.sleep(per_sample * len(samples))

    return step


def make_step():
    """A "module:function" factory for the CLI: 2 ms per sample."""
    return sleepy_step(0.002)


SOURCE_ENV = "HPCSTAGGER_TEST_H5"


def make_source():
    """A "module:function" factory for the CLI: the HDF5 file named by $HPCSTAGGER_TEST_H5."""
    import multiprocessing
    import os

    path = os.environ[SOURCE_ENV]
    return ThrottledH5Source(path, "x", [4.0e7, 2.4e7], multiprocessing.get_context("spawn").Value("i", 0))


class FailsInReaders:
    """Reads fine in the process that made it, fails in any other (the reader processes)."""

    def __init__(self) -> None:
        import os

        self.owner = os.getpid()

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> bytes:
        import os

        if os.getpid() != self.owner:
            raise OSError("storage unreachable from this process")
        return b"x" * 1000


class BusySource:
    """``n`` samples of ``size`` bytes, each read spinning the CPU for ``busy_s`` seconds: readers
    that need a core each, so that more readers than cores wait their turn to run."""

    def __init__(self, n: int = 4000, size: int = 4096, busy_s: float = 0.002):
        self.n, self.size, self.busy_s = n, size, busy_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> bytes:
        t = time.perf_counter()
        while time.perf_counter() - t < self.busy_s:
            pass
        return bytes([i % 256]) * self.size

    def key(self, i: int) -> str:
        return f"busy/{i}"
