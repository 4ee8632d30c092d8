"""The cache refuses directories another user could use to read or poison it, and bad names."""

from __future__ import annotations

import os
import stat

import pytest

from hpcstagger import config
from hpcstagger.cache import ShmCache, list_caches
from hpcstagger.errors import CacheError

OTHER_UID = 54321


def _mode(path: str) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_created_directories_and_files_are_private(shm_root):
    root = os.path.join(shm_root, "nested", "root")
    cache = ShmCache("c", 1 << 20, root=root)
    cache.put("k", b"v")
    assert _mode(root) == 0o700
    assert _mode(os.path.join(root, "c")) == 0o700
    for name in os.listdir(os.path.join(root, "c")):
        assert _mode(os.path.join(root, "c", name)) == 0o600, name
    cache.close()


@pytest.mark.parametrize("name", ["", "..", ".", ".hidden", "-x", "a/b", "../escape", "a b", "x" * 129, "é", None, 5])
def test_bad_cache_names_are_refused(shm_root, name):
    with pytest.raises(CacheError, match="invalid cache name"):
        ShmCache(name, 1000)
    assert os.listdir(shm_root) == []


def test_keys_never_touch_paths(shm_root):
    cache = ShmCache("c", 1 << 20)
    for key in ("../../etc/passwd", "/abs/path", "a/b/c", "\0", "..", "x" * 10_000):
        assert cache.put(key, key.encode()[:100])
        assert bytes(cache.get(key)) == key.encode()[:100]
    assert sorted(os.listdir(shm_root)) == ["c"]
    assert sorted(os.listdir(os.path.join(shm_root, "c"))) == ["arena.1", "index.1", "ledger"]


def _make(kind: str, base: str) -> str:
    """Turn directory ``base`` (or a new path there) into an unsafe one of ``kind``."""
    if kind == "symlink":
        real = base + "-real"
        os.mkdir(real, 0o700)
        os.symlink(real, base)
    else:
        os.makedirs(base, mode=0o700, exist_ok=True)
        if kind == "other-owner":
            os.chown(base, OTHER_UID, -1)
        elif kind == "group-writable":
            os.chmod(base, 0o770)
        elif kind == "world-writable":
            os.chmod(base, 0o707)
    return base


CASES = [("symlink", "symbolic link"), ("other-owner", f"owned by uid {OTHER_UID}"),
         ("group-writable", "group- or world-writable"), ("world-writable", "group- or world-writable")]


def _needs_root(kind: str) -> None:
    if kind == "other-owner" and os.geteuid() != 0:
        pytest.skip("making a directory owned by another user needs root")


@pytest.mark.parametrize("kind, message", CASES)
def test_unsafe_root_is_refused(shm_root, kind, message):
    _needs_root(kind)
    root = _make(kind, os.path.join(shm_root, "root"))
    with pytest.raises(CacheError, match=message) as info:
        ShmCache("c", 1 << 20, root=root)
    text = str(info.value)
    assert root in text and ("HPCSTAGGER_SHM_ROOT" in text or "chmod" in text)  # says what to do
    assert not os.path.exists(os.path.join(root, "c"))  # nothing created inside
    with pytest.raises(CacheError, match=message):
        list_caches(root)


@pytest.mark.parametrize("kind, message", CASES)
def test_unsafe_cache_directory_is_refused(shm_root, kind, message):
    _needs_root(kind)
    path = _make(kind, os.path.join(shm_root, "c"))
    with pytest.raises(CacheError, match=message) as info:
        ShmCache("c", 1 << 20)
    assert path in str(info.value)
    assert "ledger" not in os.listdir(path)
    with pytest.raises(CacheError, match=message):
        ShmCache("c", None)  # attaching is refused just the same


def test_unsafe_cache_files_are_refused(shm_root):
    cache = ShmCache("c", 1 << 20)
    cache.close()
    ledger = os.path.join(shm_root, "c", "ledger")
    os.rename(ledger, ledger + ".real")
    os.symlink(ledger + ".real", ledger)
    with pytest.raises(CacheError, match="symbolic link"):
        ShmCache("c", None)
    os.unlink(ledger)
    os.rename(ledger + ".real", ledger)
    os.chmod(ledger, 0o666)
    with pytest.raises(CacheError, match="group- or world-writable"):
        ShmCache("c", None)
    os.chmod(ledger, 0o600)
    if os.geteuid() == 0:
        os.chown(ledger, OTHER_UID, -1)
        with pytest.raises(CacheError, match="owned by uid"):
            ShmCache("c", None)
        os.chown(ledger, 0, -1)
    ShmCache("c", None).close()  # healthy again


def test_default_root_is_per_user_under_dev_shm(monkeypatch):
    monkeypatch.delenv("HPCSTAGGER_SHM_ROOT", raising=False)
    assert config.get("shm_root") == f"/dev/shm/hpcstagger-{os.getuid()}"
    monkeypatch.setenv("HPCSTAGGER_SHM_ROOT", "/dev/shm/elsewhere")
    assert config.get("shm_root") == "/dev/shm/elsewhere"


@pytest.fixture
def full_tmpfs(tmp_path):
    """A real 1 MiB tmpfs (a full /dev/shm in miniature); root only, as in CI."""
    import subprocess

    from support.cli import in_ci

    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if os.geteuid() != 0:
        if in_ci():
            pytest.fail("CI runs as root and must mount the small tmpfs")
        pytest.skip("mounting a tmpfs needs root")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M,mode=1777", "tmpfs", str(mnt)], check=True, timeout=30)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True, timeout=30)


@pytest.mark.parametrize("max_entries, what", [
    (10_000_000, "index.1"),  # the index is allocated at once: fallocate fails
    (None, "cache"),          # a small index fits; writing the ledger fails
])
def test_a_full_device_is_a_clear_error_and_leaves_no_half_written_file(full_tmpfs, max_entries, what):
    root = full_tmpfs / "r"
    with pytest.raises(CacheError, match=r"No space left on device; free space in .*df -h") as err:
        ShmCache("big", 64 << 20, root=root, max_entries=max_entries)
    assert f"cannot create {'cache ' if what == 'cache' else ''}" in str(err.value) and what in str(err.value)
    left = os.listdir(root / "big")
    assert "ledger" not in left and "ledger.tmp" not in left and (what == "cache" or what not in left), left
    # a later creation that fits cleans up what the failed one left and works
    cache = ShmCache("big", 1 << 16, root=root, max_entries=16)
    cache.put("k", b"v")
    assert bytes(cache.get("k")) == b"v"
    cache.close()
