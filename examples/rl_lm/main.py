"""GRPO on a small LM (string reversal): pretrain the format, then RL, on 1 or 8 replicas.

    python -m examples.rl_lm.main --devices 1 --workdir /tmp/grpo1 --out examples/rl_lm
    python -m examples.rl_lm.main --devices 8 --workdir /tmp/grpo8 --out examples/rl_lm

Kept short on purpose: the logic is in ``train.py`` and ``task.py``. The same command
run again after an interruption (Ctrl-C, SIGKILL) resumes from ``--workdir``. ``--out``
replaces this replica count's row of ``result.json`` there and redraws
``learning_curve.png`` from every row.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from typing import Any

from examples.cpu_devices import mirrored_strategy, use_cpu_devices


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8, help="replicas (virtual CPU devices)")
    p.add_argument("--workdir", required=True, help="checkpoints; a rerun resumes from here")
    p.add_argument("--out", default=None, help="directory of result.json and the PNG")
    p.add_argument("--toy", action="store_true", help="train.TOY: the seconds-long test run")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--rl-steps", type=int, default=None)
    p.add_argument("--pretrain-steps", type=int, default=None)
    p.add_argument("--prompts-per-step", type=int, default=None)
    p.add_argument("--group-size", type=int, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    use_cpu_devices(args.devices)  # before JAX starts

    from . import train

    cfg = train.TOY if args.toy else train.Config()
    changes = {
        k: getattr(args, k)
        for k in ("seed", "rl_steps", "pretrain_steps", "prompts_per_step", "group_size")
        if getattr(args, k) is not None
    }
    cfg = dataclasses.replace(cfg, **changes)
    cfg.validate(args.devices)  # before anything compiles: wrong input fails at once
    result = train.train(cfg, mirrored_strategy(args.devices), args.workdir, log=_print)
    row = {
        "replicas": result.replicas,
        "accuracy_before": round(result.accuracy_before, 4),
        "accuracy_after": round(result.accuracy_after, 4),
        "wall_s": round(result.wall_s, 1),
        "pretrain_wall_s": round(result.pretrain_wall_s, 1),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "settings": dataclasses.asdict(cfg),
        "curve": {
            "step": [r["step"] for r in result.history],
            "reward": [round(r["reward"], 4) for r in result.history],
            "held_out": [
                [r["step"], round(r["held_out_accuracy"], 4)]
                for r in result.history
                if "held_out_accuracy" in r
            ],
        },
    }
    print(json.dumps({k: v for k, v in row.items() if k not in ("curve", "settings")}))
    if args.out:
        _write(args.out, row)
    return row


def _print(line: str) -> None:
    print(line, flush=True)


def _write(out: str, row: dict[str, Any]) -> None:
    """Replaces ``row``'s replica count in ``out/result.json`` and redraws the curve."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "result.json")
    rows = []
    if os.path.exists(path):
        with open(path) as f:
            rows = [r for r in json.load(f)["rows"] if r["replicas"] != row["replicas"]]
    rows = sorted([*rows, row], key=lambda r: r["replicas"])
    with open(path, "w") as f:
        json.dump({"task": "reverse 3-5 distinct letters of a-h", "rows": rows}, f, indent=1)
    plot(rows, os.path.join(out, "learning_curve.png"))


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """Training reward (sampled) and held-out accuracy (greedy) against the RL step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8), dpi=100)
    for row, color in zip(rows, ("tab:blue", "tab:orange", "tab:green"), strict=False):
        n, curve = row["replicas"], row["curve"]
        ax.plot(curve["step"], curve["reward"], color=color, alpha=0.6, lw=1,
                label=f"reward (sampled), {n} replica{'s' * (n > 1)}")  # fmt: skip
        steps, acc = zip(*([[0, row["accuracy_before"]], *curve["held_out"]]), strict=True)
        ax.plot(steps, acc, color=color, marker="o", lw=2,
                label=f"held-out accuracy (greedy), {n} replica{'s' * (n > 1)}")  # fmt: skip
    ax.set(xlabel="GRPO step", ylabel="reward / accuracy", ylim=(0, 1))
    ax.set_title("GRPO on string reversal, after pretraining on wrong answers", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    main()
