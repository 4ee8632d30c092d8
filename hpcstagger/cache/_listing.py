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
:func:`list_named` takes a file list instead (a :class:`Selection` says which of the two), with one
``stat`` per listed file. :func:`shared_listing` lets the processes of one run share one listing
through a file; :mod:`._nodelisting` shares it on the node through the shm root.
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
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import xxhash

from hpcstagger.errors import ConfigError

__all__ = ["list_files", "list_named", "file_token", "stat_token", "glob_regex", "Selection", "shared_listing",
           "read_listing", "write_listing", "listing_bytes", "parse_listing", "make_listing"]

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


@dataclass(frozen=True)
class Selection:
    """Which files under a root a listing holds: those matching a glob ``pattern``, or a file list,
    given as the ``text`` of a list file (``origin`` names it in messages) or as ``items``."""

    pattern: str | None = None
    text: bytes | None = None
    items: tuple[str, ...] | None = None
    origin: str = "files"

    @property
    def digest(self) -> str | None:
        """An xxh3-64 of the file list as given (None for a pattern): a changed list is another listing."""
        if self.text is not None:
            return xxhash.xxh3_64_hexdigest(b"text\0" + self.text)
        if self.items is not None:
            return xxhash.xxh3_64_hexdigest(b"items\0" + "\0".join(self.items).encode("utf-8", "surrogateescape"))
        return None

    def meta(self) -> dict[str, Any]:
        """The header fields that name this selection in a listing file."""
        return {"pattern": self.pattern, "files": self.digest}

    def entries(self) -> Iterator[tuple[str, str]]:
        """Each listed path with where it was listed (``line 3 of list.txt``, ``item 3 of files``):
        blank lines and lines starting with ``#`` are skipped, and surrounding blanks stripped."""
        if self.items is not None:
            for k, item in enumerate(self.items, 1):
                yield item, f"item {k} of {self.origin}"
            return
        text = (self.text or b"").decode("utf-8", "surrogateescape")
        for k, line in enumerate(text.split("\n"), 1):
            line = line.strip()
            if line and not line.startswith("#"):
                yield line, f"line {k} of {self.origin}"


def _relative(path: str, where: str, given: str, real: str) -> str:
    """``path`` of a file list as a name relative to the root (given as ``given``, real ``real``)."""
    norm = os.path.normpath(path)
    if os.path.isabs(norm):
        for base in (given, real):
            if norm.startswith(os.path.join(base, "")):
                return norm[len(os.path.join(base, "")):]
        rel = ".."
    else:
        rel = norm
    if rel in (".", "..") or rel.startswith("../"):
        raise ConfigError(f"DirectorySource: {where}: {path!r} is not under the root {given}; list paths "
                          f"relative to the root, or absolute paths under it")
    return rel


def list_named(given: str, real: str, selection: Selection) -> tuple[list[str], array]:
    """The files of a file list (``selection``) under the root ``given`` (real path ``real``), in
    the list's order, with their identity tokens: one ``stat`` per file. Raises ConfigError naming
    the line or item of a path outside the root, missing, not a regular file, or listed twice."""
    files: list[str] = []
    tokens = array("Q")
    seen: dict[str, str] = {}
    for path, where in selection.entries():
        rel = _relative(path, where, given, real)
        if rel in seen:
            raise ConfigError(f"DirectorySource: {where}: {rel} is listed twice (first at {seen[rel]}); "
                              f"list each file once")
        seen[rel] = where
        try:
            st = os.stat(os.path.join(real, rel))
        except FileNotFoundError:
            raise ConfigError(f"DirectorySource: {where}: {os.path.join(given, rel)} does not exist; fix the "
                              f"path (relative to the root {given}) or remove the line") from None
        except OSError as exc:
            raise ConfigError(f"DirectorySource: {where}: cannot stat {os.path.join(given, rel)}: "
                              f"{exc.strerror}; fix the path or its permissions") from None
        if stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"DirectorySource: {where}: {os.path.join(given, rel)} is a directory; list the "
                              f"files in it, one per line (or give a glob pattern instead of files=)")
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"DirectorySource: {where}: {os.path.join(given, rel)} is not a regular file; "
                              f"remove it from the list")
        files.append(rel)
        tokens.append(stat_token(st))
    return files, tokens


def make_listing(given: str, real: str, selection: Selection) -> tuple[list[str], array]:
    """The listing of ``selection`` under the root ``real``: :func:`list_files` for a pattern (looked
    up in this module when called), :func:`list_named` for a file list."""
    if selection.pattern is not None:
        return list_files(real, selection.pattern)
    return list_named(given, real, selection)


