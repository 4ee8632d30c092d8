"""Co-located run tests (cold and warm starts, the sweep): a spec of two tiny jobs with a shared
cache under a given shm root, a scenario and a directory of dataset files; filling that cache."""

from __future__ import annotations

import os
import textwrap

from hpcstagger.cache import ShmCache

__all__ = ["CAPACITY", "write_spec", "fill", "fill_dataset"]

WORK = textwrap.dedent("""
    import time
    from hpcstagger import init
    s = init()
    time.sleep(0.3)
    s.finish()
""")

SCENARIO = textwrap.dedent("""
    [dataset]
    samples = 200
    sample_bytes = 1000
    [storage]
    bandwidth = [1.0e6, 6.0e5]
    [cache]
    capacity = 2.0e5
    [[job]]
    name = "a"
    sample_time = 0.001
    [[job]]
    name = "b"
    sample_time = 0.001
""")

CAPACITY = 1 << 20


def write_spec(tmp_path, root: str, *, scenario: bool = True, jobs: tuple[str, ...] = ("a", "b"), files: int = 3,
               size: int = 4096) -> str:
    """A spec of tiny jobs with a cache under ``root`` and a directory of ``files`` dataset files of
    ``size`` bytes."""
    (tmp_path / "work.py").write_text(WORK)
    (tmp_path / "s.toml").write_text(SCENARIO)
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    for i in range(files):
        (data / f"{i:04d}.bin").write_bytes(os.urandom(size))
    job_tables = "".join(f'[[job]]\nname = "{n}"\ncommand = "python work.py"\n' for n in jobs)
    path = tmp_path / "spec.toml"
    path.write_text(textwrap.dedent(f"""
        [run]
        name = "warm"
        timeout = 120
        [dataset]
        path = "data"
        [cache]
        capacity = {CAPACITY}
        root = "{root}"
        [plan]
        mode = "{'plan' if scenario else 'simultaneous'}"
        {'scenario = "s.toml"' if scenario else ''}
    """) + job_tables)
    return str(path)


def fill(root: str, n: int, name: str = "warm") -> None:
    cache = ShmCache(name, CAPACITY, root=root)
    try:
        for k in range(n):
            assert cache.put(k, bytes(1000))
    finally:
        cache.close()


def fill_dataset(root: str, spec_path: str, samples: range, name: str = "warm") -> None:
    """Put the spec's dataset samples ``samples`` in cache ``name`` under ``root``, keyed as the jobs key them."""
    from hpcstagger.spec.jobspec import Spec

    source = Spec.from_toml(spec_path).base_source()
    cache = ShmCache(name, CAPACITY, root=root)
    try:
        for i in samples:
            assert cache.put(source.key(i), source[i])
    finally:
        cache.close()
