"""`tierlm kv ls DIR` and `tierlm kv prune DIR ...`: the model directories of a kv_disk_dir."""
from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence

from tierlm.kv import admin


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _printable(text: str) -> str:
    """Text from files (a recorded path, a lock's owner) with control characters escaped, so
    it cannot move the terminal's cursor or break the table."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t)) if t is not None else "-"


def _table(dirs: Sequence[admin.ModelDir]) -> str:
    rows = [("DIRECTORY", "ENTRIES", "SIZE", "LAST USED", "IN USE BY", "WEIGHTS", "MODEL")]
    rows += [(d.name, f"{d.entries:,}", _size(d.bytes), _when(d.last_used), _printable(d.in_use_by or "-")[:40],
              d.weights, _printable(d.model_dir or "-")) for d in dirs]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows)


def _ls(args: argparse.Namespace) -> int:
    dirs = admin.scan(args.dir, check_weights=not args.no_check_weights)
    if args.json:
        print(json.dumps({"kv_disk_dir": args.dir, "dirs": admin.as_json(dirs)}, indent=1))
        return 0
    if not dirs:
        print(f"{args.dir}: no model directories")
        return 0
    print(f"{args.dir}: {len(dirs)} model director{'y' if len(dirs) == 1 else 'ies'}, "
          f"{_size(sum(d.bytes for d in dirs))}")
    print(_table(dirs))
    stale = [d for d in dirs if d.stale and d.in_use_by is None]
    if stale:
        print(f"{len(stale)} hold blocks of weights that are gone or changed, or are what an interrupted prune "
              f"left ({_size(sum(d.bytes for d in stale))}); `tierlm kv prune {args.dir} --stale` removes them")
    return 0


def _prune(args: argparse.Namespace) -> int:
    unused = admin.parse_duration(args.unused_for) if args.unused_for is not None else None
    results = admin.prune(args.dir, names=args.names, stale=args.stale, unused_for_s=unused, dry_run=args.dry_run)
    if not results:
        print("nothing matches; nothing removed")
        return 0
    for r in results:
        print(f"{r.why}: {r.dir.name} ({r.dir.entries:,} entries, {_size(r.dir.bytes)}; weights {r.dir.weights})")
    if args.dry_run:
        print(f"would free {_size(sum(r.dir.bytes for r in results if r.why == 'would remove'))}")
    else:
        kept = sum(r.why.startswith("kept") for r in results)
        print(f"freed {_size(sum(r.dir.bytes for r in results if r.removed))}" + (f"; {kept} kept" if kept else ""))
    held = [r for r in results if r.why.startswith("kept: in use")]
    # 1: a removal failed, or a directory asked for by name is (or would be) still there
    return 1 if any(r.failed for r in results) or (held and args.names) else 0


def add_cli(sub: argparse._SubParsersAction) -> None:
    kv = sub.add_parser("kv", help="list or remove the model directories of a KV disk tier (kv_disk_dir)")
    ksub = kv.add_subparsers(dest="kv_command", required=True)
    ls = ksub.add_parser("ls", help="each model directory: entries, size, last use, whether a server holds it, "
                                    "and whether its weights are still there")
    ls.add_argument("dir", help="the kv_disk_dir a server was started with")
    ls.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ls.add_argument("--no-check-weights", action="store_true",
                    help="do not fingerprint the recorded checkpoints (their weights column says 'unchecked')")
    ls.set_defaults(func=_ls)
    pr = ksub.add_parser("prune", help="remove model directories no server holds: named ones, or those matching "
                                       "every filter given")
    pr.add_argument("dir", help="the kv_disk_dir a server was started with")
    pr.add_argument("names", nargs="*", help="directory names, as `tierlm kv ls` prints them")
    pr.add_argument("--stale", action="store_true", help="directories whose checkpoint is gone or has other weights now")
    pr.add_argument("--unused-for", metavar="DURATION",
                    help="directories no server started on and no block was written to for this long: 12h, 30d, 2w")
    pr.add_argument("--dry-run", action="store_true", help="say what would be removed; remove nothing")
    pr.set_defaults(func=_prune, more_positionals="names")  # names may also follow the options
