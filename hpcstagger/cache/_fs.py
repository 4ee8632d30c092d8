"""File-system safety and process identity for the shared cache and the throttle emulator.

A cache in /dev/shm is shared by every process of one user on the node. Another user must not be
able to read or poison it, so every directory on the way is checked after it is opened (no race
between the check and the use): it is a real directory (not a symlink), owned by this user, and
neither group- nor world-writable. Directories hpcstagger creates get mode 0700.

Processes are identified by (pid, start time) so that a recycled pid is not mistaken for the
process that held a reservation or a reader slot before it died.
"""

from __future__ import annotations

import os
import re
import stat

from hpcstagger.errors import CacheError

__all__ = ["validate_name", "open_secure_dir", "open_secure_subdir", "check_secure_file", "symlink_error",
           "self_identity", "start_time", "alive"]

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_ROOT_HINT = "set HPCSTAGGER_SHM_ROOT or pass root= to use another directory"


def validate_name(name: object, what: str = "cache name") -> str:
    """Return ``name`` if it is 1-128 letters, digits, '.', '_' or '-' not starting with '.', '_' or '-'."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise CacheError(f"invalid {what} {name!r}: use 1-128 letters, digits, '.', '_' or '-', "
                         "starting with a letter or digit")
    return name


def _owner(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (KeyError, ImportError):
        return f"uid {uid}"


def _check(st: os.stat_result, path: str, what: str, kind: str) -> None:
    me = os.geteuid()
    if st.st_uid != me:
        raise CacheError(f"{what} {path} is owned by {_owner(st.st_uid)}, not by you ({_owner(me)}); "
                         f"another user could read or poison it. Use a {kind} of your own: {_ROOT_HINT}")
    if st.st_mode & 0o022:
        raise CacheError(f"{what} {path} is group- or world-writable (mode {stat.S_IMODE(st.st_mode):04o}); "
                         f"other users could replace what it holds. Run 'chmod go-w {path}' "
                         f"(hpcstagger creates it 0700), or {_ROOT_HINT}")


def symlink_error(path: str, what: str) -> CacheError:
    return CacheError(f"{what} {path} is a symbolic link; whoever controls the link decides where the "
                      f"data goes, so hpcstagger refuses it. Remove the link, or {_ROOT_HINT}")


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_secure_dir(path: str, *, create: bool, what: str) -> int:
    """Open directory ``path`` (creating it 0700 if asked) after checking it is safe; return its fd.

    Raises CacheError if it is missing (and ``create`` is false), is a symlink or not a directory,
    belongs to another user, or is group- or world-writable.
    """
    path = os.path.abspath(path)
    if create:
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
        except FileExistsError:
            pass  # a non-directory; reported below
        except OSError as exc:
            raise CacheError(f"cannot create {what} {path}: {exc.strerror}; {_ROOT_HINT}") from None
    return _open_checked_dir(path, None, path, what, f"remove it, or {_ROOT_HINT}")


def open_secure_subdir(parent_fd: int, name: str, parent_path: str, *, create: bool, what: str) -> int:
    """Like :func:`open_secure_dir` for ``name`` inside the already-checked directory ``parent_fd``."""
    path = os.path.join(parent_path, name)
    if create:
        try:
            os.mkdir(name, 0o700, dir_fd=parent_fd)
        except FileExistsError:
            pass
        except OSError as exc:
            raise CacheError(f"cannot create {what} {path}: {exc.strerror}") from None
    return _open_checked_dir(name, parent_fd, path, what, "remove it")


def _open_checked_dir(name: str, dir_fd: int | None, path: str, what: str, not_dir_fix: str) -> int:
    """Open directory ``name`` (relative to ``dir_fd`` when given) without following a link, and
    check owner and mode on the open descriptor; ``path`` names it in errors."""
    try:
        lst = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        raise CacheError(f"{what} {path} does not exist") from None
    if stat.S_ISLNK(lst.st_mode):
        raise symlink_error(path, what)
    if not stat.S_ISDIR(lst.st_mode):
        raise CacheError(f"{what} {path} is not a directory; {not_dir_fix}")
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (40, 20):  # ELOOP, ENOTDIR: swapped for a link since the stat
            raise symlink_error(path, what) from None
        raise CacheError(f"cannot open {what} {path}: {exc.strerror}") from None
    try:
        _check(os.fstat(fd), path, what, "directory")
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_secure_file(fd: int, path: str, what: str) -> os.stat_result:
    """Check an opened file is a regular file of this user, not group/world-writable; return its stat."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise CacheError(f"{what} {path} is not a regular file; remove it")
    _check(st, path, what, "file")
    return st


# ---- process identity ------------------------------------------------------------------------

def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) of a live or zombie process, None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return ("?", 0)
    fields = text[text.rindex(b")") + 2:].split()
    return fields[0].decode(), int(fields[19])


_identity: tuple[int, int] | None = None


def self_identity() -> tuple[int, int]:
    """(pid, start time) of this process; recomputed after a fork."""
    global _identity
    pid = os.getpid()
    if _identity is None or _identity[0] != pid:
        info = _proc_stat(pid)
        _identity = (pid, info[1] if info else 0)
    return _identity


def start_time(pid: int) -> int:
    """The start time (clock ticks since boot) of process ``pid``; 0 if it is gone."""
    info = _proc_stat(pid)
    return info[1] if info else 0


def alive(pid: int, start: int) -> bool:
    """True if process ``pid`` exists, is not a zombie, and (when ``start`` is set) started at ``start``."""
    if pid <= 0:
        return False
    info = _proc_stat(pid)
    if info is None:
        return False
    state, started = info
    if state in ("Z", "X", "x"):
        return False
    return not (start and started and started != start)
