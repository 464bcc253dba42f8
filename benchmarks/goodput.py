"""What failures cost a run: goodput of a real multi-process job under SIGKILLs.

Runs ``distrain launch --nproc N --max-restarts K -- distrain train --config CONFIG``
(``MultiWorkerMirroredStrategy``, the goodput ledger in the run's logging directory),
SIGKILLs one worker every ``--kill-every`` seconds while it trains, and reads the
ledger back (``dt.goodput.report``): the buckets, goodput, the steps lost per failure,
the share of wall time the loop was blocked in saves, the restores' tiers and
seconds, and how the ledger's wall time compares with the one measured here.

Three arms, one after the other, each its own job:
  * ``local``: ``BackupAndRestore`` with a local tier (``checkpoint.local_dir`` in the
    run's directory, a backup every ``--local-freq`` steps) and a persistent backup
    every ``--persistent-freq`` steps;
  * ``persistent``: persistent backups only, every ``--backup-freq`` steps;
  * ``hang``: the local arm's job, where one worker is SIGSTOPped once instead of
    killed: ``distrain launch --hang-timeout`` must find it (``hang_timeout_s``,
    ``hang_detected_after_s``: from the SIGSTOP to the detection).
Each arm's ``kill_to_first_step_s`` lists, per failure, the seconds from the signal to
the first step the next attempt finished (the chief's ledger).
All use JAX's persistent compilation cache (``--no-compile-cache`` to turn it off),
shared by the attempts of an arm, and ``distrain launch``'s warm spares (``--no-spares``:
every restart starts cold; ``restarts_in_warm_spares`` counts the attempts that ran in
spares). The load average before and after is recorded (``load_average``).

Usage:
  python -m benchmarks.goodput                      # configs/lm_tiny.yaml, kills every 120 s
  python -m benchmarks.goodput --toy                # the quickstart, one kill (a smoke run)
  python -m benchmarks.goodput --arms local --steps 600 --max-kills 3 --no-spares  # cold

Then measures what the local tier's exchange holds beyond the state
(``benchmarks/local_exchange.py``: ``local_exchange_chunk_bytes`` and
``local_exchange_extra_bytes``, two processes exchanging 128 and 512 MiB; not in
``--toy``).

Writes benchmarks/results/goodput.json (``--out``) and the local arm's timeline next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks import local_exchange, portable

ROOT = Path(__file__).resolve().parent.parent


_PIDS = re.compile(r"^\[launch\] (process \d+ is pid \d+(, )?)+$")


def _follow(proc: subprocess.Popen, lines: list[str], pids: list[int]) -> None:
    """Collects the launcher's output and keeps ``pids`` at the running attempt's workers
    (its "process i is pid P" line: a worker may run in a warm spare, whose command line
    is not the program's)."""
    for line in proc.stdout:
        lines.append(line)
        if _PIDS.match(line.strip()):
            pids[:] = [int(p) for p in re.findall(r"is pid (\d+)", line)]


def _run_arm(args: argparse.Namespace, overrides: list[str], arm: str) -> dict:
    """One job under the kills (``arm`` "local", "persistent" or "hang"); its figures."""
    work = Path(tempfile.mkdtemp(prefix="goodput-"))
    local, hang = arm in ("local", "hang"), arm == "hang"
    if local:
        tier = [
            f"checkpoint.backup_freq={args.persistent_freq}",
            f"checkpoint.local_dir={work / 'local'}",
            f"checkpoint.local_freq={args.local_freq}",
        ]
    else:
        tier = [f"checkpoint.backup_freq={args.backup_freq}"]
    cmd = [
        os.path.join(os.path.dirname(sys.executable), "distrain"),
        "launch",
        "--nproc",
        str(args.nproc),
        "--max-restarts",
        str(args.max_kills + 1),
        "--hang-timeout",
        f"{args.hang_timeout:g}",
        "--spares" if args.spares else "--no-spares",
        "--",
        "distrain",
        "train",
        "--config",
        args.config,
        "--no-progress",
        "strategy.name=multi_worker_mirrored",
        f"checkpoint.backup_dir={work / 'backup'}",
        *tier,
        f"logging.dir={work}",
        "logging.goodput_interval=0.1",
        *overrides,
    ]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    if args.compile_cache:
        env["JAX_COMPILATION_CACHE_DIR"] = str(work / "xla-cache")
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    began = time.time()
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    kills: list[float] = []
    lines: list[str] = []
    pids: list[int] = []
    follower = threading.Thread(target=_follow, args=(proc, lines, pids), daemon=True)
    follower.start()
    first_save = min(args.local_freq if local else args.backup_freq, args.backup_freq)

    def trained_past(step: int, killed: set[str]) -> str | None:
        """The attempt that has trained past ``step`` and was not killed yet, if any."""
        try:
            lines = (work / "goodput.jsonl").read_text().splitlines()
        except OSError:
            return None
        for line in reversed(lines):
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if r["attempt"] not in killed and (r.get("step") or 0) >= step:
                return r["attempt"]
        return None

    def killer() -> None:
        # A kill lands once the attempt has trained at least kill_every seconds past its
        # start and past its first backup (a kill during start-up teaches nothing new).
        killed: set[str] = set()
        since = time.time()
        while proc.poll() is None and len(kills) < (1 if hang else args.max_kills):
            time.sleep(0.2)
            attempt = trained_past(first_save + 10, killed)
            if attempt is None or time.time() - since < args.kill_every:
                continue
            if proc.poll() is None and pids:
                os.kill(pids[-1], signal.SIGSTOP if hang else signal.SIGKILL)
                kills.append(time.time() - began)
                killed.add(attempt)
                since = time.time()

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    try:
        proc.wait(timeout=args.kill_every * (args.max_kills + 2) + 1800)
        follower.join(timeout=30)
        out = "".join(lines)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    wall = time.time() - began
    if proc.returncode != 0:
        print(out[-5000:])
        raise SystemExit(f"the job failed (exit {proc.returncode}); its output is above")

    import distrain as dt

    r = dt.goodput.report(work)
    restores: dict[str, list[float]] = {}
    for a in r.attempts:
        if a.restore is not None:
            restores.setdefault(a.restore[0], []).append(round(a.restore[1], 3))
    signals = [began + k for k in kills]
    detected = [a.after_hang["detected"] for a in r.attempts if a.after_hang]
    return {
        "tier": "local" if local else "persistent",
        "spares": args.spares,
        "restarts_in_warm_spares": len(re.findall(r"run in warm spares", out)),
        "signal": "SIGSTOP" if hang else "SIGKILL",
        "kill_to_first_step_s": _to_first_step(r.attempts, signals),
        **(
            {
                "hang_timeout_s": args.hang_timeout,
                "hang_detected_after_s": [
                    round(d - t, 2) for d, t in zip(detected, signals, strict=False)
                ],
            }
            if hang
            else {}
        ),
        "restart_breakdown_s": _breakdown(r.attempts[1:]),
        "kills_at_s": [round(k, 1) for k in kills],
        "wall_s": r.wall_s,
        "measured_wall_s": wall,
        "buckets_s": r.buckets_s,
        "buckets_sum_vs_measured": sum(r.buckets_s.values()) / wall,
        "goodput": r.goodput,
        "step_fraction_while_killing": _step_fraction(work, began, kills, args.kill_every),
        "failures": r.failures,
        "lost_steps_per_failure": list(r.lost_steps_per_failure),
        "save_stall_fraction": r.buckets_s["checkpoint"] / r.wall_s,
        "restore_s_by_tier": restores,
        "attempts": r.to_json()["attempts"],
        "report": r,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/lm_tiny.yaml")
    p.add_argument("--steps", type=int, default=400, help="train.steps")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--kill-every", type=float, default=120.0, help="seconds between SIGKILLs")
    p.add_argument(
        "--max-kills",
        type=int,
        default=20,
        help="at most this many kills (20: one every --kill-every s to the end of 1500 steps)",
    )
    p.add_argument("--local-freq", type=int, default=10, help="local arm: local backup every N")
    p.add_argument("--persistent-freq", type=int, default=500, help="local arm: persistent every N")
    p.add_argument("--backup-freq", type=int, default=50, help="persistent arm: backup every N")
    p.add_argument("--arms", default="local,persistent,hang", help="which arms, comma-separated")
    p.add_argument("--no-compile-cache", dest="compile_cache", action="store_false")
    p.add_argument(
        "--spares",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="distrain launch --spares / --no-spares: restarts in warm spares (default on)",
    )
    p.add_argument(
        "--hang-timeout", type=float, default=30.0, help="distrain launch --hang-timeout (s)"
    )
    p.add_argument("--toy", action="store_true", help="the quickstart, one kill (smoke run)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="another config override for the job (repeatable), e.g. train.epochs=null",
    )
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "goodput.json"))
    args = p.parse_args(argv)
    overrides = [f"train.steps={args.steps}", *args.set]
    if args.toy:
        args.config, args.kill_every, args.max_kills = "configs/quickstart.yaml", 0.0, 1
        overrides = ["train.epochs=30", "train.validation_freq=100"]
    load_before = list(os.getloadavg())
    arms = {name: _run_arm(args, overrides, name) for name in args.arms.split(",")}
    exchange = {} if args.toy else local_exchange.measure()  # the toy run stays short
    main_arm = arms.get("local") or next(iter(arms.values()))
    figures: dict = {
        "command": portable.command(["python -m benchmarks.goodput", *(argv or sys.argv[1:])]),
        "config": args.config,
        "nproc": args.nproc,
        "local_freq": args.local_freq,
        "persistent_freq": args.persistent_freq,
        "backup_freq_without_local": args.backup_freq,
        "compile_cache": args.compile_cache,
        "load_average": {"before": load_before, "after": list(os.getloadavg())},
        # The headline fields are the local arm's (the run).
        **{k: v for k, v in main_arm.items() if k != "report"},
        "restore_local_s": _mean(
            main_arm["restore_s_by_tier"].get("local", [])
            + main_arm["restore_s_by_tier"].get("peer", [])
        ),
        "restore_persistent_s": _mean(
            [s for arm in arms.values() for s in arm["restore_s_by_tier"].get("persistent", [])]
        ),
        **{k: v for k, v in arms.get("hang", {}).items() if k.startswith("hang_")},
        "arms": {
            name: {k: v for k, v in arm.items() if k not in ("report", "attempts")}
            for name, arm in arms.items()
        },
        **exchange,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(figures, indent=1) + "\n")
    main_arm["report"].plot(Path(args.out).with_suffix(".png"))
    for name, arm in arms.items():
        print(f"--- {name} arm")
        print(arm["report"].table())
        print(
            f"measured wall {arm['measured_wall_s']:.1f} s; ledger buckets sum to "
            f"{arm['buckets_sum_vs_measured']:.2%} of it; kills at {arm['kills_at_s']} s; "
            f"lost steps per failure {arm['lost_steps_per_failure']}; restores "
            f"{arm['restore_s_by_tier']}; a restart's parts {arm['restart_breakdown_s']}"
        )
    if exchange:
        print(f"the local tier's exchange: {exchange}")
    return 0


