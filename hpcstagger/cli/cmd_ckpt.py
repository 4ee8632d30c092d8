"""``hpcstagger ckpt``: list, verify and export checkpoints written by AsyncCheckpointer."""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from hpcstagger.measure.tables import human_bytes
from hpcstagger.errors import CheckpointError, CheckpointWarning, ConfigError


_DIR_HELP = "the checkpoint directory AsyncCheckpointer writes to, or one step-N directory in it"


def register(sub: Any) -> None:
    p = sub.add_parser("ckpt", help="list, verify and export checkpoints",
                       description="Inspect the checkpoints AsyncCheckpointer writes: one step-N directory per "
                                   "checkpoint, with HDF5 shards and a JSON manifest.")
    cmds = p.add_subparsers(dest="ckpt_command", metavar="ACTION", required=True, parser_class=type(p))

    ls = cmds.add_parser("ls", help="list the checkpoints in a directory",
                         description="List every step directory in DIR, newest first: committed (with world size, "
                                     "tensors and bytes), incomplete (no manifest: an interrupted save) or damaged "
                                     "(saying which file). Reads the manifests and compares each shard file's size "
                                     "with its manifest, reading no shard data; --verify checksums everything, as "
                                     "verify does. Exit 0 whatever it finds. DIR may also be one step-N directory.")
    ls.add_argument("directory", metavar="DIR", help=_DIR_HELP)
    ls.add_argument("--verify", action="store_true",
                    help="also read every shard and check its checksums (slow: reads all the data)")
    ls.add_argument("--json", action="store_true", help="print exactly one JSON object")
    ls.set_defaults(func=run_ls)

    v = cmds.add_parser("verify", help="check checkpoints byte for byte; non-zero exit on any problem",
                        description="Check every checkpoint in DIR (or only --step N): the manifest and its checksum, "
                                    "every shard's presence, size and whole-file checksum, that its datasets match "
                                    "the manifest, and every tensor piece's checksum. A step directory without a "
                                    "manifest (an interrupted save) is a problem too. Exit 1 if anything is wrong, "
                                    "saying what. DIR may also be one step-N directory.")
    v.add_argument("directory", metavar="DIR", help=_DIR_HELP)
    v.add_argument("--step", type=int, help="verify only this step")
    v.add_argument("--json", action="store_true", help="print exactly one JSON object")
    v.set_defaults(func=run_verify)

    e = cmds.add_parser("export", help="write one checkpoint as a torch.save file",
                        description="Load a checkpoint (checksums checked) and write it with torch.save as a plain "
                                    "state dict that torch.load(..., weights_only=True) reads: modules and optimizers "
                                    "appear as their state dicts, numpy arrays become tensors and numpy scalars "
                                    "Python numbers. Without --step, a damaged newest checkpoint is skipped with "
                                    "one warning for the next older one; with --step, the step must load. Says "
                                    "which step it wrote, and where.")
    e.add_argument("directory", metavar="DIR", help=_DIR_HELP)
    e.add_argument("--step", type=int, help="the step to export (default: the newest that loads)")
    e.add_argument("--out", required=True, metavar="FILE.pt", help="the file to write")
    e.set_defaults(func=run_export)


def _describe(entry: Any, verify: bool = False) -> dict[str, Any]:
    """One row of ``ckpt ls``: damaged when the files (sizes, presence; with ``verify`` every
    checksum) disagree with the manifest, naming the first problem and counting the others."""
    from hpcstagger.checkpoint.catalog import file_problems
    from hpcstagger.checkpoint.load import verify_checkpoint

    row: dict[str, Any] = {"step": entry.step, "path": entry.path, "committed": entry.committed}
    if not entry.committed:
        row["status"] = "incomplete"
        return row
    problems = file_problems(entry)
    if entry.manifest is not None:
        m = entry.manifest
        row.update(world_size=m["world_size"], tensors=len(m["tensors"]),
                   bytes=sum(s["size"] for s in m["shards"]), created=m.get("created"))
    if verify and not problems:
        problems = verify_checkpoint(entry.path)
    if problems:
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        row.update(status="damaged", error=_one_line(problems[0]) + more, problems=[_one_line(p) for p in problems])
    else:
        row["status"] = "committed"
    return row


def _one_line(text: str) -> str:
    return " ".join(str(text).split("\n")).strip()


def _entries(directory: str) -> list[Any]:
    """The step directories in ``directory``, or ``directory`` itself when it is one."""
    from hpcstagger.checkpoint.catalog import Entry
    from hpcstagger.checkpoint.load import list_entries
    from hpcstagger.checkpoint.manifest import MANIFEST, parse_step_dirname

    if not os.path.isdir(directory):
        what = "does not exist" if not os.path.lexists(directory) else "is not a directory"
        raise CheckpointError(f"{directory} {what}; give the directory AsyncCheckpointer writes to")
    step = parse_step_dirname(os.path.basename(os.path.normpath(directory)))
    if step is not None:
        return [Entry(step, directory, 0, os.path.exists(os.path.join(directory, MANIFEST)))]
    return list_entries(directory)


