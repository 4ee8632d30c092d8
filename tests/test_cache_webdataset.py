"""WebDataset tar shards through the cache: a ``webdataset`` pipeline whose shards are opened through
a ShmCache, with a shuffle buffer and DataLoader workers; every sample once per epoch, byte for
byte, and each shard read from its file once per node (the cache's misses count the reads)."""

from __future__ import annotations

import io
import logging
import re
import subprocess
import sys
import tarfile

import pytest
import torch

from hpcstagger.cache import ShmCache
from hpcstagger.cache import wholefile
from hpcstagger.cache.wholefile import cached_webdataset, shard_samples
from hpcstagger.errors import ConfigError
from support import cache_util
from support.cli import REPO, cli_env

wds = pytest.importorskip("webdataset")  # an optional dependency: where it is missing, these tests skip

SHARDS, PER_SHARD = 3, 8


def write_shards(directory, shards: int = SHARDS, per_shard: int = PER_SHARD) -> dict[str, dict[str, bytes]]:
    """Shards ``train-<s>.tar`` of samples with a ``.bin`` and a ``.cls``; returns every sample's fields by key."""
    directory.mkdir(parents=True, exist_ok=True)
    samples: dict[str, dict[str, bytes]] = {}
    for s in range(shards):
        with tarfile.open(directory / f"train-{s}.tar", "w") as tar:
            for k in range(per_shard):
                key = f"s{s}-{k:03d}"
                fields = {"bin": cache_util.sample(100 * s + k, 200, 3000), "cls": b"%d" % (k % 3)}
                samples[key] = fields
                for ext, data in fields.items():
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return samples


@pytest.fixture
def shards(tmp_path):
    expected = write_shards(tmp_path / "shards")
    urls = sorted(str(p) for p in (tmp_path / "shards").glob("*.tar"))
    return urls, expected


def _check_epoch(got, expected) -> None:
    keys = [s["__key__"] for s in got]
    assert sorted(keys) == sorted(expected), "every sample exactly once"
    for s in got:
        assert {f: bytes(s[f]) for f in ("bin", "cls")} == expected[s["__key__"]], s["__key__"]


@pytest.mark.timeout(240)
def test_a_shuffled_pipeline_with_two_workers_reads_each_shard_once(shm_root, shards):
    urls, expected = shards
    cache = ShmCache("wds", 1 << 20)
    pipeline = wds.DataPipeline(wds.SimpleShardList(urls), wds.split_by_worker, shard_samples(cache),
                                wds.shuffle(10, initial=5, seed=7))
    loader = torch.utils.data.DataLoader(pipeline, batch_size=None, num_workers=2, persistent_workers=True,
                                         multiprocessing_context="fork")
    orders = []
    for epoch in range(2):
        got = list(loader)
        _check_epoch(got, expected)
        orders.append([s["__key__"] for s in got])
        s = cache.stats()
        assert (s["misses"], s["hits"], s["inserts"]) == (SHARDS, epoch * SHARDS, SHARDS), (epoch, s)
    assert all(s["__url__"] in urls for s in got)
    assert s["read_bytes"] == s["insert_bytes"] == sum(len(open(u, "rb").read()) for u in urls)
    first_shard = [k for k in orders[0] if k.startswith("s0-")]
    assert first_shard != sorted(first_shard), "the shuffle buffer shuffles within a worker's shards"


@pytest.mark.timeout(240)
def test_the_fluid_webdataset_reads_through_the_cache(shm_root, shards):
    urls, expected = shards
    cache = ShmCache("fluid", 1 << 20)
    ds = cached_webdataset(cache, urls, shardshuffle=False).shuffle(10).to_tuple("__key__", "bin", "cls")
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
    for epoch in range(2):
        got = [{"__key__": k, "bin": b, "cls": c} for k, b, c in loader]
        _check_epoch(got, expected)
        s = cache.stats()
        assert (s["misses"], s["hits"]) == (SHARDS, epoch * SHARDS), (epoch, s)
    with pytest.raises(ConfigError, match="cache_dir"):
        cached_webdataset(cache, urls, shardshuffle=False, cache_dir="/tmp")


