"""The held-out learning curve of a ``distrain train`` config, as JSON and a PNG.

The run is ``distrain train --config CONFIG`` itself (``dt.config.run_config``: same
model initialisation, batches, optimizer), with one callback added that evaluates the
config's ``test`` split every ``--every`` steps. Evaluating reads the state and changes
nothing in training, so the final held-out loss is the plain command's.

  python -m examples.lm.curve --config configs/shakespeare_char.yaml --every 250

writes runs/shakespeare_char/curve.json and curve.png (``--out DIR`` elsewhere; the
committed figure of docs/lm.md is ``--out docs/shakespeare_char``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path
from typing import Any

import jax

import distrain as dt

NANOGPT_CPU_LOSS = 1.88  # nanoGPT's README, its CPU recipe on TinyShakespeare


class HeldOutCurve(dt.callbacks.Callback):
    """Evaluates ``data`` at the start and every ``every`` steps; keeps the train logs."""

    def __init__(self, data: Any, every: int) -> None:
        self.data, self.every = data, every
        self.held_out: dict[int, float] = {}
        self.train: list[dict[str, float]] = []

    def _evaluate(self, step: int, state: Any) -> None:
        assert self.trainer is not None
        self.held_out[step] = self.trainer.evaluate(state, self.data)["loss"]

    def on_train_begin(self, logs: Any = None) -> None:
        assert self.trainer is not None
        self._evaluate(0, self.trainer.state)

    def on_train_batch_end(self, info: dt.callbacks.StepInfo) -> None:
        if info.logs:
            self.train.append({"step": info.step, **info.logs})
        if info.step % self.every == 0:
            self._evaluate(info.step, info.state)


def held_out_curve(
    config: str, overrides: list[str], every: int, *, progress: bool = True
) -> dict[str, Any]:
    """Runs the config as ``distrain train`` does, evaluating every ``every`` steps.

    Returns a JSON-ready dict: the held-out loss by step, the train logs (loss and
    ``learning_rate``, window means and values at each log), the final test metrics and
    the run's wall time.
    """
    cfg = dt.config.load_config(config, overrides)
    splits = dt.config.resolve_callable(cfg.data.fn, "data.fn")(**cfg.data.kwargs)
    test = dt.data.ArrayPipeline(
        splits["test"],
        global_batch_size=cfg.data.eval_batch_size or cfg.data.global_batch_size,
        shuffle=False,
        num_epochs=1,
        drop_remainder=False,
        mask_key="mask",
    )
    curve = HeldOutCurve(test, every)
    result = dt.config.run_config(cfg, callbacks=[curve], progress_bar=progress)
    return {
        "config": config,
        "overrides": overrides,
        "held_out_loss": {str(k): v for k, v in sorted(curve.held_out.items())},
        "train": curve.train,
        "final_test": result.test_metrics,
        "seconds": result.seconds,
        "device": jax.devices()[0].device_kind,
        "host": {"machine": platform.machine(), "cpus": os.cpu_count()},
        "jax": jax.__version__,
    }


def plot(result: dict[str, Any], path: str | os.PathLike[str], reference: float | None) -> None:
    """Held-out loss by step, the train loss of each log window, and a reference line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    held = result["held_out_loss"]
    ax.plot([int(s) for s in held], list(held.values()), "o-", label="held-out (whole split)")
    train = result["train"]
    ax.plot(
        [r["step"] for r in train], [r["loss"] for r in train], "s--", ms=3, label="train (window)"
    )
    if reference is not None:
        ax.axhline(reference, color="gray", lw=0.8, ls=":", label=f"nanoGPT {reference}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / byte)")
    ax.set_ylim(top=min(4.0, ax.get_ylim()[1]))
    final = result["final_test"]["loss"]
    ax.set_title(f"{Path(result['config']).name}: held-out {final:.3f} at the end", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def parser() -> argparse.ArgumentParser:
    """The command line (``--out`` defaults under runs/, which git does not track)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default="configs/shakespeare_char.yaml")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. train.steps=500")
    p.add_argument("--every", type=int, default=250, help="steps between held-out evaluations")
    p.add_argument(
        "--out",
        default="runs/shakespeare_char",
        help="write curve.json and curve.png here (default runs/shakespeare_char; "
        "docs/shakespeare_char holds the committed figure)",
    )
    p.add_argument("--no-progress", action="store_true")
    return p


if __name__ == "__main__":
    args = parser().parse_args()
    res = held_out_curve(args.config, args.overrides, args.every, progress=not args.no_progress)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "curve.json").write_text(json.dumps(res, indent=2) + "\n")
    plot(res, out / "curve.png", NANOGPT_CPU_LOSS)
    print(f"held-out loss: {res['held_out_loss']}; wrote {out}/curve.json and curve.png")
