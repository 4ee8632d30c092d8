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
"""

from __future__ import annotations

import fnmatch
import os
import re
import stat
import struct
from array import array

import xxhash

__all__ = ["list_files", "file_token", "stat_token", "glob_regex"]

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
