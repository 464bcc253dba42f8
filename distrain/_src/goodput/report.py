"""Reads a goodput ledger back: every second of a run, across its attempts, in buckets.

An *attempt* is one chief process (one start record). Within an attempt the ledger's
totals say where the time went; between attempts nothing trained (``downtime``: from
an attempt's last record to the next one's process start, so a SIGKILL's unrecorded
tail counts there: at most the ledger's interval while steps run, all of a final
evaluation that was killed), except the part a hang took: when ``distrain launch
--hang-timeout`` found the attempt hung, the next attempt's start record says since when,
and the gap from then to the detection is ``hang``. An attempt that did not finish its
work and was followed by one that resumed from step ``r`` lost everything it did after
its record of step ``r`` (``lost``; the steps are redone); one followed by an attempt
that resumed from nothing lost all of it. The buckets add up to the wall time from the first process
start to the last record.

Example:
  >>> r = report("runs/exp")
  >>> print(r.table())
  >>> r.goodput            # productive step time / wall time
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from typing import Any

from distrain._src.goodput.ledger import BUCKETS, FILENAME, PHASES

#: The report's buckets, in the order of the table (productive step time first).
_CHARGED = tuple(b for b in BUCKETS if b != "step")  # the ledger's buckets, step time aside
REPORT_BUCKETS = ("productive", *_CHARGED, "lost", "downtime")
_REDONE = (*PHASES, "other")  # what a failure loses


@dataclasses.dataclass(frozen=True)
class Attempt:
    """One chief process of the run, as the ledger saw it."""

    id: str
    start: float
    end: float
    buckets: dict[str, float]
    first_step: int | None
    last_step: int | None
    resumed_from: int | None
    restore: tuple[str, float] | None  # (tier, seconds) of the restore it resumed from
    milestones: dict[str, float]  # seconds from the process start to each (``milestone``)
    finished: bool  # finished the run's work (a fit_end record: ``Ledger.finished``)
    after_hang: dict[str, Any] | None  # the launcher's note: the attempt before it hung
    saves: tuple[tuple[float, int], ...]
    records: tuple[tuple[float, int | None, dict[str, float]], ...]  # (t, step, totals)


@dataclasses.dataclass(frozen=True)
class Report:
    """Where the wall time of a run went.

    Attributes:
      wall_s: from the first process start to the last record.
      buckets_s: seconds per bucket (``REPORT_BUCKETS``); they sum to ``wall_s``.
      goodput: productive step time / wall time.
      attempts: the chief processes, in order.
      failures: attempts that did not finish the run's work (training, and the final
        evaluation of ``distrain train``) and were followed by another.
      lost_steps_per_failure: for each failure, steps it ran past the step the next
        attempt resumed from.
      skipped_lines: ledger lines that could not be read (a line torn by a kill).
    """

    wall_s: float
    buckets_s: dict[str, float]
    goodput: float
    attempts: tuple[Attempt, ...]
    failures: int
    lost_steps_per_failure: tuple[int, ...]
    skipped_lines: int

    def to_json(self) -> dict[str, Any]:
        """The figures as JSON-compatible values (what ``distrain goodput --json`` writes)."""
        return {
            "wall_s": self.wall_s,
            "buckets_s": self.buckets_s,
            "goodput": self.goodput,
            "failures": self.failures,
            "lost_steps_per_failure": list(self.lost_steps_per_failure),
            "attempts": [
                {
                    "id": a.id,
                    "start": a.start,
                    "seconds": a.end - a.start,
                    "steps": [a.first_step, a.last_step],
                    "resumed_from": a.resumed_from,
                    "restore": None
                    if a.restore is None
                    else {"source": a.restore[0], "seconds": a.restore[1]},
                    "milestones_s": a.milestones,
                    "finished": a.finished,
                    "saves": len(a.saves),
                }
                for a in self.attempts
            ],
            "skipped_lines": self.skipped_lines,
        }

    def table(self) -> str:
        """A table of the buckets: seconds and share of the wall time."""
        rows = [f"{'bucket':<12}{'seconds':>10}{'share':>8}"]
        for name in REPORT_BUCKETS:
            s = self.buckets_s[name]
            rows.append(f"{name:<12}{s:>10.1f}{s / self.wall_s:>8.1%}")
        rows.append(f"{'wall':<12}{self.wall_s:>10.1f}{1:>8.0%}")
        lost = ", ".join(map(str, self.lost_steps_per_failure)) or "-"
        rows.append(
            f"goodput {self.goodput:.1%} over {len(self.attempts)} attempt(s), "
            f"{self.failures} failure(s) (steps lost each: {lost})"
        )
        if self.failures:  # what the step count can and cannot see
            rows.append(
                "(steps lost: from the step the next attempt resumed from to the failed "
                "attempt's last ledger record; an estimate: a step is recorded when it is "
                "dispatched, and steps after the last record, at most one interval's, are "
                "not seen)"
            )
        return "\n".join(rows)

    def plot(self, path: str | os.PathLike[str]) -> None:
        """Draws the run's timeline to a PNG: one band per attempt, coloured by bucket,
        saves as ticks, failures as crosses (needs matplotlib: ``distrain[examples]``)."""
        from distrain._src.goodput.timeline import plot_timeline

        plot_timeline(self, os.fspath(path))


def read_records(workdir: str | os.PathLike[str]) -> tuple[list[dict[str, Any]], int]:
    """The ledger's records in file order, and how many lines could not be read."""
    path = os.path.join(os.fspath(workdir), FILENAME)
    if not os.path.exists(path):
        islands = sorted(
            glob.glob(os.path.join(glob.escape(os.fspath(workdir)), "island-*", FILENAME))
        )
        if islands:  # dt.experimental.islands.train: a ledger per island, none for the run
            found = ", ".join(os.path.dirname(p) for p in islands)
            raise FileNotFoundError(
                f"No goodput ledger at {path}: {workdir} is a run of islands, and each island "
                f"has its own ledger ({found}). Pass one island's directory, e.g. "
                f"`distrain goodput {os.path.dirname(islands[0])}`."
            )
        raise FileNotFoundError(
            f"No goodput ledger at {path}. A run writes one where the dt.callbacks.Goodput "
            "callback (or distrain train with logging.dir set) points; pass that directory."
        )
    records, skipped = [], 0
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
                if not (isinstance(record, dict) and {"event", "t", "attempt"} <= set(record)):
                    raise ValueError(line)
            except ValueError:
                skipped += 1  # torn by a kill mid-write, or not ours
                continue
            records.append(record)
    return records, skipped


