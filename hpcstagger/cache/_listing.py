"""Listing a directory dataset with each file's identity, and the identity of a file's version.

A source keys its samples in the shared cache under the file's path *and* an identity token that
changes whenever the file's data can have changed, so that a job over changed data misses and reads
the new bytes instead of being served the old ones:

- a file's token is an xxh3-64 hash of its inode, size, mtime and ctime (nanoseconds). Replacing a
  file (a rename, as rsync and most writers do) gives a new inode; rewriting or growing it in place
  moves mtime; restoring mtime afterwards (``touch -d``, ``os.utime``) still moves ctime, which no
  user process can set back.
- the device number is left out on purpose: it is assigned per mount and can differ between the
  nodes that mount one network file system, and a partitioned cache needs every node to compute the
  same key for a sample. The real path stands in for it.

:func:`list_files` walks the tree with ``os.scandir`` and one ``stat`` per matching file (the stat
that tells a regular file from anything else anyway), and matches names with pathlib's glob rules,
so the listing is the one ``Path.glob(pattern)`` gives, filtered to regular files.
:func:`shared_listing` lets the processes of one run share one listing through a file.
"""

from __future__ import annotations

import fcntl
import fnmatch
import json
import logging
import os
import re
import stat
import struct
import sys
import time
from array import array

import xxhash

__all__ = ["list_files", "file_token", "stat_token", "glob_regex", "shared_listing", "read_listing", "write_listing"]

log = logging.getLogger(__name__)

_PACK = struct.Struct("<QQqq").pack


def stat_token(st: os.stat_result) -> int:
    """The identity token of one version of a file, from its stat (see the module's docstring)."""
    return xxhash.xxh3_64_intdigest(_PACK(st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))


def file_token(path: str | os.PathLike[str]) -> int:
    """:func:`stat_token` of ``path`` (its target, for a symlink); OSError if it cannot be stat'ed."""
    return stat_token(os.stat(path))


def _segment_regex(seg: str) -> str:
    """One path segment of a glob pattern as a regex that never crosses a ``/``."""
    out, i, n = [], 0, len(seg)
    while i < n:
        c = seg[i]
        i += 1
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            j = i
            if j < n and seg[j] == "!":
                j += 1
            if j < n and seg[j] == "]":
                j += 1
            while j < n and seg[j] != "]":
                j += 1
            if j >= n:  # no closing bracket: a literal '['
                out.append("\\[")
                continue
            # the set itself as fnmatch (pathlib's matcher) reads it; never matching a '/'
            inner = re.fullmatch(r"\(\?s:(.*)\)\\Z", fnmatch.translate(seg[i - 1:j + 1]), re.S)
            out.append("(?!/)" + (inner.group(1) if inner else re.escape(seg[i - 1:j + 1])))
            i = j + 1
        else:
            out.append(re.escape(c))
    return "".join(out)


def glob_regex(pattern: str) -> re.Pattern[str]:
    """A compiled regex that fully matches the relative POSIX paths ``Path.glob(pattern)`` yields:
    ``**`` is zero or more directories, ``*``, ``?`` and ``[...]`` match within one name."""
    segs = [s for s in pattern.split("/") if s not in ("", ".")]
    parts = []
    for k, seg in enumerate(segs):
        last = k == len(segs) - 1
        if seg == "**":
            parts.append("(?:[^/]+/)*")
        else:
            parts.append(_segment_regex(seg) + ("" if last else "/"))
    return re.compile("".join(parts))


def _fixed_prefix(pattern: str) -> tuple[str, int | None]:
    """The leading segments of ``pattern`` without wildcards (where the walk can start), and the
    depth below it that a match can have (None with ``**``: any depth)."""
    segs = [s for s in pattern.split("/") if s not in ("", ".")]
    fixed: list[str] = []
    for s in segs[:-1]:
        if any(ch in s for ch in "*?["):
            break
        fixed.append(s)
    rest = segs[len(fixed):]
    return "/".join(fixed), (None if "**" in rest else len(rest))


