"""A real cgroup v1 memory group for tests that need a memory limit (root only)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator

V1_MEMORY = "/sys/fs/cgroup/memory"


def v1_memory() -> str | None:
    """The writable cgroup v1 memory hierarchy, or None (not root, or cgroup v2 only)."""
    ok = os.path.isfile(os.path.join(V1_MEMORY, "memory.limit_in_bytes")) and os.access(V1_MEMORY, os.W_OK)
    return V1_MEMORY if ok else None


@contextlib.contextmanager
def memory_group(limit_bytes: int, tag: str) -> Iterator[tuple[str, Callable[[], None]]]:
    """A fresh memory group limited to ``limit_bytes``: its directory, and a ``preexec_fn`` that puts
    the child into it. Removed afterwards (once its members are gone)."""
    group = os.path.join(v1_memory() or V1_MEMORY, f"hpcstagger-test-{tag}-{os.getpid()}")
    os.mkdir(group)
    try:
        with open(os.path.join(group, "memory.limit_in_bytes"), "w") as f:
            f.write(str(limit_bytes))

        def join() -> None:
            with open(os.path.join(group, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))

        yield group, join
    finally:
        for _ in range(50):
            try:
                os.rmdir(group)
                break
            except OSError:
                time.sleep(0.1)
