"""``hpcstagger cache ls | stats | clear``: real subprocesses against a private shm root."""

from __future__ import annotations

import json
import multiprocessing as mp
import os

import pytest

from hpcstagger.cache import ShmCache
from support.cli import run_cli


def _fill(name: str, n: int = 3) -> ShmCache:
    cache = ShmCache(name, 1 << 20)
    for k in range(n):
        cache.put(k, b"x" * 1000)
        cache.get(k)
    cache.get("missing")
    return cache


def test_ls_and_stats(shm_root):
    out = run_cli("cache", "ls", "--root", shm_root)
    assert out.returncode == 0 and out.stdout.strip() == f"no caches under {shm_root}"
    _fill("alpha").close()
    _fill("beta", 5).close()
    os.mkdir(os.path.join(shm_root, "not-a-cache"), 0o700)  # no ledger: not listed
    out = run_cli("cache", "ls", "--root", shm_root)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[:2] == ["NAME", "POLICY"] and [ln.split()[0] for ln in lines[1:]] == ["alpha", "beta"]
    doc = json.loads(run_cli("cache", "ls", "--json", "--root", shm_root).stdout)
    assert doc["root"] == shm_root and [c["name"] for c in doc["caches"]] == ["alpha", "beta"]
    out = run_cli("cache", "stats", "beta", "--json", "--root", shm_root)
    s = json.loads(out.stdout)  # exactly one JSON document
    assert (s["entries"], s["bytes_used"], s["hits"], s["misses"], s["lookups"]) == (5, 5000, 5, 1, 6)
    assert s["capacity_bytes"] == 1 << 20 and s["policy"] == "minio" and s["processes"] == 0
    text = run_cli("cache", "stats", "beta", "--root", shm_root).stdout
    assert "hit_rate" in text and "83.3%" in text


def test_shm_root_from_the_environment(shm_root):
    _fill("envcache").close()
    from support.cli import cli_env

    out = run_cli("cache", "ls", env=cli_env(HPCSTAGGER_SHM_ROOT=shm_root))
    assert out.returncode == 0 and "envcache" in out.stdout


@pytest.mark.parametrize("action", ["stats", "clear"])
def test_unknown_name_is_one_line_and_exit_1(shm_root, action):
    out = run_cli("cache", action, "nope", "--root", shm_root)
    assert out.returncode == 1
    assert len(out.stderr.strip().splitlines()) == 1 and "no cache named 'nope'" in out.stderr
    out = run_cli("cache", action, "../etc", "--root", shm_root)
    assert out.returncode == 1 and "invalid cache name" in out.stderr


def test_unsafe_root_is_one_line_and_exit_1(shm_root):
    os.chmod(shm_root, 0o777)
    out = run_cli("cache", "ls", "--root", shm_root)
    assert out.returncode == 1 and "group- or world-writable" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def _hold(name: str, root: str, ready, release) -> None:
    cache = ShmCache(name, None, root=root)
    cache.get(0)
    ready.set()
    release.wait(60)
    assert cache.get(0) is None  # it was cleared under us; we carry on
    assert cache.put(0, b"again")


@pytest.mark.timeout(120)
def test_clear_removes_an_unused_cache_and_empties_a_used_one(shm_root):
    _fill("gone").close()
    out = run_cli("cache", "clear", "gone", "--root", shm_root)
    assert out.returncode == 0 and "removed cache 'gone'" in out.stdout
    assert not os.path.exists(shm_root)  # nothing left in it: the root goes too (the next cache makes it again)
    _fill("used").close()
    ctx = mp.get_context("fork")
    ready, release = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_hold, args=("used", shm_root, ready, release))
    proc.start()
    try:
        assert ready.wait(30)
        out = run_cli("cache", "clear", "used", "--root", shm_root)
        assert out.returncode == 0 and "kept it because 1 live process(es) use it" in out.stdout
    finally:
        release.set()
        proc.join(30)
    assert proc.exitcode == 0
    s = ShmCache("used", None).stats()
    assert s["entries"] == 1 and s["generation"] == 2


def test_clear_removes_a_damaged_cache(shm_root):
    _fill("broken").close()
    os.unlink(os.path.join(shm_root, "broken", "ledger"))
    out = run_cli("cache", "stats", "broken", "--root", shm_root)
    assert out.returncode == 1 and "incomplete" in out.stderr
    out = run_cli("cache", "clear", "broken", "--root", shm_root)
    assert out.returncode == 0 and "removed damaged cache 'broken'" in out.stdout
    assert not os.path.exists(shm_root)


def test_unknown_name_when_no_cache_was_ever_created(tmp_path):
    missing_root = tmp_path / "never-created"
    out = run_cli("cache", "stats", "nope", "--root", str(missing_root))
    assert out.returncode == 1
    assert "no cache named 'nope'" in out.stderr and "does not exist" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert not missing_root.exists()  # looking a cache up never creates the root
