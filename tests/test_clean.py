"""`hpcstagger clean` and `hpcstagger cache clear`: what hpcstagger keeps in /dev/shm, removed for
real, with real processes attached to it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from support.cli import cli_env, run_cli

pytestmark = pytest.mark.timeout(120)

# Makes the items in a process: a cache, a throttle table, a gate file. MODE "die" leaves them as a
# killed rank would (os._exit: no exit handlers); "hold" keeps them in use until stdin closes.
MAKER = textwrap.dedent("""
    import os, sys
    from hpcstagger.cache import ShmCache, ThrottledSource
    from hpcstagger.checkpoint import SharedActivityGate

    class Rows:
        def __len__(self): return 4
        def __getitem__(self, i): return b"x" * 64
        def key(self, i): return i

    root, gates, mode = sys.argv[1:4]
    cache = ShmCache("c1", 1 << 20, root=root)
    cache.put("k", b"v")
    source = ThrottledSource(Rows(), 1e9, shared_name="run-source", state_dir=os.path.join(root, ".throttle"))
    source[0]
    gate = SharedActivityGate(directory=gates)
    print(os.getpid(), gate.path, flush=True)
    if mode == "die":
        os._exit(0)
    sys.stdin.read()
""")


@pytest.fixture
def box():
    """A fresh /dev/shm folder holding a shm root that does not exist yet and a gate folder."""
    top = tempfile.mkdtemp(prefix="hpcs-clean-", dir="/dev/shm")
    gates = os.path.join(top, "gates")
    os.mkdir(gates, 0o700)
    try:
        yield os.path.join(top, "root"), gates
    finally:
        shutil.rmtree(top, ignore_errors=True)


def _make(root, gates, mode):
    proc = subprocess.Popen([sys.executable, "-c", MAKER, root, gates, mode], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=cli_env())
    pid, gate = proc.stdout.readline().split()
    if mode == "die":
        proc.wait(timeout=60)
    return proc, int(pid), gate


def _clean(root, gates, *args):
    return run_cli("clean", "--root", root, "--gate-dir", gates, *args, env=cli_env(), timeout=60)


def test_clean_lists_then_removes_what_dead_processes_left(box):
    root, gates = box
    _, pid, gate = _make(root, gates, "die")
    assert os.path.exists(gate) and os.path.isdir(os.path.join(root, "c1"))
    dry = _clean(root, gates, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.splitlines() == [f"would remove throttle table {root}/.throttle/run-source",
                                       f"would remove cache {root}/c1", f"would remove gate file {gate}"]
    assert os.path.exists(gate) and os.path.isdir(os.path.join(root, "c1"))
    out = _clean(root, gates)
    assert out.returncode == 0 and out.stdout.count("removed ") == 3, out.stdout + out.stderr
    assert not os.path.exists(gate) and not os.path.exists(root) and os.listdir(gates) == []
    assert _clean(root, gates).stdout == "nothing to remove\n"


def test_clean_refuses_while_a_live_process_uses_something(box):
    root, gates = box
    proc, pid, gate = _make(root, gates, "hold")  # a live one attached to the cache, with its gate and table
    try:
        _, _, dead_gate = _make(root, gates, "die")  # a dead rank's gate: unused
        out = _clean(root, gates)
        assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
        assert out.stderr.startswith(f"hpcstagger clean: error: throttle table {root}/.throttle/run-source "
                                     f"(in use by pid {pid} (python")
        assert "and 2 more item(s): stop those processes first, or pass --force" in out.stderr
        assert os.path.isdir(os.path.join(root, "c1"))
        listing = json.loads(_clean(root, gates, "--dry-run", "--json").stdout)
        users = {i["path"]: [u["pid"] for u in i["users"]] for i in listing["items"]}
        assert users[os.path.join(root, "c1")] == [pid] and users[gate] == [pid]
        assert [p for p, v in users.items() if not v] == [dead_gate], listing

        unused = _clean(root, gates, "--unused")
        assert unused.returncode == 0 and unused.stdout.count("removed gate file") == 1, unused.stderr
        assert os.listdir(gates) == [os.path.basename(gate)] and os.path.isdir(os.path.join(root, "c1"))

        forced = _clean(root, gates, "--force")
        assert forced.returncode == 0 and f"removed cache {root}/c1 (in use by pid {pid}" in forced.stdout
        assert not os.path.exists(root) and os.listdir(gates) == []
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
    assert proc.returncode == 0  # the holder went on with its mappings and exited cleanly


def test_cache_clear_leaves_no_empty_root_or_folders(box):
    root, gates = box
    _make(root, gates, "die")
    assert run_cli("clean", "--root", root, "--gate-dir", gates, env=cli_env()).returncode == 0
    code = ("import sys; from hpcstagger.cache import ShmCache; "
            "[ShmCache(n, 1 << 20, root=sys.argv[1]).close() for n in sys.argv[2:]]")
    subprocess.run([sys.executable, "-c", code, root, "c1", "c2"], check=True, timeout=60)
    for sub in (".loader", ".throttle"):
        os.mkdir(os.path.join(root, sub), 0o700)
    out = run_cli("cache", "clear", "c1", "--root", root, env=cli_env())
    assert out.returncode == 0, out.stderr
    assert sorted(os.listdir(root)) == ["c2"]  # the empty folders went; the root holds another cache
    assert run_cli("cache", "clear", "c2", "--root", root, env=cli_env()).returncode == 0
    assert not os.path.exists(root)


RING = textwrap.dedent("""
    import os, sys
    import torch
    from hpcstagger.loader import SharedLoader

    rows = [torch.full((4,), float(i)) for i in range(32)]
    batches = iter(SharedLoader(rows, 4, name="ring1", num_workers=0, root=sys.argv[1]))
    next(batches)
    print(os.getpid(), flush=True)
    sys.stdin.read()
""")


def test_clean_waits_for_a_live_loader_ring(box):
    root, gates = box
    proc = subprocess.Popen([sys.executable, "-c", RING, root], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=cli_env())
    try:
        pid = int(proc.stdout.readline())
        out = _clean(root, gates)
        assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
        assert out.stderr.startswith(f"hpcstagger clean: error: loader ring {root}/.loader/ring1.")
        assert "(in use by pid " in out.stderr and os.path.isdir(os.path.join(root, ".loader"))
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
    assert proc.returncode == 0 and pid == proc.pid
    deadline = time.monotonic() + 30  # the producer lingers a moment after its last consumer
    while _clean(root, gates).returncode != 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not os.path.exists(root)