def _breakdown(attempts: list) -> dict[str, float | None]:
    """The mean start-up of the restarted attempts, by part: the process's start to the
    end of ``import distrain`` (jax included), ``jax.distributed``, the model's and
    optimizer's state, the data, the restore, and the step's compilation."""
    parts: dict[str, list[float]] = {}
    for a in attempts:
        marks, before = a.milestones, 0.0
        for name, label in [
            ("imported", "import"),
            ("distributed", "jax_distributed"),
            ("model", "model_init"),
            ("data", "data"),
        ]:
            if name in marks:
                parts.setdefault(label, []).append(marks[name] - before)
                before = marks[name]
        if a.restore is not None:
            parts.setdefault("restore", []).append(a.restore[1])
        parts.setdefault("compile", []).append(a.buckets["compile"])
        parts.setdefault("startup_total", []).append(a.buckets["startup"])
    return {k: _mean(v) for k, v in parts.items()}


def _to_first_step(attempts: list, signals: list[float]) -> list[float | None]:
    """Per signal: seconds to the first step finished by the next attempt (the first of
    its records past the step it resumed from)."""
    out: list[float | None] = []
    for t in signals:
        nxt = next((a for a in attempts if a.start > t), None)
        resumed = (nxt.resumed_from or 0) if nxt else 0
        first = (
            None
            if nxt is None
            else next(
                (rt for rt, step, _ in nxt.records if step is not None and step > resumed), None
            )
        )
        out.append(None if first is None else round(first - t, 2))
    return out


def _step_fraction(work: Path, began: float, kills: list[float], every: float) -> float | None:
    """The share of the wall time in steps while the kills came (from the start to one
    ``every`` past the last kill; None without kills): the goodput of a run that fails
    every ``every`` seconds throughout, an upper bound (lost steps count as steps). Read
    from the ledger's ticks: each attempt's last ``step`` bucket inside the window."""
    if not kills:
        return None
    end = began + min(kills[-1] + every, time.time() - began)
    last: dict[str, float] = {}
    for line in (work / "goodput.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("event") == "tick" and rec["t"] <= end:
            last[rec["attempt"]] = rec["buckets"]["step"]
    return round(sum(last.values()) / (end - began), 4)


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


if __name__ == "__main__":
    raise SystemExit(main())
