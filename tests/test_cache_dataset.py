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
