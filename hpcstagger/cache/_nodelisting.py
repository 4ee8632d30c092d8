"""A directory dataset's listing, made once per node and run and shared through the shm root.

The first process on a node lists the dataset (:func:`~._listing.make_listing`: names and
identities in one pass) and writes the listing to ``<shm_root>/.listings/<dataset>-<run>.listing``;
every later process of the same run on the node reads that file and makes no metadata call on
the dataset's tree (not even on its root: the file is found by the root's name as given).

A listing holds identities, so it must not outlive its run: files may change between two runs.
The run is named by :func:`run_identity`: the ``run`` argument, else whatever the environment
says of the run (hpcstagger's run directory, the Slurm job and ``srun`` step, torchrun's run id,
all that are set). Without one, each process lists for itself.

Every process that uses a listing keeps it open with a shared ``flock`` until it exits, so that a
listing is known to be in use: a new run's listing of the same dataset removes the earlier runs'
listings that no live process holds, and ``hpcstagger clean`` names the holders. One process
lists while the others of the node wait on a lock file (``<dataset>.lock``), removed afterwards.
The folder is made and checked as the cache's own folders are (:mod:`._fs`: this user's, 0700,
no symbolic links); files are written to a temporary name and renamed, and a listing is used only
when its header names this root, selection and run and its checksum holds.
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
import time
from array import array
from collections.abc import Mapping

import xxhash

from hpcstagger import config
from hpcstagger.errors import CacheError, ConfigError
from hpcstagger.cache import _fs, _listing
from hpcstagger.cache._listing import Selection

__all__ = ["LISTINGS", "RUN_DIR_ENV", "run_identity", "dataset_listing", "listing_name"]

log = logging.getLogger(__name__)

LISTINGS = ".listings"  # the folder under the shm root; a name no cache can have
RUN_DIR_ENV = "HPCSTAGGER_RUN_DIR"  # = hpcstagger.spec.runenv.RUN_DIR (cache/ sits below spec/)
_SLURM_SPECIAL_STEPS = 0xFFFFFFF0  # Slurm's batch, extern, interactive ... steps are numbered from near 2**32 down
_WAIT = 600.0  # seconds a process waits for another one's listing before it lists for itself
_held: dict[str, int] = {}  # listing path -> an fd holding a shared flock on it, for this process's life


def run_identity(run: str | None = None, environ: Mapping[str, str] | None = None) -> str | None:
    """The name of the run this process belongs to, or None: ``run`` when given, else every one of
    ``HPCSTAGGER_RUN_DIR`` (set by ``hpcstagger launch`` and the batch templates), ``SLURM_JOB_ID``
    with ``SLURM_STEP_ID`` (an ``srun`` step: the processes of a batch script or an ``salloc``
    shell are not one run, they may change the data between two commands) and
    ``TORCHELASTIC_RUN_ID`` (not torchrun's default ``none``) that is set."""
    if run:
        return f"run:{run}"
    env = os.environ if environ is None else environ
    parts = []
    if env.get(RUN_DIR_ENV):
        parts.append(f"hpcstagger:{os.path.abspath(env[RUN_DIR_ENV])}")
    step = env.get("SLURM_STEP_ID", "")
    if env.get("SLURM_JOB_ID") and step.isdigit() and int(step) < _SLURM_SPECIAL_STEPS:
        parts.append(f"slurm:{env['SLURM_JOB_ID']}.{step}")
    torchrun = env.get("TORCHELASTIC_RUN_ID")
    if torchrun and torchrun != "none":
        parts.append(f"torchrun:{torchrun}")
    return " ".join(parts) or None


def listing_name(given: str, selection: Selection, run: str) -> tuple[str, str]:
    """(dataset key, file name) of the node listing of root ``given``, ``selection`` and ``run``."""
    what = "\0".join([given, selection.pattern or "", selection.digest or ""])
    key = xxhash.xxh3_64_hexdigest(what.encode("utf-8", "surrogateescape"))
    return key, f"{key}-{xxhash.xxh3_64_hexdigest(run.encode('utf-8', 'surrogateescape'))}.listing"


def _checked_root(given: str) -> str:
    """The real path of the dataset's root; ConfigError if it is missing or not a directory."""
    if not os.path.exists(given):
        raise ConfigError(f"DirectorySource: {given} does not exist (check the dataset path)")
    if not os.path.isdir(given):
        raise ConfigError(f"DirectorySource: {given} is not a directory (an HDF5 file takes HDF5Source)")
    return os.path.realpath(given)


def dataset_listing(given: str, selection: Selection, *, listing: str | os.PathLike[str] | bool | None = None,
                    run: str | None = None) -> tuple[str, list[str], array]:
    """(real root, names, identity tokens) of the dataset under ``given`` (an absolute path).

    ``listing`` None or True: through the node's listing for the run (:func:`run_identity`), or
    listed here without one. A path: the same, and on a node's first listing through that file as
    :func:`~._listing.shared_listing` does (one listing for all nodes of a run). False: listed here.
    Raises ConfigError for a missing root or a bad file list."""
    path = os.fspath(listing) if isinstance(listing, (str, os.PathLike)) else None
    ident = run_identity(run) if listing is not False else None
    if ident is None:
        if listing is not False:
            log.debug("no run identity (run=, HPCSTAGGER_RUN_DIR, SLURM_JOB_ID, TORCHELASTIC_RUN_ID): "
                      "%s is listed by this process alone", given)
        return _alone(given, selection, path)
    try:
        dfd, dpath = _listings_dir()
    except (CacheError, OSError) as exc:
        log.warning("cannot share the listing of %s on this node (%s); this process lists it alone", given, exc)
        return _alone(given, selection, path)
    try:
        return _through_node((dfd, dpath), given, selection, ident, path)
    finally:
        os.close(dfd)


def _alone(given: str, selection: Selection, path: str | None) -> tuple[str, list[str], array]:
    """The listing without the node's: made here, or shared through the file ``path`` alone."""
    real = _checked_root(given)
    if path:
        return (real, *_listing.shared_listing(path, real, selection, given=given))
    return (real, *_listing.make_listing(given, real, selection))


def _through_node(d: tuple[int, str], given: str, selection: Selection, ident: str,
                  path: str | None) -> tuple[str, list[str], array]:
    """The listing through the node's folder ``d`` (fd, path), made here (under its lock) if absent."""
    dfd = d[0]
    key, name = listing_name(given, selection, ident)
    expect = {"given": given, **selection.meta(), "run": ident}
    got = _read(d, name, expect)
    if got is None:
        real = _checked_root(given)
        lock = _lock(dfd, f"{key}.lock")
        try:
            got = _read(d, name, expect)  # written while we waited
            if got is None:
                if path:
                    files, tokens = _listing.shared_listing(path, real, selection, given=given)
                else:
                    files, tokens = _listing.make_listing(given, real, selection)
                got = real, files, tokens
                try:
                    _write(d, name, {"root": real, **expect}, files, tokens)
                    _prune(dfd, key, name)
                except OSError as exc:
                    log.debug("cannot write the node's listing %s: %s", name, exc)
                return got
        finally:
            _unlock(dfd, f"{key}.lock", lock)
    if path and not os.path.exists(path):  # the node has it; publish it for the run's other nodes
        try:
            _listing.write_listing(path, got[0], selection, got[1], got[2])
        except OSError as exc:
            log.debug("cannot write the dataset listing %s: %s", path, exc)
    return got


def _listings_dir() -> tuple[int, str]:
    """(fd, path) of ``<shm_root>/.listings``, made 0700 and checked as the cache's folders are."""
    root = os.path.abspath(config.get("shm_root"))
    root_fd = _fs.open_secure_dir(root, create=True, what="cache root")
    try:
        fd = _fs.open_secure_subdir(root_fd, LISTINGS, root, create=True, what="listings folder")
    finally:
        os.close(root_fd)
    return fd, os.path.join(root, LISTINGS)


def _read(d: tuple[int, str], name: str, expect: dict[str, object]) -> tuple[str, list[str], array] | None:
    """The listing ``name`` in the folder ``d`` if it is ours, intact and of ``expect``; kept open
    (and shared-locked) while this process lives."""
    dfd = d[0]
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    except OSError:
        return None
    keep = False
    try:
        st = _fs.check_secure_file(fd, name, "dataset listing")
        chunks, left = [], st.st_size
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        got = _listing.parse_listing(b"".join(chunks), expect)
        if got is None or not isinstance(got[0].get("root"), str):
            log.debug("the node's listing %s is not this dataset's, or damaged: not used", name)
            return None
        keep = True
        _hold(d[1], name, fd)
        return got[0]["root"], got[1], got[2]
    except (OSError, CacheError) as exc:
        log.debug("cannot read the node's listing %s: %s", name, exc)
        return None
    finally:
        if not keep:
            os.close(fd)


def _hold(dpath: str, name: str, fd: int) -> None:
    """Keep ``fd`` open with a shared lock: the listing is in use while this process lives."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        pass  # being removed by a newer run: this process has read it whole anyway
    where = os.path.join(dpath, name)
    old = _held.pop(where, None)
    if old is not None:
        os.close(old)
    _held[where] = fd


def _write(d: tuple[int, str], name: str, meta: dict[str, object], files: list[str], tokens: array) -> None:
    """Write the listing ``name`` into the folder ``d`` atomically (a temporary file of this
    process, then a rename) and hold it as :func:`_read` does. Raises OSError."""
    dfd = d[0]
    data = _listing.listing_bytes(meta, files, tokens)
    tmp = f"{name}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(tmp, dir_fd=dfd)
        except OSError:
            pass
        raise
    os.close(fd)
    held = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    _hold(d[1], name, held)


def _prune(dfd: int, key: str, keep: str) -> None:
    """Remove the listings of ``key``'s dataset that earlier runs left and no live process holds,
    and the temporary files of writers that died."""
    for other in os.listdir(dfd):
        if other == keep or not other.startswith(f"{key}-"):
            continue
        base, _, pid = other.rpartition(".tmp-")
        if base:
            if pid.isdigit() and not _fs.alive(int(pid), 0):
                _unlink_if_free(dfd, other)
        elif other.endswith(".listing"):
            _unlink_if_free(dfd, other)


def _unlink_if_free(dfd: int, name: str) -> bool:
    """Unlink ``name`` if no process holds a lock on it (checked on the file the name still names)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        if st.st_ino != os.fstat(fd).st_ino or not stat.S_ISREG(st.st_mode):
            return False
        os.unlink(name, dir_fd=dfd)
        return True
    except OSError:  # held (in use), or gone
        return False
    finally:
        os.close(fd)


def _lock(dfd: int, name: str) -> int:
    """An fd holding ``flock`` on the lock file ``name``, or -1 after :data:`_WAIT` seconds (then
    this process lists on its own)."""
    try:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
    except OSError as exc:
        log.debug("cannot open the listing lock %s: %s", name, exc)
        return -1
    t0 = time.monotonic()
    if _listing.flock_within(fd, _WAIT):
        return fd
    if time.monotonic() - t0 >= _WAIT:
        log.warning("waited %.0f s for another process's listing of this dataset; listing it here", _WAIT)
    return -1


def _unlock(dfd: int, name: str, fd: int) -> None:
    """Remove the lock file (the listing is written: a newcomer reads it first) and release it."""
    if fd < 0:
        return
    try:
        if os.stat(name, dir_fd=dfd, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
            os.unlink(name, dir_fd=dfd)
    except OSError:
        pass
    os.close(fd)