def test_a_shard_larger_than_the_cache_is_read_every_time(shm_root, shards, monkeypatch, caplog):
    urls, expected = shards
    cache = ShmCache("tiny", 4096)  # each shard is larger
    monkeypatch.setattr(wholefile, "_refusals_logged", set())
    pipeline = wds.DataPipeline(wds.SimpleShardList(urls), shard_samples(cache), wds.shuffle(10))
    with caplog.at_level(logging.INFO, logger="hpcstagger.cache.wholefile"):
        for epoch in range(2):
            _check_epoch(list(pipeline), expected)
            s = cache.stats()
            assert (s["misses"], s["hits"], s["inserts"]) == ((epoch + 1) * SHARDS, 0, 0)
    assert len([r for r in caplog.records if "over its capacity" in r.message]) == 1, caplog.text


def test_only_local_shards_and_the_handler_decides_on_failures(shm_root, shards, tmp_path):
    urls, expected = shards
    cache = ShmCache("local", 1 << 20)
    with pytest.raises(ConfigError, match="local files"):
        list(wds.DataPipeline(wds.SimpleShardList(["pipe:cat x.tar"]), shard_samples(cache)))
    missing = str(tmp_path / "missing.tar")
    with pytest.raises(FileNotFoundError):
        list(wds.DataPipeline(wds.SimpleShardList([missing, *urls]), shard_samples(cache)))
    skipped = list(wds.DataPipeline(wds.SimpleShardList([missing, *urls]),
                                    shard_samples(cache, handler=wds.ignore_and_continue)))
    _check_epoch(skipped, expected)
    # file: URLs name local files too
    _check_epoch(list(wds.DataPipeline(wds.SimpleShardList([f"file://{u}" for u in urls]), shard_samples(cache))),
                 expected)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_example_script_and_a_second_process_read_no_shard_again(shm_root, tmp_path):
    shard_dir = tmp_path / "made"
    script = str(REPO / "examples" / "webdataset_shards.py")
    env = dict(cli_env(), HPCSTAGGER_SHM_ROOT=shm_root)

    def run(*args: str) -> list[tuple[int, int, str, int, int]]:
        p = subprocess.run([sys.executable, script, str(shard_dir), "--cache", "example", *args], env=env,
                           cwd=tmp_path, capture_output=True, text=True, timeout=240)
        assert p.returncode == 0, p.stderr
        rx = re.compile(r"epoch \d+: (\d+) samples \((\d+) distinct\), digest (\w+), shards from the file system "
                        r"(\d+), from the cache (\d+)")
        rows = [rx.fullmatch(line) for line in p.stdout.splitlines()]
        assert rows and all(rows), p.stdout
        return [(int(m[1]), int(m[2]), m[3], int(m[4]), int(m[5])) for m in rows if m]

    first = run("--make", "3", "--epochs", "2", "--workers", "2")
    second = run("--epochs", "1", "--workers", "2")  # another process on the node
    samples = 3 * 16
    digests = {r[2] for r in first + second}
    assert len(digests) == 1
    assert [(r[0], r[1], r[3], r[4]) for r in first] == [(samples, samples, 3, 0), (samples, samples, 0, 3)]
    assert [(r[0], r[1], r[3], r[4]) for r in second] == [(samples, samples, 0, 3)]
    # the digest is the shards' own bytes
    got = list(wds.DataPipeline(wds.SimpleShardList(sorted(str(p) for p in shard_dir.glob("*.tar"))),
                                wds.tarfile_to_samples()))
    sys.path.insert(0, str(REPO / "examples"))
    try:
        import webdataset_shards
    finally:
        sys.path.remove(str(REPO / "examples"))
    assert webdataset_shards.digest(got) == digests.pop()
