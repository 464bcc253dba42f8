"""Fault-isolated islands under SIGKILL: rows, stalls, rejoins and the held-out loss.

Four islands (``distrain launch --islands 4``, one JAX process each, a Ray coordinator)
train the character-level transformer of ``benchmarks/islands.py`` (smaller here) on
TinyShakespeare (``../shared/data/``, or ``--data``): ``--epochs`` (3) passes over the
non-overlapping windows of ``seq_len + 1`` bytes of the training text, each in a
permutation seeded by the seed; 16 rows per inner step, 20 inner steps per round
(36 rounds without kills). Arms, one after the other, each in its own directory:

* **unkilled**, seeds 0, 1, 2: the seed spread of the final held-out loss;
* **killed**, seed 0: island 1 is SIGKILLed twice by this driver, each time about half
  a round into a round, after its live incarnation trained 3 rounds; the launcher
  restarts it (``--max-restarts 3``) and it joins again while the others go on;
* **solo**, first: one island alone (``--islands 1``) for one round, nothing else
  running: the cold start that a rejoin is held against.

Read from the runs' files (the coordinator's ``events.jsonl``, ``rows/`` and every
island's ``timeline.jsonl`` and goodput ledger):

* ``rows_lost``, ``rows_duplicated``: the committed positions against ``0 .. total-1``
  (every row of every pass must enter exactly one applied round);
* ``max_stall_s``: over the rounds, the barrier's wait beyond the slowest live island
  (``ready - last_submit``: a dead island holds its round for ``death_timeout``);
* ``rejoin_s``: per kill, the kill to the new incarnation's first step, broken down
  into spawn, import and init, connect, join, wait for the next round, compile and
  first step; ``cold_start_s``: the same for island 1's first incarnation (its process
  start to its first step, which includes waiting for every island at round 0);
  ``cold_start_solo_s``: the same for the solo arm's island (the rejoin target's
  reference: one island starting alone);
* ``schedule_count_after_rejoin``: per rejoin, every ``count`` in the optimizer state
  the new incarnation starts from (its timeline's ``joined_state``), and
  ``schedule_count_expected``: the round it first trained (the coordinator's record)
  times ``sync_every``, where a learning-rate schedule must go on;
* ``killed_vs_unkilled_loss_gap``: killed minus unkilled, final held-out loss, seed 0;
  ``seed_spread``: max - min over the unkilled seeds;
* the goodput of each island of the killed arm, the curves, and the targets.

Island 0 snapshots the global parameters every ``--eval-every`` rounds and at the end
(``on_round``); the driver evaluates them after every arm ran (so evaluations do not
slow the islands' rounds), into ``DIR/curve.jsonl``.

The islands compile their programs afresh (no persistent compilation cache, unless
``--compile-cache DIR``): a restarted island pays its compilation again.

``--nproc-per-island P``: each island is a ``jax.distributed`` world of ``P`` processes
(one CPU device each; ``dt.MultiWorkerMirroredStrategy``), its process 0 the one that
talks to the coordinator and the one the killer SIGKILLs; ``nproc_per_island`` in the
results.

``--toy``: 2 islands, seeds 0 and 1, a tiny model, short rounds, kills after 1 round,
and one compilation cache shared by the arms (smoke-test speed, not a measurement).
The test runs it with ``--rows 1024 --min-islands 2``: a short run whose island 0
waits for each rejoin (with the default ``--min-islands 1`` the survivors train on
alone, which is what the figures measure, and a short run could end first).

Example::

    python -m benchmarks.islands_faults --json benchmarks/results/islands_faults.json \\
        --plot docs/islands_faults.png
    python -m benchmarks.islands_faults --toy --data some.txt --json /tmp/faults.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import portable
from benchmarks.islands import DATA, ROOT
from benchmarks.islands import TOY as TOY_MODEL

OUT = ROOT / "benchmarks" / "results" / "islands_faults.json"
MODEL = ["model.kwargs.d_model=64", "model.kwargs.n_layers=2", "model.kwargs.n_heads=4"]
TOY = [*TOY_MODEL, "model.kwargs.seq_len=32"]
KILLED_ISLAND = 1

HELDOUT_FRACTION = 0.1  # examples.lm.data.load_tinyshakespeare's split


# --- the worker: one island -----------------------------------------------------------


def _seq_len(overrides: list[str]) -> int:
    for o in reversed(overrides):
        if o.startswith("model.kwargs.seq_len="):
            return int(o.split("=", 1)[1])
    return 64  # configs/shakespeare_char.yaml


def _num_rows(data: Path, seq_len: int, cap: int | None, per_round: int) -> int:
    """Non-overlapping windows of ``seq_len + 1`` bytes in the training split, a multiple
    of a round's rows with every island (no partial batch: its shape would compile)."""
    train_bytes = int(round(data.stat().st_size * (1.0 - HELDOUT_FRACTION)))
    n = train_bytes // (seq_len + 1)
    n = min(n, cap) if cap else n
    if n < per_round:
        raise SystemExit(
            f"{data}: {n} rows of {seq_len + 1} bytes, fewer than a round's {per_round}"
        )
    return n - n % per_round