def list_files(root: str, pattern: str) -> tuple[list[str], array]:
    """Every regular file under ``root`` whose relative POSIX path matches ``pattern``, sorted, with
    each file's identity token (:func:`stat_token`, an ``array('Q')`` in the same order). Symbolic
    links to files count as their targets; symbolic links to directories are not followed."""
    rx = glob_regex(pattern)
    prefix, depth = _fixed_prefix(pattern)
    found: list[tuple[str, int]] = []
    start = os.path.join(root, prefix) if prefix else root
    stack = [(start, prefix, 0)]
    while stack:
        path, rel, level = stack.pop()
        try:
            it = os.scandir(path)
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            continue
        with it:
            for entry in it:
                name = f"{rel}/{entry.name}" if rel else entry.name
                try:
                    is_dir = entry.is_dir(follow_symlinks=False)
                except OSError:
                    continue
                if is_dir:
                    if depth is None or level + 1 < depth:
                        stack.append((entry.path, name, level + 1))
                    continue
                if rx.fullmatch(name) is None:
                    continue
                try:
                    st = entry.stat()  # follows a symlink to its target, as Path.is_file() does
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    found.append((name, stat_token(st)))
    found.sort()
    return [f for f, _ in found], array("Q", (t for _, t in found))


# ---- a listing shared by the processes of one run -----------------------------------------------
# One file: a JSON header line, then the names joined by NUL (never in a name) and the tokens as
# little-endian uint64. The header carries the root, the pattern, the count and an xxh3-64 of the
# body, so a file of another dataset, a torn write or a damaged file is never taken for the listing.
_MAGIC = "hpcstagger-listing"


def write_listing(path: str, root: str, pattern: str, files: list[str], tokens: array) -> None:
    """Write a listing to ``path`` atomically (a temporary file, then a rename). Raises OSError."""
    body = "\0".join(files).encode("utf-8", "surrogateescape") + b"\0" + _as_le(tokens).tobytes()
    head = {"format": _MAGIC, "version": 1, "root": root, "pattern": pattern, "count": len(files),
            "checksum": xxhash.xxh3_64_hexdigest(body)}
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(json.dumps(head).encode() + b"\n" + body)
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def read_listing(path: str, root: str, pattern: str) -> tuple[list[str], array] | None:
    """The listing in ``path`` if it is one of ``root`` and ``pattern`` and intact, else None."""
    try:
        with open(path, "rb") as f:
            data = f.read()
        line, _, body = data.partition(b"\n")
        head = json.loads(line)
        if not isinstance(head, dict) or head.get("format") != _MAGIC or head.get("version") != 1:
            return None
        if head.get("root") != root or head.get("pattern") != pattern:
            return None
        if xxhash.xxh3_64_hexdigest(body) != head.get("checksum"):
            return None
        n = int(head["count"])
        names, tail = body[:len(body) - 8 * n - 1], body[len(body) - 8 * n:]
        files = names.decode("utf-8", "surrogateescape").split("\0") if n else []
        tokens = array("Q")
        tokens.frombytes(tail)
        tokens = _as_le(tokens)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return (files, tokens) if len(files) == n == len(tokens) else None


def _as_le(a: array) -> array:
    """``a`` in little-endian byte order (a copy on a big-endian machine)."""
    if sys.byteorder == "little":
        return a
    b = array("Q", a)
    b.byteswap()
    return b


def shared_listing(path: str, root: str, pattern: str, wait: float = 600.0) -> tuple[list[str], array]:
    """The listing of ``root`` and ``pattern`` through the file ``path``: read when another process
    of the run wrote it, else made here (:func:`list_files`) and written for the others. The
    directory of ``path`` is locked while one process lists (best effort: on a file system without
    ``flock``, or after ``wait`` seconds, each process lists for itself)."""
    got = read_listing(path, root, pattern)
    if got is not None:
        return got
    lock = _lock(os.path.dirname(path) or ".", wait)
    try:
        got = read_listing(path, root, pattern)  # written while we waited for the lock
        if got is not None:
            return got
        files, tokens = list_files(root, pattern)
        try:
            write_listing(path, root, pattern, files, tokens)
            _prune_siblings(path)
        except OSError as exc:
            log.debug("cannot write the dataset listing %s: %s", path, exc)
        return files, tokens
    finally:
        if lock >= 0:
            os.close(lock)


def _prune_siblings(path: str) -> None:
    """Remove the older listings beside ``path``: files named as it is up to its last ``-`` with
    its extension (``dataset-<run>.listing``), left by earlier runs that shared the directory."""
    directory, name = os.path.split(path)
    stem, ext = os.path.splitext(name)
    prefix = stem.rpartition("-")[0] + "-"
    if prefix == "-":
        return
    for other in os.listdir(directory or "."):
        if other != name and other.startswith(prefix) and other.endswith(ext):
            try:
                os.unlink(os.path.join(directory, other))
            except OSError:
                pass


def _lock(directory: str, wait: float) -> int:
    """An fd holding ``flock`` on ``directory``, or -1 when it cannot be had within ``wait`` seconds."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return -1
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        except OSError:
            break
    os.close(fd)
    return -1
