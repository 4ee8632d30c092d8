"""``hpcstagger clean``: remove everything hpcstagger keeps in /dev/shm for this user."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

GATE_DIR = "/dev/shm"  # where SharedActivityGate makes its files by default


def register(sub: Any) -> None:
    p = sub.add_parser("clean", help="remove everything hpcstagger keeps in /dev/shm for this user",
                       description="Remove this user's hpcstagger state from /dev/shm: the sample caches, shared "
                                   "loader rings, throttle tables, partitioned-cache counters and dataset listings "
                                   "under the shm root (HPCSTAGGER_SHM_ROOT, else /dev/shm/hpcstagger-<uid>), the "
                                   "checkpoint gate files (/dev/shm/hpcstagger-gate-<uid>-*), and the root's folders "
                                   "once empty. While a live process still has one of them open or mapped it refuses, "
                                   "naming the item and the pid, unless --force or --unused.")
    p.add_argument("--root", metavar="DIR", help="the shm root to clean (default: the shm_root knob)")
    p.add_argument("--gate-dir", metavar="DIR", default=GATE_DIR,
                   help=f"where the gate files are (default {GATE_DIR}; SharedActivityGate's directory)")
    p.add_argument("--dry-run", action="store_true", help="list what would be removed, and who uses it; remove nothing")
    p.add_argument("--force", action="store_true",
                   help="remove items that live processes use too (they keep their mappings, new processes "
                        "do not find them)")
    p.add_argument("--unused", action="store_true",
                   help="remove only what no live process uses, and leave the rest without refusing")
    p.add_argument("--after-run", action="store_true",
                   help="only what a finished run leaves: stop the shared loaders' producers that no job is "
                        "attached to any more (instead of letting them linger), then remove the loader rings, "
                        "throttle tables, gate files and dataset listings that no live process uses; caches stay. "
                        "'hpcstagger launch' does this when its ranks are gone; the Slurm batch script runs it "
                        "after its step, before the job's end kills what is left")
    p.add_argument("--json", action="store_true", help="print the items as one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hpcstagger.colocated.leftovers import clean, remove_unused

    if args.after_run:
        if args.force or args.unused or args.dry_run:
            print("hpcstagger clean: --after-run removes only what no live process uses; drop --force, --unused "
                  "and --dry-run", file=sys.stderr)
            return 2
        env = {**os.environ, **({"HPCSTAGGER_SHM_ROOT": os.path.abspath(args.root)} if args.root else {})}
        removed = remove_unused(env, gate_dir=args.gate_dir)
        if args.json:
            json.dump({"dry_run": False, "items": [{"path": p} for p in removed]}, sys.stdout)
            sys.stdout.write("\n")
        else:
            print("\n".join(f"removed {p}" for p in removed) if removed else "nothing to remove")
        return 0
    items = clean(args.root, force=args.force, dry_run=args.dry_run, unused_only=args.unused,
                  gate_dir=args.gate_dir)
    if args.json:
        json.dump({"dry_run": args.dry_run, "items": [{"kind": i.kind, "path": i.path, "users": [
            {"pid": p, "command": c} for p, c in i.users]} for i in items]}, sys.stdout)
        sys.stdout.write("\n")
        return 0
    verb = "would remove" if args.dry_run else "removed"
    for item in items:
        print(f"{verb} {item.describe()}")
    if not items:
        print("nothing to remove")
    return 0