def worker(args: argparse.Namespace) -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    import distrain as dt
    from benchmarks.islands import Recipe

    # An island of several processes joins its world before any other JAX call.
    several = int(os.environ.get("DISTRAIN_NUM_PROCESSES", "1")) > 1
    strategy = dt.MultiWorkerMirroredStrategy() if several else None

    island = int(os.environ["DISTRAIN_ISLAND"])
    islands = int(os.environ["DISTRAIN_ISLANDS"])
    overrides = TOY if args.toy else MODEL
    seq_len = _seq_len(overrides)
    num_rows = _num_rows(args.data, seq_len, args.rows, islands * args.batch * args.sync_every)
    # The inner optimizer's schedule spans the inner steps of one island.
    steps = math.ceil(num_rows * args.epochs / (islands * args.batch))
    recipe = Recipe(overrides, steps, args.data, args.batch)
    assert recipe.seq_len == seq_len, (recipe.seq_len, seq_len)
    windows = recipe.train[: num_rows * (seq_len + 1)].reshape(num_rows, seq_len + 1)
    state = dt.TrainState.create(params=recipe.params, tx=recipe.tx)
    directory = Path(args.worker)
    snapshots = directory / "snapshots"
    last: list[int] = []
    # Island 0's process 0 writes (each process of the island has the same parameters).
    writer = island == 0 and jax.process_index() == 0

    def on_round(r: int, params: Any) -> None:
        """Island 0: the global parameters every ``eval_every`` rounds; the final call
        (every row committed) comes last and is saved after ``train`` returns."""
        last[:] = [r]
        if writer and r % args.eval_every == 0:
            _snapshot(snapshots, r, params)

    result = dt.experimental.islands.train(
        recipe.step,  # its "loss" is a dt.metrics.Mean
        state,
        {"tokens": windows},
        batch_size=args.batch,
        sync_every=args.sync_every,
        directory=str(directory),
        epochs=args.epochs,
        seed=args.seed,
        death_timeout=args.death_timeout,
        heartbeat_interval=args.heartbeat,
        start_timeout=120.0,
        min_islands=args.min_islands,
        min_islands_timeout=120.0,
        on_round=on_round,
        heal_from_peer=args.heal,
        strategy=strategy,
    )
    if writer:
        _snapshot(snapshots, last[0], result.params, final=True)
    print(f"island {island} finished: {result.rounds} rounds, jax {jax.__version__}", flush=True)


def _snapshot(root: Path, r: int, params: Any, final: bool = False) -> None:
    import jax

    root.mkdir(parents=True, exist_ok=True)
    leaves = {f"p{k}": np.asarray(x) for k, x in enumerate(jax.tree.leaves(params))}
    path = root / f"round-{r:05d}{'-final' if final else ''}.npz"
    np.savez(str(path) + ".tmp.npz", **leaves)
    os.replace(str(path) + ".tmp.npz", path)


# --- the driver -------------------------------------------------------------------------


def _lines(path: Path) -> list[dict[str, Any]]:
    """A JSON-lines file's records (a line torn by a kill is skipped)."""
    out = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
    except FileNotFoundError:
        pass
    return out