# ---- a listing shared by the processes of one run -----------------------------------------------
# One file: a JSON header line, then the names joined by NUL (never in a name) and the tokens as
# little-endian uint64. The header carries the root, the pattern (or the file list's digest), the
# count and an xxh3-64 of the body, so a file of another dataset, a torn write or a damaged file is
# never taken for the listing.
_MAGIC = "hpcstagger-listing"
_NAMED = ("root", "pattern", "files", "given", "run")  # the header fields that say what a listing is of


def _selection(pattern: str | Selection) -> Selection:
    return pattern if isinstance(pattern, Selection) else Selection(pattern=pattern)


def listing_bytes(meta: dict[str, Any], files: list[str], tokens: array) -> bytes:
    """A listing file's bytes: ``meta`` (what it is of: :data:`_NAMED` fields) in the header."""
    body = "\0".join(files).encode("utf-8", "surrogateescape") + b"\0" + _as_le(tokens).tobytes()
    head = {"format": _MAGIC, "version": 1, **{k: v for k, v in meta.items() if v is not None},
            "count": len(files), "checksum": xxhash.xxh3_64_hexdigest(body)}
    return json.dumps(head).encode() + b"\n" + body


def parse_listing(data: bytes, expect: dict[str, Any]) -> tuple[dict[str, Any], list[str], array] | None:
    """(header, names, tokens) of a listing file's bytes if it is intact and of ``expect`` (every
    named field not in ``expect`` must be absent, except ``root`` when ``expect`` leaves it out),
    else None."""
    try:
        line, _, body = data.partition(b"\n")
        head = json.loads(line)
        if not isinstance(head, dict) or head.get("format") != _MAGIC or head.get("version") != 1:
            return None
        if any(head.get(k) != expect.get(k) for k in _NAMED if k in expect or k != "root"):
            return None
        if xxhash.xxh3_64_hexdigest(body) != head.get("checksum"):
            return None
        n = int(head["count"])
        names, tail = body[:len(body) - 8 * n - 1], body[len(body) - 8 * n:]
        files = names.decode("utf-8", "surrogateescape").split("\0") if n else []
        tokens = array("Q")
        tokens.frombytes(tail)
        tokens = _as_le(tokens)
    except (ValueError, KeyError, TypeError):
        return None
    return (head, files, tokens) if len(files) == n == len(tokens) else None


def write_listing(path: str, root: str, pattern: str | Selection, files: list[str], tokens: array) -> None:
    """Write a listing to ``path`` atomically (a temporary file, then a rename). Raises OSError."""
    data = listing_bytes({"root": root, **_selection(pattern).meta()}, files, tokens)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def read_listing(path: str, root: str, pattern: str | Selection) -> tuple[list[str], array] | None:
    """The listing in ``path`` if it is one of ``root`` and ``pattern`` (or file list) and intact, else None."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    got = parse_listing(data, {"root": root, **_selection(pattern).meta()})
    return None if got is None else (got[1], got[2])


def _as_le(a: array) -> array:
    """``a`` in little-endian byte order (a copy on a big-endian machine)."""
    if sys.byteorder == "little":
        return a
    b = array("Q", a)
    b.byteswap()
    return b


def shared_listing(path: str, root: str, pattern: str | Selection, wait: float = 600.0, *,
                   given: str | None = None) -> tuple[list[str], array]:
    """The listing of ``root`` and ``pattern`` (or a file list) through the file ``path``: read when
    another process of the run wrote it, else made here (:func:`make_listing`; ``given``: the root
    as the user named it, for a file list's absolute paths) and written for the others. The
    directory of ``path`` is locked while one process lists (best effort: on a file system without
    ``flock``, or after ``wait`` seconds, each process lists for itself). Raises ConfigError for a
    bad file list."""
    got = read_listing(path, root, pattern)
    if got is not None:
        return got
    lock = _lock(os.path.dirname(path) or ".", wait)
    try:
        got = read_listing(path, root, pattern)  # written while we waited for the lock
        if got is not None:
            return got
        files, tokens = make_listing(given or root, root, _selection(pattern))
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
    return fd if flock_within(fd, wait) else -1


def flock_within(fd: int, wait: float) -> bool:
    """Take an exclusive ``flock`` on ``fd`` within ``wait`` seconds. On failure (the time ran
    out, or the file system has no ``flock``) close ``fd`` and return False."""
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        except OSError:
            break
    os.close(fd)
    return False
