"""CachedDataset under a torch DataLoader with worker processes (fork and spawn)."""

from __future__ import annotations

import os

import pytest

from hpcstagger.cache import CachedDataset, DirectorySource, ShmCache
from support import cache_util

N = 24


@pytest.fixture
def data_dir(tmp_path):
    root = tmp_path / "samples"
    root.mkdir()
    for i in range(N):
        (root / f"{i:03d}.bin").write_bytes(cache_util.sample(i, 1000, 20_000))
    return root


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_with_workers_reads_through_the_cache(shm_root, data_dir, tmp_path, context):
    import torch

    source = DirectorySource(data_dir)
    cache = ShmCache("dl", 1 << 20)
    hook_log = tmp_path / "hook.log"
    dataset = CachedDataset(source, cache, cache_util.byte_sum, source_read_hook=cache_util.FileHook(str(hook_log)))
    expected = torch.tensor([sum(source[i]) for i in range(N)])
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, num_workers=2, multiprocessing_context=context,
                                         persistent_workers=True)
    for epoch in range(2):
        got = torch.cat([batch for batch in loader])
        assert torch.equal(got, expected), f"epoch {epoch}: wrong samples"
    s = cache.stats()
    assert (s["misses"], s["hits"], s["inserts"], s["lookups"]) == (N, N, N, 2 * N)
    # every source read was counted, in the workers, with its bytes and a positive time
    assert s["read_bytes"] == sum(len(source[i]) for i in range(N)) == s["insert_bytes"]
    assert s["read_seconds"] > 0
    lines = hook_log.read_text().split("\n")[:-1]
    # the hook wrapped every source read (the N misses of epoch 1), in the worker processes; two
    # workers read at once, so only each worker's own calls strictly alternate
    per_pid: dict[int, list[str]] = {}
    for w in lines:
        word, pid = w.split()[:2]
        per_pid.setdefault(int(pid), []).append(word)
    assert all(words == ["enter", "exit"] * (len(words) // 2) for words in per_pid.values()), per_pid
    assert sum(len(words) for words in per_pid.values()) == 2 * N
    assert os.getpid() not in per_pid
    # without a transform the dataset returns bytes; hits and misses alike
    plain = CachedDataset(source, cache)
    assert plain[3] == source[3] and isinstance(plain[3], bytes)


def test_cached_dataset_hook_exits_when_the_source_fails(shm_root):
    class Boom:
        def __len__(self):
            return 1

        def __getitem__(self, i):
            raise OSError("remote storage unavailable")

        def key(self, i):
            return i

    class Hook:
        def __init__(self):
            self.calls = []

        def enter(self):
            self.calls.append("enter")

        def exit(self):
            self.calls.append("exit")

    hook = Hook()
    ds = CachedDataset(Boom(), ShmCache("h", 1 << 20), source_read_hook=hook)
    with pytest.raises(OSError, match="remote storage unavailable"):
        ds[0]
    assert hook.calls == ["enter", "exit"]
    assert len(ds) == 1


def test_source_reads_are_counted_with_their_bytes_and_time(shm_root):
    class Slow:
        def __len__(self):
            return 3

        def __getitem__(self, i):
            import time

            time.sleep(0.02)
            return bytes(100 * (i + 1))

        def key(self, i):
            return i

    cache = ShmCache("reads", 1 << 20)
    ds = CachedDataset(Slow(), cache)
    for i in (0, 1, 2, 0, 1):  # three misses, then two hits
        ds[i]
    s = cache.stats()
    assert (s["misses"], s["hits"]) == (3, 2)
    assert s["read_bytes"] == 100 + 200 + 300
    assert 0.06 <= s["read_seconds"] < 2.0
    cache.count_read(50, 0.5)
    s2 = cache.stats()
    assert s2["read_bytes"] == 650 and abs(s2["read_seconds"] - s["read_seconds"] - 0.5) < 1e-6