def _attempts(records: list[dict[str, Any]]) -> list[Attempt]:
    by_id: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_id.setdefault(r["attempt"], []).append(r)
    out = []
    for aid, rs in by_id.items():
        # The start record holds the process start; without it (torn), the first record's
        # totals count back to it.
        start = next(
            (r["process_start"] for r in rs if r["event"] == "start"),
            rs[0]["t"] - sum(rs[0]["buckets"].values()),
        )
        steps = [r["step"] for r in rs if r.get("step") is not None]
        begun = next((r for r in rs if r["event"] == "start"), {})
        milestones = {k: v - float(start) for k, v in begun.get("milestones", {}).items()}
        resume = next((r for r in rs if r["event"] == "resume"), None)
        resumed = None if resume is None else resume["step"]
        restore = None
        if resume is not None and "source" in resume:
            restore = (str(resume["source"]), float(resume["seconds"]))
        out.append(
            Attempt(
                id=aid,
                start=float(start),
                end=float(rs[-1]["t"]),
                buckets={k: float(rs[-1]["buckets"].get(k, 0.0)) for k in BUCKETS},
                first_step=steps[0] if steps else None,
                last_step=steps[-1] if steps else None,
                resumed_from=resumed,
                restore=restore,
                milestones=milestones,
                finished=any(r["event"] == "fit_end" for r in rs),
                after_hang=begun.get("after_hang"),
                saves=tuple((r["t"], r["step"]) for r in rs if r["event"] == "save"),
                records=tuple((r["t"], r.get("step"), r["buckets"]) for r in rs),
            )
        )
    return sorted(out, key=lambda a: a.start)


def _redone_since(a: Attempt, step: int) -> dict[str, float]:
    """Seconds per bucket that ``a`` spent after its last record at or before ``step``:
    the work a resume from ``step`` does again."""
    base = dict.fromkeys(_REDONE, 0.0)
    for _t, s, totals in a.records:
        if s is not None and s <= step:
            base = {k: float(totals.get(k, 0.0)) for k in _REDONE}
    return {k: max(0.0, a.buckets[k] - base[k]) for k in _REDONE}


def report(workdir: str | os.PathLike[str]) -> Report:
    """Reads ``workdir/goodput.jsonl`` and accounts for every second of the run.

    Raises:
      FileNotFoundError: no ledger in ``workdir``.
      ValueError: the ledger holds no readable record.
    """
    records, skipped = read_records(workdir)
    if not records:
        raise ValueError(
            f"The goodput ledger in {workdir} holds no readable record ({skipped} lines "
            "skipped). Was the run started with a ledger, and did it reach its first step?"
        )
    attempts = _attempts(records)
    buckets = dict.fromkeys(REPORT_BUCKETS, 0.0)
    failures, lost_steps = 0, []
    for i, a in enumerate(attempts):
        buckets["productive"] += a.buckets["step"]
        for k in _CHARGED:
            buckets[k] += a.buckets[k]
        nxt = attempts[i + 1] if i + 1 < len(attempts) else None
        if nxt is None:
            continue
        gap = max(0.0, nxt.start - a.end)
        if nxt.after_hang is not None:  # from the stall to its detection nothing moved
            stalled = float(nxt.after_hang["detected"]) - max(a.end, nxt.after_hang["since"])
            hung = min(gap, max(0.0, stalled))
            buckets["hang"] += hung
            gap -= hung
        buckets["downtime"] += gap
        if a.finished:
            continue
        failures += 1
        resume = nxt.resumed_from if nxt.resumed_from is not None else 0
        for k, v in _redone_since(a, resume).items():  # leaves its bucket, becomes lost
            buckets["productive" if k == "step" else k] -= v
            buckets["lost"] += v
        lost_steps.append(max(0, (a.last_step or 0) - resume))
    wall = attempts[-1].end - attempts[0].start
    return Report(
        wall_s=wall,
        buckets_s=buckets,
        goodput=buckets["productive"] / wall if wall > 0 else 0.0,
        attempts=tuple(attempts),
        failures=failures,
        lost_steps_per_failure=tuple(lost_steps),
        skipped_lines=skipped,
    )