def run_ls(args: argparse.Namespace) -> int:
    rows = [_describe(e, args.verify) for e in _entries(args.directory)]
    if args.json:
        json.dump({"directory": os.path.abspath(args.directory), "checkpoints": rows}, sys.stdout)
        sys.stdout.write("\n")
        return 0
    if not rows:
        print(f"no checkpoints in {args.directory}")
        return 0
    print(f"{'step':>10}  {'status':<10}  {'ranks':>5}  {'tensors':>7}  {'size':>10}  created")
    for r in rows:
        print(f"{r['step']:>10}  {r['status']:<10}  {r.get('world_size', '-'):>5}  {r.get('tensors', '-'):>7}  "
              f"{human_bytes(r['bytes']) if 'bytes' in r else '-':>10}  {r.get('error') or r.get('created') or ''}")
    return 0


def run_verify(args: argparse.Namespace) -> int:
    from hpcstagger.checkpoint.load import verify_checkpoint

    entries = _entries(args.directory)
    if args.step is not None:
        entries = [e for e in entries if e.step == args.step]
        if not entries:
            raise CheckpointError(f"no checkpoint of step {args.step} in {args.directory} "
                                  "(hpcstagger ckpt ls DIR lists them)")
    if not entries:
        raise CheckpointError(f"no checkpoints in {args.directory}")
    total = 0
    for e in entries:
        total += sum(s["size"] for s in e.read_manifest()["shards"]) if e.committed and _safe(e) else 0
    bar = None
    if not args.json and sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, desc="verify", file=sys.stderr)
    results = []
    try:
        for e in entries:
            problems = verify_checkpoint(e.path, progress=bar.update if bar else None)
            results.append({"step": e.step, "path": e.path, "ok": not problems, "problems": problems})
    finally:
        if bar:
            bar.close()
    bad = [r for r in results if not r["ok"]]
    if args.json:
        json.dump({"directory": os.path.abspath(args.directory), "ok": not bad, "checkpoints": results}, sys.stdout)
        sys.stdout.write("\n")
    else:
        for r in results:
            if r["ok"]:
                print(f"step {r['step']}: ok")
            else:
                for p in r["problems"]:
                    print(f"step {r['step']}: PROBLEM: {_one_line(p)}")
        print(f"{len(results) - len(bad)} of {len(results)} checkpoint(s) sound"
              + (f"; problems in step(s) {', '.join(str(r['step']) for r in bad)}" if bad else ""))
    return 1 if bad else 0


def _safe(entry: Any) -> bool:
    try:
        entry.read_manifest()
        return True
    except CheckpointError:
        return False


def _tensors_only(obj: Any) -> Any:
    import numpy as np
    import torch

    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj.astype(obj.dtype.newbyteorder("="), order="C", copy=True))
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return {k: _tensors_only(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_tensors_only(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_tensors_only(v) for v in obj)
    return obj


@contextmanager
def _warnings_as_lines() -> Iterator[None]:
    """Print each CheckpointWarning as one ``hpcstagger ckpt: warning: ...`` line on stderr, once."""
    shown = warnings.showwarning

    def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        if issubclass(category, CheckpointWarning):
            print(f"hpcstagger ckpt: warning: {_one_line(str(message))}", file=sys.stderr)
        else:
            shown(message, category, filename, lineno, file, line)

    with warnings.catch_warnings():
        warnings.simplefilter("always", CheckpointWarning)
        warnings.showwarning = show
        yield


def _check_out(out: str) -> None:
    """Refuse an --out that cannot be written before anything is loaded."""
    parent = os.path.dirname(os.path.abspath(out))
    if os.path.isdir(out):
        raise ConfigError(f"--out {out} is a directory; give a file name, e.g. --out {os.path.join(out, 'state.pt')}")
    if not os.path.isdir(parent):
        raise ConfigError(f"--out {out}: {parent} is not a directory; create it first or choose another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {out}: {parent} is not writable by this user; choose another path")


def run_export(args: argparse.Namespace) -> int:
    from hpcstagger._io import atomic_write
    from hpcstagger.checkpoint.load import load_entry
    from hpcstagger.checkpoint.manifest import parse_step_dirname

    import torch

    _entries(args.directory)
    _check_out(args.out)
    directory, step = args.directory, args.step
    named = parse_step_dirname(os.path.basename(os.path.normpath(directory)))
    if named is not None:  # one step-N directory: that step of its parent
        if step is not None and step != named:
            raise ConfigError(f"--step {step} disagrees with the step directory {directory} (step {named}); "
                              "give one of them")
        directory, step = os.path.dirname(os.path.abspath(directory)), named
    with _warnings_as_lines():
        entry, state = load_entry(directory, step, map_location="cpu")
    try:
        atomic_write(args.out, lambda f: torch.save(_tensors_only(state), f))
    except OSError as exc:
        raise CheckpointError(f"cannot write {args.out}: {exc.strerror or exc}; check the free space and "
                              "permissions there, or choose another --out") from None
    print(f"wrote step {entry.step} from {entry.path} to {args.out} ({human_bytes(os.path.getsize(args.out))})")
    return 0
