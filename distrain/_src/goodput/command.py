"""``distrain goodput WORKDIR``: the goodput table of a run, its JSON and its timeline."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from distrain._src.goodput.report import report


def main(argv: Sequence[str]) -> int:
    """Prints the run's goodput table; writes ``--json`` and ``--png`` when asked."""
    parser = argparse.ArgumentParser(
        prog="distrain goodput",
        description="Where a run's wall time went, across restarts: productive steps, "
        "start-up, compilation, input, checkpoints, evaluation, lost work and downtime. "
        "Reads WORKDIR/goodput.jsonl (written by dt.callbacks.Goodput; distrain train "
        "writes it to logging.dir).",
    )
    parser.add_argument("workdir", help="the run's directory (holding goodput.jsonl)")
    parser.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    parser.add_argument("--png", metavar="FILE", help="draw the timeline (needs matplotlib)")
    args = parser.parse_args(list(argv))
    r = report(args.workdir)
    print(r.table())
    if r.skipped_lines:
        print(f"({r.skipped_lines} unreadable ledger line(s) skipped: torn by a kill)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r.to_json(), f, indent=1)
        print(f"wrote {args.json}")
    if args.png:
        r.plot(args.png)
        print(f"wrote {args.png}")
    return 0