class Killer(threading.Thread):
    """SIGKILLs island ``KILLED_ISLAND`` ``kills`` times: when its live incarnation has
    trained ``after`` rounds (its round R), it waits for round R + 1 to open (the
    coordinator's record of R) and about half a round (the last round's compute_s / 2)
    more, then kills that incarnation's pid. Never the same pid twice."""

    def __init__(self, directory: Path, kills: int, after: int, done: threading.Event):
        super().__init__(daemon=True, name="killer")
        self.timeline = directory / f"island-{KILLED_ISLAND}" / "timeline.jsonl"
        self.events = directory / "events.jsonl"
        self.kills_wanted, self.after, self.done = kills, after, done
        self.kills: list[dict[str, Any]] = []
        self.error: str | None = None

    def run(self) -> None:
        try:
            self._run()
        except Exception as e:  # noqa: BLE001 - reported in the results
            self.error = f"{type(e).__name__}: {e}"

    def _run(self) -> None:
        killed: set[int] = set()
        while len(self.kills) < self.kills_wanted and not self.done.wait(0.05):
            tl = _lines(self.timeline)
            starts = [i for i, e in enumerate(tl) if e["event"] == "start"]
            if not starts or any(e["event"] == "finished" for e in tl):
                continue
            start = tl[starts[-1]]
            pid = int(start["pid"])
            rounds = [e for e in tl[starts[-1] :] if e["event"] == "round"]
            if pid in killed or len(rounds) < self.after:
                continue
            last = rounds[-1]
            opened = None  # the coordinator applied round R: R + 1 opens
            while opened is None and not self.done.wait(0.02):
                closed = [
                    e for e in _lines(self.events) if e["event"] == "round"
                    and e["round"] == last["round"]
                ]  # fmt: skip
                opened = closed[0]["closed"] if closed else None
            if opened is None:
                return
            at = max(opened, last["t"]) + float(last["compute_s"]) / 2
            if self.done.wait(max(0.0, at - time.time())):
                return
            killed.add(pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            t = time.time()
            self.kills.append(
                {"pid": pid, "t": t, "after_round": last["round"], "into_round_s": t - opened}
            )
            print(f"[faults] killed island {KILLED_ISLAND} (pid {pid}) at t={t:.2f}", flush=True)


def _run_arm(
    args: argparse.Namespace, directory: Path, seed: int, kill: bool, log: Path, heal: bool = False
) -> dict[str, Any]:
    """One `distrain launch --islands N` run; the killer thread beside it if ``kill``."""
    command = [
        sys.executable, "-m", "distrain.cli", "launch", "--islands", str(args.islands),
        "--nproc-per-island", str(args.nproc_per_island), "--max-restarts", "3", "--",
        sys.executable, "-m", "benchmarks.islands_faults", "--worker", str(directory),
        "--seed", str(seed), "--data", str(args.data), "--batch", str(args.batch),
        "--sync-every", str(args.sync_every), "--epochs", str(args.epochs),
        "--eval-every", str(args.eval_every), "--death-timeout", str(args.death_timeout),
        "--heartbeat", str(args.heartbeat), "--min-islands", str(args.min_islands),
        *(["--rows", str(args.rows)] if args.rows else []),
        *(["--toy"] if args.toy else []),
        *(["--heal"] if heal else []),
    ]  # fmt: skip
    flags = re.sub(
        r"--xla_force_host_platform_device_count=\S*", "", os.environ.get("XLA_FLAGS", "")
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "JAX_PLATFORMS": "cpu",
        # One device per process: an island of one process is one replica.
        "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count=1".strip(),
    }
    if args.compile_cache:  # every compilation, however short, goes to the cache
        env.update(
            {
                "JAX_COMPILATION_CACHE_DIR": str(args.compile_cache),
                "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
            }
        )
    done = threading.Event()
    killer = Killer(directory, 2, args.kill_after, done) if kill else None
    t0 = time.time()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        if killer:
            killer.start()
        try:
            code = proc.wait(timeout=args.arm_timeout)
        except subprocess.TimeoutExpired:
            # The launcher stops its islands and its Ray head on SIGTERM; then the group.
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
            code = f"timeout after {args.arm_timeout} s"
        finally:
            done.set()
    wall = time.time() - t0
    if killer:
        killer.join(timeout=10)
    if code != 0:
        tail = log.read_text(errors="replace")[-3000:]
        print(f"[faults] arm seed {seed} kill={kill} failed ({code}):\n{tail}", file=sys.stderr)
    return {
        "seed": seed,
        "killed": kill,
        "heal": heal,
        "exit": code,
        "wall_s": wall,
        "t_start": t0,
        "command": portable.command(command),
        "kills": killer.kills if killer else [],
        "killer_error": killer.error if killer else None,
    }


def _rows(directory: Path, total: int) -> dict[str, int]:
    from distrain._src.islands.island_coordinator import committed_rows

    committed = committed_rows(str(directory)).astype(np.int64)
    unique = np.unique(committed)
    inside = unique[(unique >= 0) & (unique < total)]
    return {
        "rows_total": total,
        "rows_committed": int(committed.size),
        "rows_lost": int(total - inside.size),
        "rows_duplicated": int(committed.size - unique.size),
        "rows_out_of_range": int(unique.size - inside.size),
    }


def _breakdown(
    timeline: list[dict[str, Any]], start_index: int, t0: float, ready: float | None
) -> dict[str, Any]:
    """One incarnation's way from ``t0`` (a kill, or its process start) to its first
    step: the timeline's milestones after its "start" record. ``ready``: when the round
    it first trains could open (None: not known)."""
    start = timeline[start_index]
    after = {}
    for e in timeline[start_index + 1 :]:
        if e["event"] == "start":
            break
        after.setdefault(e["event"], e["t"])
    ps = float(start["process_start"])
    joined, first = after.get("joined"), after.get("first_step")
    out: dict[str, Any] = {
        "pid": start["pid"],
        "spawn_s": ps - t0,
        "import_init_s": start["t"] - ps,
        "connect_s": after["connected"] - start["t"] if "connected" in after else None,
        "join_s": (
            joined - after["connected"] if joined is not None and "connected" in after else None
        ),
        "joined_to_first_step_s": first - joined if first is not None and joined else None,
        "total_s": first - t0 if first is not None else None,
    }
    if first is not None and joined is not None and ready is not None:
        wait = min(max(0.0, ready - joined), first - joined)
        out["wait_for_round_s"] = wait  # part of joined_to_first_step_s
        out["compile_first_step_s"] = first - joined - wait
    return out


def _analyze(
    directory: Path, arm: dict[str, Any], total: int, islands: int, sync_every: int
) -> dict[str, Any]:
    events = _lines(directory / "events.jsonl")
    rounds = sorted((e for e in events if e["event"] == "round"), key=lambda e: e["round"])
    compute = [float(m["compute_s"]) for e in rounds for m in e["metrics"].values()]
    stalls = [e["ready"] - e["last_submit"] for e in rounds]
    arm.update(_rows(directory, total))
    arm.update(
        {
            "rounds": len(rounds),
            "round_compute_s_median": float(np.median(compute)) if compute else None,
            "round_wall_s_median": (
                float(np.median([e["closed"] - e["opened"] for e in rounds])) if rounds else None
            ),
            "max_stall_s": max(stalls) if stalls else None,
            "stalls_s": [round(s, 3) for s in stalls],
            "islands_per_round": [len(e["islands"]) for e in rounds],
            "dead": [e for e in events if e["event"] == "dead"],
        }
    )
    # Rows committed before each round: the curve's tokens.
    arm["_rows_before"] = np.concatenate(
        [[0], np.cumsum([sum(e["rows"].values()) for e in rounds])]
    ).tolist()
    # Where the arm's wall time went outside the islands' lives: the launcher and its Ray
    # head before the first island process started, and the shutdown after the last
    # island finished.
    lives = [_lines(directory / f"island-{i}" / "timeline.jsonl") for i in range(islands)]
    first_start = min((e["process_start"] for tl in lives for e in tl if e["event"] == "start"),
                      default=None)  # fmt: skip
    finished = max((e["t"] for tl in lives for e in tl if e["event"] == "finished"), default=None)
    arm["launch_to_first_island_s"] = first_start - arm["t_start"] if first_start else None
    arm["last_finished_to_exit_s"] = arm["t_start"] + arm["wall_s"] - finished if finished else None
    arm["first_round_open_to_last_close_s"] = (
        rounds[-1]["closed"] - rounds[0]["opened"] if rounds else None
    )
    tl = _lines(directory / f"island-{KILLED_ISLAND}" / "timeline.jsonl")
    starts = [i for i, e in enumerate(tl) if e["event"] == "start"]
    joins = [e for e in events if e["event"] == "join"]
    if starts:  # the cold start: round 0 opens when the last island joined
        first_joins = {}
        for e in joins:
            first_joins.setdefault(e["island"], e["t"])
        ready = max(first_joins.values()) if len(first_joins) == islands else None
        first = tl[starts[0]]
        arm["cold_start"] = _breakdown(tl, starts[0], float(first["process_start"]), ready)
    arm["rejoins"] = []
    for kill in arm["kills"]:
        later = [i for i in starts if tl[i]["pid"] != kill["pid"] and tl[i]["t"] > kill["t"]]
        if not later:
            arm["rejoins"].append({"kill_t": kill["t"], "rejoin_s": None})
            continue
        j = later[0]
        # The round its join enrolled it in opens when the previous one is applied.
        join = next(
            (e for e in joins if e["island"] == KILLED_ISLAND and e["t"] > tl[j]["t"]), None
        )
        ready = None
        if join is not None:
            prev = [e for e in rounds if e["round"] == join["round"] - 1]
            ready = prev[0]["closed"] if prev else join["t"]
        b = _breakdown(tl, j, kill["t"], ready)
        dead = [
            e for e in events
            if e["event"] == "dead" and e["island"] == KILLED_ISLAND and e["t"] > kill["t"]
        ]  # fmt: skip
        b["detected_dead_s"] = dead[0]["t"] - kill["t"] if dead else None
        b["rows_returned"] = dead[0]["rows_returned"] if dead else None
        b["kill_t"] = kill["t"]
        b["rejoin_s"] = b.pop("total_s")
        b["enrolled_round"] = join["round"] if join else None
        b.update(_counts(tl, j, rounds, sync_every))
        arm["rejoins"].append(b)
    return arm


def _counts(
    timeline: list[dict[str, Any]], start_index: int, rounds: list[dict[str, Any]], h: int
) -> dict[str, Any]:
    """The optimizer counts the incarnation at ``start_index`` started from, and the step
    they must be at: the first round the coordinator applied with its submission, x H."""
    start = timeline[start_index]
    joined = next((e for e in timeline[start_index + 1 :] if e["event"] == "joined_state"), {})
    counts = joined.get("counts")
    heal = next((e for e in timeline[start_index + 1 :] if e["event"] == "heal"), {})
    first = next(
        (e["round"] for e in rounds if KILLED_ISLAND in e["islands"] and e["ready"] > start["t"]),
        None,
    )
    return {"optimizer_counts": counts, "optimizer_counts_expected": None if first is None
            else first * h, "healed_from": joined.get("healed_from"),
            "heal_wait_s": heal.get("wait_s"), "heal_why": heal.get("why")}  # fmt: skip


def _solo(directory: Path) -> dict[str, Any] | None:
    """The solo arm's island, its process start to its first step (round 0 opens as soon
    as it joined: it is alone)."""
    tl = _lines(directory / "island-0" / "timeline.jsonl")
    starts = [i for i, e in enumerate(tl) if e["event"] == "start"]
    if not starts:
        return None
    joined = next((e["t"] for e in tl if e["event"] == "joined"), None)
    return _breakdown(tl, starts[0], float(tl[starts[0]]["process_start"]), joined)


def _evaluate(recipe: Any, directory: Path, arm: dict[str, Any], eval_rows: int) -> None:
    """Held-out loss of island 0's snapshots -> ``arm["curve"]`` and DIR/curve.jsonl."""
    import jax

    treedef = jax.tree.structure(recipe.params)
    curve = []
    rows_before = arm.pop("_rows_before")
    paths = sorted((directory / "snapshots").glob("round-*.npz"))
    finals = {p.name[6:11] for p in paths if p.name.endswith("-final.npz")}
    for path in paths:
        r = int(path.name[6:11])
        if path.name[6:11] in finals and not path.name.endswith("-final.npz"):
            continue  # the final parameters, saved again after train returned
        with np.load(path) as z:
            params = jax.tree.unflatten(treedef, [z[f"p{k}"] for k in range(len(z.files))])
        rows = rows_before[min(r, len(rows_before) - 1)]
        curve.append(
            {
                "round": r,
                "tokens": int(rows * recipe.seq_len),
                "loss": recipe.heldout_loss(params, eval_rows),
                "final": path.name.endswith("-final.npz"),
            }
        )
    with open(directory / "curve.jsonl", "w") as f:
        for point in curve:
            f.write(json.dumps(point) + "\n")
    arm["curve"] = curve
    finals = [p["loss"] for p in curve if p["final"]]
    arm["final_loss"] = finals[-1] if finals else None
    for kill in arm["kills"]:  # the tokens at the kill: rows of the rounds closed before
        closed = [e for e in _lines(directory / "events.jsonl") if e["event"] == "round"]
        n = sum(1 for e in closed if e["closed"] < kill["t"])
        kill["tokens"] = int(rows_before[min(n, len(rows_before) - 1)] * recipe.seq_len)


def _goodput(directory: Path, islands: int) -> dict[str, Any]:
    from distrain._src.goodput.report import report

    out = {}
    for i in range(islands):
        try:
            r = report(str(directory / f"island-{i}"))
            out[str(i)] = {
                "goodput": r.goodput,
                "wall_s": r.wall_s,
                "attempts": len(r.attempts),
                "buckets_s": r.buckets_s,
            }
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            out[str(i)] = {"error": f"{type(e).__name__}: {e}"}
    return out


def targets(r: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The targets, met or not, from a result's headline fields."""
    stall, round_s, dt = r["max_stall_s"], r["round_s"], r["death_timeout_s"]
    rejoin, cold = r["rejoin_s"], r["cold_start_solo_s"]
    counts, expected = r["schedule_count_after_rejoin"], r["schedule_count_expected"]
    gap, spread = r["killed_vs_unkilled_loss_gap"], r["seed_spread"]
    return {
        "stall": {
            "target": "max_stall_s <= death_timeout_s + round_s",
            "limit": dt + round_s if _finite(round_s) else None,
            "met": _finite(stall) and _finite(round_s) and stall <= dt + round_s,
        },
        "rejoin": {
            "target": "every rejoin_s <= 1.5 x cold_start_solo_s",
            "limit": 1.5 * cold if _finite(cold) else None,
            "met": bool(rejoin)
            and all(map(_finite, rejoin))
            and _finite(cold)
            and max(rejoin) <= 1.5 * cold,
        },
        "loss_gap": {
            # Within 3 seed spreads either way; met_signed: the kills cost at most that.
            "target": "|killed_vs_unkilled_loss_gap| <= 3 x seed_spread",
            "limit": 3 * spread if _finite(spread) else None,
            "met": _finite(gap) and _finite(spread) and abs(gap) <= 3 * spread,
            "met_signed": _finite(gap) and _finite(spread) and gap <= 3 * spread,
            "gap_in_spreads": gap / spread if _finite(gap) and _finite(spread) and spread else None,
        },
        "rows": {
            "target": "rows_lost == 0 and rows_duplicated == 0 (killed arm)",
            "met": r["rows_lost"] == 0 and r["rows_duplicated"] == 0,
        },
        "schedule": {
            "target": "every count in schedule_count_after_rejoin == schedule_count_expected",
            "met": bool(counts)
            and len(counts) == len(expected)
            and all(
                c and e is not None and all(x == e for x in c)
                for c, e in zip(counts, expected, strict=True)
            ),
        },
    }


def plot(result: dict[str, Any], path: Path) -> None:
    """Held-out loss against training tokens: the unkilled seeds and the run with kills
    (its kills marked)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for arm in result["arms"]:
        if arm["killed"] or not arm.get("curve"):
            continue
        c = arm["curve"]
        ax.plot(
            [p["tokens"] / 1e6 for p in c], [p["loss"] for p in c], color="tab:blue",
            alpha=0.35 + 0.2 * (arm["seed"] == 0), lw=1.2,
            label="no kills" if arm["seed"] == 0 else None,
        )  # fmt: skip
    seeds = sorted(a["seed"] for a in result["arms"] if not a["killed"])
    for arm in result["arms"]:
        if not arm["killed"] or arm.get("heal") or arm["seed"] != seeds[0] or not arm.get("curve"):
            continue
        c = arm["curve"]
        ax.plot(
            [p["tokens"] / 1e6 for p in c], [p["loss"] for p in c], color="tab:red", lw=1.6,
            label=f"island {KILLED_ISLAND} SIGKILLed {len(arm['kills'])}x (seed {arm['seed']})",
        )  # fmt: skip
        for k, kill in enumerate(arm["kills"]):
            ax.axvline(
                kill.get("tokens", 0) / 1e6, color="tab:red", ls=":", lw=1,
                label="kills" if k == 0 else None,
            )  # fmt: skip
    # The first evaluation (the initial model) is far above the rest: zoom on the rest.
    later = [p["loss"] for a in result["arms"] for p in a.get("curve", [])[1:]]
    if later:
        ax.set_ylim(min(later) - 0.05, max(later) + 0.1)
    ax.set_xlabel("training tokens committed (millions)")
    ax.set_ylabel("held-out loss (nats per byte)")
    ax.set_title(
        f"TinyShakespeare, {result['islands']} fault-isolated islands "
        f"(no kills: seeds {', '.join(map(str, seeds))})",
        fontsize=10,
    )
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--toy", action="store_true", help="smoke-test size")
    parser.add_argument("--islands", type=int, default=None, help="default 4 (toy: 2)")
    parser.add_argument("--seeds", default=None, help="unkilled seeds (default 0,1,2; toy 0,1)")
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--json", type=Path, default=OUT)
    parser.add_argument("--plot", type=Path, default=None, help="a PNG of the curves")
    parser.add_argument("--replot", action="store_true", help="only redraw --plot from --json")
    parser.add_argument("--batch", type=int, default=None, help="rows per inner step")
    parser.add_argument("--sync-every", type=int, default=None, help="inner steps per round")
    parser.add_argument("--epochs", type=int, default=None, help="default 3 (toy: 2)")
    parser.add_argument("--rows", type=int, default=None, help="use the first ROWS windows")
    parser.add_argument("--eval-every", type=int, default=None, help="rounds")
    parser.add_argument("--eval-rows", type=int, default=None, help="held-out rows")
    parser.add_argument(
        "--nproc-per-island", type=int, default=1, help="processes per island (default 1)"
    )
    parser.add_argument("--death-timeout", type=float, default=5.0)
    parser.add_argument("--heartbeat", type=float, default=0.5)
    parser.add_argument(
        "--min-islands",
        type=int,
        default=1,
        help="rounds wait for this many live islands (1: the survivors train on alone, "
        "what the figures measure; 2: island 0 waits for each rejoin, so a short run "
        "cannot end before the killed island is back)",
    )
    parser.add_argument("--kill-after", type=int, default=None, help="rounds (toy: 1)")
    parser.add_argument("--arm-timeout", type=float, default=None, help="seconds per arm")
    parser.add_argument(
        "--compile-cache",
        type=Path,
        default=None,
        help="a JAX persistent compilation cache for the islands (default: none; --toy: "
        "one shared by its arms, so restarts and later arms skip compiling)",
    )
    parser.add_argument("--keep", type=Path, default=None, help="keep the runs' directories")
    parser.add_argument(
        "--heal-seeds",
        default=None,
        help="seeds of the heal comparison: killed arms with and without heal_from_peer "
        "(default 0,1,2; toy: none)",
    )
    parser.add_argument(
        "--only-heal",
        action="store_true",
        help="run only the heal comparison's arms (unkilled, killed, killed with healing, "
        "per heal seed) and add its 'heal' section to --json, keeping every other field",
    )
    parser.add_argument(
        "--resume",
        type=Path,
        default=None,
        help="the runs' directory of an interrupted driver: arms with an arm.json are kept",
    )
    parser.add_argument("--heal", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    defaults = (
        {"islands": 2, "seeds": "0,1", "batch": 16, "sync_every": 4, "epochs": 2,
         "rows": None, "eval_every": 60, "eval_rows": 64, "kill_after": 1,
         "arm_timeout": 240.0, "heal_seeds": ""}
        if args.toy else
        {"islands": 4, "seeds": "0,1,2", "batch": 16, "sync_every": 20, "epochs": 3,
         "rows": None, "eval_every": 4, "eval_rows": 512, "kill_after": 3,
         "arm_timeout": 600.0, "heal_seeds": "0,1,2"}
    )  # fmt: skip
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.data = args.data.resolve()
    if args.worker:
        worker(args)
        return {}
    if args.replot:
        plot(json.loads(args.json.read_text()), args.plot)
        return {}
    if not args.data.is_file():
        raise SystemExit(f"benchmarks/islands_faults.py: no text at {args.data}; pass --data.")
    overrides = TOY if args.toy else MODEL
    seq_len = _seq_len(overrides)
    num_rows = _num_rows(args.data, seq_len, args.rows, args.islands * args.batch * args.sync_every)
    total = num_rows * args.epochs
    seeds = [int(s) for s in args.seeds.split(",")]
    heal_seeds = [int(s) for s in args.heal_seeds.split(",") if s]
    t_start, load_start = time.time(), os.getloadavg()
    root = args.resume or Path(tempfile.mkdtemp(prefix="islands_faults-"))
    if args.toy and args.compile_cache is None:
        args.compile_cache = root / "jax-cache"
    if args.only_heal:
        return _only_heal(args, argv, root, heal_seeds, total, overrides, t_start, load_start)
    # One island alone, nothing else running: the cold start a rejoin is held against.
    solo_args = argparse.Namespace(
        **{
            **vars(args),
            "islands": 1,
            "epochs": 1,
            "rows": args.batch * args.sync_every,
            "min_islands": 1,
        }
    )
    solo_dir = root / "solo"
    solo_dir.mkdir()
    print(f"[faults] arm solo (one island, one round): {solo_dir}")
    solo_arm = _run_arm(solo_args, solo_dir, seeds[0], False, root / "solo.log")
    solo = _solo(solo_dir)
    solo_arm["cold_start"] = solo
    plan = [(s, False, False) for s in seeds] + [(seeds[0], True, False)]
    plan += [(s, True, False) for s in heal_seeds if s != seeds[0]]
    plan += [(s, True, True) for s in heal_seeds]
    arms = _run_arms(args, root, plan, total)
    steps = _evaluate_arms(args, root, arms, overrides, total)
    import jax

    killed = next(a for a in arms if a["killed"] and not a["heal"] and a["seed"] == seeds[0])
    base = next(a for a in arms if not a["killed"] and a["seed"] == killed["seed"])
    unkilled = [a for a in arms if not a["killed"]]
    killed["goodput"] = _goodput(killed["directory"], args.islands)
    round_s = base["round_compute_s_median"]
    rejoin = [r["rejoin_s"] for r in killed["rejoins"]]
    cold = killed.get("cold_start", {}).get("total_s")
    finals = [a["final_loss"] for a in unkilled]
    gap = (
        killed["final_loss"] - base["final_loss"]
        if _finite(killed["final_loss"]) and _finite(base["final_loss"])
        else None
    )
    spread = max(finals) - min(finals) if all(map(_finite, finals)) else None
    result: dict[str, Any] = {
        "command": "python -m benchmarks.islands_faults "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {
            "jax": jax.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpu_cores": os.cpu_count(),
            "backend": "cpu, one device per process",
        },
        "toy": args.toy,
        "islands": args.islands,
        "nproc_per_island": args.nproc_per_island,
        "killed_island": KILLED_ISLAND,
        "seeds": seeds,
        "model": overrides,
        "seq_len": seq_len,
        "batch_size": args.batch,
        "sync_every": args.sync_every,
        "epochs": args.epochs,
        "rows_per_epoch": num_rows,
        "inner_steps_schedule": steps,
        "eval_rows": args.eval_rows,
        "kill_after_rounds": args.kill_after,
        "death_timeout_s": args.death_timeout,
        "heartbeat_s": args.heartbeat,
        "min_islands": args.min_islands,
        "rows_lost": killed["rows_lost"],
        "rows_duplicated": killed["rows_duplicated"],
        "max_stall_s": killed["max_stall_s"],
        "round_s": round_s,
        "round_wall_s": base["round_wall_s_median"],
        "rejoin_s": rejoin,
        "rejoins": killed["rejoins"],
        "cold_start_s": cold,
        "cold_start": killed.get("cold_start"),
        "cold_start_solo_s": solo.get("total_s") if solo else None,
        "cold_start_solo": solo,
        "solo_arm": solo_arm,
        "schedule_count_after_rejoin": [r.get("optimizer_counts") for r in killed["rejoins"]],
        "schedule_count_expected": [r.get("optimizer_counts_expected") for r in killed["rejoins"]],
        "kills": killed["kills"],
        "killed_vs_unkilled_loss_gap": gap,
        "seed_spread": spread,
        "final_losses": {_arm_name(a): a["final_loss"] for a in arms},
        "goodput_killed": killed["goodput"],
        "wall_s": time.time() - t_start,
        "load_avg": {"start": load_start, "end": os.getloadavg()},
        "arms": [{k: v for k, v in a.items() if k != "directory"} for a in arms],
    }
    if heal_seeds:
        result["heal"] = heal_comparison(arms, heal_seeds, result["cold_start_solo_s"])
    result["targets"] = targets(result)
    result["all_targets_met"] = all(t["met"] for t in result["targets"].values())
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1, default=str) + "\n")
    if args.plot is not None:
        plot(result, args.plot)
    if args.keep is not None:
        shutil.copytree(root, args.keep, dirs_exist_ok=True)
    shutil.rmtree(root, ignore_errors=True)
    _summary(result)
    return result


def _arm_name(arm: dict[str, Any]) -> str:
    kind = ("killed_heal" if arm.get("heal") else "killed") if arm["killed"] else "unkilled"
    return f"{kind}_seed{arm['seed']}"


def _run_arms(
    args: argparse.Namespace, root: Path, plan: list[tuple[int, bool, bool]], total: int
) -> list[dict[str, Any]]:
    """The arms of ``plan`` (seed, killed, heal), one after the other, analysed."""
    arms = []
    for seed, kill, heal in plan:
        name = _arm_name({"seed": seed, "killed": kill, "heal": heal}).replace("_", "-")
        directory = root / name
        saved = directory / "arm.json"
        if saved.is_file():  # --resume: an arm that ran to its end before
            arm = json.loads(saved.read_text())
            print(f"[faults] arm {name}: resumed from {saved}", flush=True)
        else:
            arm = _run_arm_retried(args, root, directory, name, seed, kill, heal)
            saved.write_text(json.dumps(arm, default=str))
        arm["directory"] = directory
        arms.append(_analyze(directory, arm, total, args.islands, args.sync_every))
        print(
            f"[faults]   {arm['wall_s']:.0f} s, {arm['rounds']} rounds, exit {arm['exit']}, "
            f"rows lost {arm['rows_lost']} duplicated {arm['rows_duplicated']}, max stall "
            f"{arm['max_stall_s']}, load {os.getloadavg()[0]:.1f}",
            flush=True,
        )
    return arms


def _run_arm_retried(
    args: argparse.Namespace,
    root: Path,
    directory: Path,
    name: str,
    seed: int,
    kill: bool,
    heal: bool,
) -> dict[str, Any]:
    """One arm, started up to 3 times while no island reaches a coordinator (seen on a
    loaded machine: the local Ray head had not registered its node, or refused
    connections, and every island gave up)."""
    for attempt in range(3):
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir()
        print(f"[faults] arm {name}: {directory}", flush=True)
        arm = _run_arm(args, directory, seed, kill, root / f"{name}.log", heal=heal)
        arm["attempts"] = attempt + 1
        if (directory / "rows").is_dir():
            return arm
        print(f"[faults] arm {name} never started (exit {arm['exit']}); again", flush=True)
    raise SystemExit(f"[faults] arm {name} did not start in 3 attempts: see {root}/{name}.log")


def _evaluate_arms(
    args: argparse.Namespace,
    root: Path,
    arms: list[dict[str, Any]],
    overrides: list[str],
    total: int,
) -> int:
    """Held-out losses, after every arm ran (recipe.heldout_loss compiles its program at
    every call: a compilation cache of the driver's own makes the later calls loads).
    Returns the inner steps of the schedule."""
    t_eval = time.time()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_compilation_cache_dir", str(root / "driver-jax-cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

    from benchmarks.islands import Recipe

    steps = math.ceil(total / (args.islands * args.batch))
    recipe = Recipe(overrides, steps, args.data, args.batch)
    for arm in arms:
        _evaluate(recipe, arm["directory"], arm, args.eval_rows)
    print(f"[faults] evaluated the snapshots in {time.time() - t_eval:.0f} s", flush=True)
    return steps


def heal_comparison(
    arms: list[dict[str, Any]], seeds: list[int], cold_solo: float | None
) -> dict[str, Any]:
    """Killed minus unkilled final held-out loss per seed, and the rejoins, without and
    with ``heal_from_peer``; healing is to be the default if its mean |gap| is smaller
    at no more than +10 % mean rejoin_s."""

    def arm(seed: int, killed: bool, heal: bool) -> dict[str, Any]:
        return next(
            a for a in arms if a["seed"] == seed and a["killed"] == killed and a["heal"] == heal
        )

    def side(heal: bool) -> dict[str, Any]:
        gaps = []
        for s in seeds:
            k, u = arm(s, True, heal)["final_loss"], arm(s, False, False)["final_loss"]
            gaps.append(k - u if _finite(k) and _finite(u) else None)
        rejoins = [r for s in seeds for r in arm(s, True, heal)["rejoins"]]
        times = [r["rejoin_s"] for r in rejoins]
        ok = [g for g in gaps if _finite(g)]
        return {
            "killed_vs_unkilled_loss_gap": gaps,
            "mean_abs_gap": float(np.mean(np.abs(ok))) if len(ok) == len(gaps) else None,
            "rejoin_s": times,
            "rejoin_s_mean": float(np.mean(times)) if times and all(map(_finite, times)) else None,
            "healed_from": [r.get("healed_from") for r in rejoins],
            "heal_wait_s": [r.get("heal_wait_s") for r in rejoins],
            "heal_why": [r.get("heal_why") for r in rejoins],
            "optimizer_counts": [r.get("optimizer_counts") for r in rejoins],
            "optimizer_counts_expected": [r.get("optimizer_counts_expected") for r in rejoins],
            "rows_lost": [arm(s, True, heal)["rows_lost"] for s in seeds],
            "rows_duplicated": [arm(s, True, heal)["rows_duplicated"] for s in seeds],
        }

    without, with_ = side(False), side(True)
    gap_a, gap_b = without["mean_abs_gap"], with_["mean_abs_gap"]
    rj_a, rj_b = without["rejoin_s_mean"], with_["rejoin_s_mean"]
    better = _finite(gap_a) and _finite(gap_b) and gap_b < gap_a
    ratio = rj_b / rj_a if _finite(rj_a) and _finite(rj_b) and rj_a else None
    return {
        "seeds": seeds,
        "unkilled_final_losses": [arm(s, False, False)["final_loss"] for s in seeds],
        "without": without,
        "with": with_,
        "mean_abs_gap_smaller_with_healing": bool(better),
        "rejoin_s_ratio": ratio,
        "rule": "default on iff mean |gap| with < without and rejoin_s_ratio <= 1.10",
        "default_on": bool(better and ratio is not None and ratio <= 1.10),
        "rejoin_limit_s": 1.5 * cold_solo if _finite(cold_solo) else None,
        "rejoin_met": _finite(cold_solo)
        and bool(with_["rejoin_s"])
        and all(_finite(t) and t <= 1.5 * cold_solo for t in with_["rejoin_s"]),
    }


def _only_heal(
    args: argparse.Namespace,
    argv: list[str] | None,
    root: Path,
    seeds: list[int],
    total: int,
    overrides: list[str],
    t_start: float,
    load_start: tuple[float, float, float],
) -> dict[str, Any]:
    """``--only-heal``: the comparison's arms alone; its section goes into --json."""
    if not seeds:
        raise SystemExit("--only-heal needs --heal-seeds (e.g. 0,1,2)")
    plan = [(s, k, h) for s in seeds for k, h in ((False, False), (True, False), (True, True))]
    arms = _run_arms(args, root, plan, total)
    _evaluate_arms(args, root, arms, overrides, total)
    result = json.loads(args.json.read_text()) if args.json.is_file() else {}
    heal = heal_comparison(arms, seeds, result.get("cold_start_solo_s"))
    heal.update(
        {
            "command": "python -m benchmarks.islands_faults "
            + " ".join(argv if argv is not None else sys.argv[1:]),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "islands": args.islands,
            "epochs": args.epochs,
            "sync_every": args.sync_every,
            "batch_size": args.batch,
            "kill_after_rounds": args.kill_after,
            "death_timeout_s": args.death_timeout,
            "wall_s": time.time() - t_start,
            "load_avg": {"start": load_start, "end": os.getloadavg()},
            "arms": [{k: v for k, v in a.items() if k not in ("directory", "curve")} for a in arms],
        }
    )
    result["heal"] = heal
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1, default=str) + "\n")
    if args.keep is not None:
        shutil.copytree(root, args.keep, dirs_exist_ok=True)
    shutil.rmtree(root, ignore_errors=True)
    for name in ("without", "with"):
        h = heal[name]
        print(
            f"[faults] {name} healing: gaps {h['killed_vs_unkilled_loss_gap']}, mean |gap| "
            f"{h['mean_abs_gap']}, rejoin_s {h['rejoin_s']}, from {h['healed_from']}"
        )
    print(f"[faults] rejoin ratio {heal['rejoin_s_ratio']}; default on: {heal['default_on']}")
    return result


def _summary(r: dict[str, Any]) -> None:
    def f(x: Any, fmt: str = ".2f") -> str:
        return format(x, fmt) if _finite(x) else str(x)

    print(f"\n{r['islands']} islands, island {r['killed_island']} SIGKILLed {len(r['kills'])}x:")
    for a in r["arms"]:
        name = f"{'killed' if a['killed'] else 'unkilled'} seed {a['seed']}"
        print(
            f"  {name:16s} exit {a['exit']}  {a['rounds']:3d} rounds  {f(a['wall_s'], '.0f')} s  "
            f"rows lost {a['rows_lost']} dup {a['rows_duplicated']}  max stall "
            f"{f(a['max_stall_s'])} s  held-out loss {f(a['final_loss'], '.4f')}"
        )
    print(f"  round (compute, median) {f(r['round_s'])} s; death timeout {r['death_timeout_s']} s")
    print(
        f"  cold start {f(r['cold_start_s'])} s (alone {f(r['cold_start_solo_s'])} s); rejoins "
        + ", ".join(f(x) for x in r["rejoin_s"])
    )
    print(
        f"  optimizer counts at each rejoin {r['schedule_count_after_rejoin']}; expected "
        f"{r['schedule_count_expected']}"
    )
    for k, b in enumerate(r["rejoins"]):
        parts = ("spawn_s", "import_init_s", "connect_s", "join_s", "wait_for_round_s",
                 "compile_first_step_s")  # fmt: skip
        print(f"    kill {k + 1}: " + ", ".join(f"{p[:-2]} {f(b.get(p))}" for p in parts))
    print(
        f"  loss gap (killed - unkilled, seed 0) {f(r['killed_vs_unkilled_loss_gap'], '.4f')}; "
        f"seed spread {f(r['seed_spread'], '.4f')}"
    )
    goodput = r.get("goodput_killed", {})
    print(
        "  goodput, killed arm: "
        + ", ".join(f"island {i} {f(g.get('goodput'))}" for i, g in goodput.items())
    )
    for name, t in r["targets"].items():
        print(f"  target {name:9s} {'met' if t['met'] else 'NOT met'}: {t['target']}")


if __name__ == "__main__":
    main()
