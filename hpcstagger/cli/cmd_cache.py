"""``hpcstagger cache ls | stats NAME | clear NAME | size SPEC``: inspect, empty and size the shared
/dev/shm caches."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hpcstagger.measure.tables import human_bytes, table


def register(sub: Any) -> None:
    p = sub.add_parser("cache", help="list, inspect and clear the shared sample caches in /dev/shm",
                       description="List, inspect and clear the node-local sample caches (ShmCache) under "
                                   "the shm root (HPCSTAGGER_SHM_ROOT, default /dev/shm/hpcstagger-<uid>).")
    csub = p.add_subparsers(dest="cache_command", metavar="ACTION", required=True, parser_class=type(p))

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("--root", metavar="DIR", help="the shm root to look in (default: the shm_root knob)")

    q = csub.add_parser("ls", help="list the caches with their size, entries and hit rate",
                        description="List every cache under the root: policy, bytes used of capacity, "
                                    "entries, node-wide hit rate and live processes attached.")
    common(q)
    q.add_argument("--json", action="store_true", help="print exactly one JSON object")
    q.set_defaults(func=run_ls)

    q = csub.add_parser("stats", help="print one cache's node-wide statistics",
                        description="Print the statistics of cache NAME, summed over every process that "
                                    "used it: lookups, hits, misses, inserts, refused, bytes used, ...; for a "
                                    "partitioned cache also its local hits, remote hits and source reads "
                                    "(emulated nodes: --root <root>/node<i>).")
    q.add_argument("name", metavar="NAME", help="the cache, as 'hpcstagger cache ls' lists it (a spec's [cache] name, "
                   "by default its [run] name)")
    common(q)
    q.add_argument("--json", action="store_true", help="print exactly one JSON object")
    q.set_defaults(func=run_stats)

    q = csub.add_parser("clear", help="empty a cache, and remove it when no live process uses it",
                        description="Empty cache NAME. When no live process is attached it is removed from "
                                    "the root altogether; otherwise its entries are dropped and the attached "
                                    "processes keep using the (now empty) cache.")
    q.add_argument("name", metavar="NAME", help="the cache to empty, as 'hpcstagger cache ls' lists it")
    common(q)
    q.set_defaults(func=run_clear)

    q = csub.add_parser("size", help="print the bytes a spec's [cache] gets here, now (capacity \"auto\")",
                        description='Print the capacity in bytes that SPEC\'s [cache] gets on this node now, and '
                                    'why on stderr: for capacity = "auto", what the memory (MemAvailable, or the '
                                    "memory cgroup's room) leaves beside the jobs' memory measured in the "
                                    "calibrated scenario, as hpcstagger launch sizes it (and hpcstagger slurm "
                                    "prepare in a batch script, which exports it as HPCSTAGGER_CACHE_CAPACITY, "
                                    "one size for every process).")
    q.add_argument("spec", metavar="SPEC", help="the job spec (TOML)")
    q.set_defaults(func=run_size)


def _root(args: argparse.Namespace) -> str:
    from hpcstagger import config

    import os

    return os.path.abspath(args.root or config.get("shm_root"))


def run_ls(args: argparse.Namespace) -> int:
    from hpcstagger.cache.store import ShmCache

    from hpcstagger.cache.admin import list_caches

    root = _root(args)
    rows = []
    for name in list_caches(root):
        cache = ShmCache(name, None, root=root)
        try:
            rows.append(cache.stats())
        finally:
            cache.close()
    if args.json:
        json.dump({"root": root, "caches": rows}, sys.stdout, sort_keys=True)
        sys.stdout.write("\n")
        return 0
    if not rows:
        print(f"no caches under {root}")
        return 0
    lines = [("NAME", "POLICY", "USED", "CAPACITY", "ENTRIES", "HIT RATE", "PROCESSES")]
    for s in rows:
        lines.append((s["name"], s["policy"], human_bytes(s["bytes_used"]), human_bytes(s["capacity_bytes"]),
                      str(s["entries"]), f"{100 * s['hit_rate']:.1f}%", str(s["processes"])))
    print(table(lines))
    return 0


def run_stats(args: argparse.Namespace) -> int:
    from hpcstagger.cache.store import ShmCache

    from hpcstagger.cache.partitioned import partition_stats

    cache = ShmCache(args.name, None, root=_root(args))
    try:
        stats = cache.stats()
    finally:
        cache.close()
    stats.update(partition_stats(args.name, _root(args)))  # a partitioned cache's local/remote/source counts
    if args.json:
        json.dump(stats, sys.stdout, sort_keys=True)
        sys.stdout.write("\n")
        return 0
    order = ["name", "path", "policy", "capacity_bytes", "bytes_used", "entries", "max_entries", "lookups",
             "hits", "misses", "hit_rate", "inserts", "refused", "duplicates", "coalesced", "corrupt", "read_bytes",
             "read_seconds", "partition_node", "partition_nodes", "local_hits", "remote_hits", "remote_misses",
             "remote_failures", "source_reads", "source_bytes", "reserved_bytes",
             "wasted_bytes", "processes", "generation"]
    width = max(map(len, order))
    for k in [k for k in order if k in stats] + sorted(set(stats) - set(order)):
        v = stats[k]
        if k in ("capacity_bytes", "bytes_used", "reserved_bytes", "wasted_bytes"):
            v = f"{v} ({human_bytes(v)})"
        elif k == "hit_rate":
            v = f"{100 * v:.1f}%"
        print(f"{k.ljust(width)}  {v}")
    return 0


def run_clear(args: argparse.Namespace) -> int:
    from hpcstagger.cache.admin import clear_cache

    root = _root(args)
    done = clear_cache(args.name, root)
    if done["action"] == "removed damaged":
        print(f"removed damaged cache {args.name!r} from {root}")
    elif done["action"] == "cleared":
        print(f"cleared cache {args.name!r} ({human_bytes(done['bytes'])} of entries dropped); "
              f"kept it because {done['processes']} live process(es) use it")
    else:
        print(f"removed cache {args.name!r} ({human_bytes(done['bytes'])} freed) from {root}")
    return 0


def run_size(args: argparse.Namespace) -> int:
    import os

    from hpcstagger.spec import cachesize, runenv
    from hpcstagger.spec.jobspec import Spec

    spec = Spec.from_toml(args.spec)
    sized = cachesize.for_launch(spec, {k: v for k, v in os.environ.items() if k != runenv.CACHE_CAPACITY})
    capacity, why = (sized.capacity, sized.why) if sized is not None else (spec.cache.capacity, "given in the spec")
    print(capacity)
    print(f"hpcstagger cache size: {capacity} bytes: {why}", file=sys.stderr)
    return 0
