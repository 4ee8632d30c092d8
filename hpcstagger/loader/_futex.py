"""Blocking waits on a 32-bit word of shared memory: Linux futexes through ctypes, polled elsewhere.

A waiter calls :func:`wait` with the word's address and the value it last read there: the kernel
puts it to sleep only if the word still holds that value, until :func:`wake` on the same address
from any process that maps the same file, or the timeout. Both calls are plain ``syscall(2)``
(``FUTEX_WAIT``/``FUTEX_WAKE`` without ``FUTEX_PRIVATE_FLAG``: the words live in ``MAP_SHARED``
mappings of files in /dev/shm, so the kernel keys them by file and offset, across processes).
ctypes drops the GIL for the call, so other threads of the waiter run on.

Every wait is short (the caller's timeout; callers pass tens of ms) and may end early for no
reason (a signal, a wake meant for another waiter): callers re-check their condition in a loop, as
they did when they polled. Where futexes are not available (not Linux, not x86_64 or aarch64, a
big-endian machine, or ``syscall`` refuses), :func:`wait` sleeps the caller's backoff pause instead
and :func:`wake` does nothing.

A 64-bit word is waited on through its low half (the first 4 bytes on a little-endian machine),
which changes whenever the word is advanced by one.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
import sys
import time
from typing import Any

from hpcstagger.comm import Backoff

log = logging.getLogger(__name__)

_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_WAKE_ALL = 0x7FFFFFFF
_MASK32 = 0xFFFFFFFF


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_syscall: Any = None
_nr = -1
_checked = False
_forced_off = False


def _load() -> Any:
    """The libc ``syscall`` function and the futex call's number, or None where futexes are unusable."""
    global _syscall, _nr, _checked
    if _checked:
        return _syscall
    _checked = True
    nr = _SYS_FUTEX.get(platform.machine().lower(), -1)
    if not sys.platform.startswith("linux") or nr < 0 or sys.byteorder != "little":
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    # A wake on a private word nobody waits on: 0 where the call works, -1 (ENOSYS) where it does not.
    probe = ctypes.c_uint32(0)
    if fn(ctypes.c_long(nr), ctypes.c_void_p(ctypes.addressof(probe)), ctypes.c_long(_FUTEX_WAKE),
          ctypes.c_long(1), None, None, ctypes.c_long(0)) < 0:
        return None
    _syscall, _nr = fn, nr
    return fn


def available() -> bool:
    """True where :func:`wait` blocks in the kernel; False where it polls."""
    return not _forced_off and _load() is not None


def set_available(on: bool) -> None:
    """Turn futexes off (``False``: every wait polls, every wake is a no-op) or back on where they work;
    for tests of the polled path."""
    global _forced_off
    _forced_off = not on


def address(words: Any, index: int) -> int:
    """The address of 64-bit word ``index`` of ``words`` (a numpy array over a shared mapping)."""
    return int(words.ctypes.data) + 8 * index


def wait(addr: int, expected: int, timeout: float, backoff: Backoff) -> None:
    """Sleep while the 32-bit word at ``addr`` holds the low 32 bits of ``expected``, at most ``timeout``
    seconds, or until woken. Without futexes, sleep ``backoff``'s next pause (at most ``timeout``).
    Returns in every case (woken, timed out, interrupted, the value already changed): check again."""
    global _forced_off
    if timeout <= 0:
        return
    fn = None if _forced_off else _load()
    if fn is None:
        time.sleep(min(backoff.next_pause(), timeout))
        return
    sec = int(timeout)
    ts = _Timespec(sec, int((timeout - sec) * 1e9))
    if fn(ctypes.c_long(_nr), ctypes.c_void_p(addr), ctypes.c_long(_FUTEX_WAIT),
          ctypes.c_long(expected & _MASK32), ctypes.byref(ts), None, ctypes.c_long(0)) < 0:
        err = ctypes.get_errno()
        if err not in (errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR):  # never seen; poll from now on
            _forced_off = True
            log.warning("futex wait failed (%s); the shared loader polls from now on", os.strerror(err))
            time.sleep(min(backoff.next_pause(), timeout))


def wake(addr: int) -> int:
    """Wake every process waiting on the word at ``addr``; how many were woken (0 without futexes)."""
    fn = None if _forced_off else _load()
    if fn is None:
        return 0
    n = int(fn(ctypes.c_long(_nr), ctypes.c_void_p(addr), ctypes.c_long(_FUTEX_WAKE),
               ctypes.c_long(_WAKE_ALL), None, None, ctypes.c_long(0)))
    return max(n, 0)
