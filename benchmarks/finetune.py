"""Fine-tuning from one command (issue 54): the TinyShakespeare recipe's model, exported to
the Hugging Face layout, fine-tuned on Python source, fully and with LoRA, the same steps.

The two runs are ``configs/finetune_full.yaml`` and ``configs/finetune_lora.yaml`` (run
here in this process with ``dt.config.run_config``, each with a ``BackupAndRestore``
directory that keeps its final backup). Measured for each: the held-out loss (the mean
per byte over the held-out Python documents, the same function for the pretrained model
and both fine-tunes), the parameters that train, the optimizer state's bytes, the bytes
on disk of the final backup (parameters, optimizer state, data position: what
``BackupAndRestore`` writes) and the steps per second (from the 10th step to the one
before the last, each end synced, so compilation and the final save are outside).

Targets (one LoRA configuration, recorded as ``lora_rank`` / ``lora_targets``):
``opt_state_bytes_lora`` equals the bytes of ``tx.init(adapters)``;
``checkpoint_bytes_adapter`` < 5 % of ``checkpoint_bytes_full``; LoRA closes >= 80 % of
the held-out-loss gap between the pretrained model and the full fine-tune.

The pretrained model: ``--pretrained DIR`` (a Hugging Face directory). When ``DIR`` has no
``config.json`` it is made first with the two commands at the top of the configs
(``distrain train --config configs/shakespeare_char.yaml checkpoint.dir=...`` then
``distrain export ... --tokenizer bytes``), in ``--workdir`` (default: a temporary
directory, removed after). The pretraining is 2,000 steps: ~2 min on 2 idle CPU cores,
~19 min when other jobs hold them (``docs/lm.md``).

Usage:
  python -m benchmarks.finetune --pretrained runs/shakespeare_char/hf
  python -m benchmarks.finetune --steps 20 --toy --json /tmp/ft.json     # a smoke run

Writes ``benchmarks/results/finetune.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FULL, LORA = "configs/finetune_full.yaml", "configs/finetune_lora.yaml"
PRETRAIN = "configs/shakespeare_char.yaml"


def pretrain_and_export(out: str, workdir: str, overrides: list[str]) -> float:
    """The configs' two commands: the TinyShakespeare recipe, then its export to ``out``;
    returns their seconds."""
    start = time.perf_counter()
    ckpt = os.path.join(workdir, "shakespeare_ckpt")
    cli = [sys.executable, "-m", "distrain.cli"]
    subprocess.run(
        [*cli, "train", "--config", PRETRAIN, f"checkpoint.dir={ckpt}",
         "logging.progress_bar=false", *overrides],
        check=True, cwd=ROOT,
    )  # fmt: skip
    subprocess.run(
        [*cli, "export", "--config", PRETRAIN, *overrides, "--checkpoint", ckpt, "--to", "hf",
         out, "--tokenizer", "bytes"],
        check=True, cwd=ROOT,
    )  # fmt: skip
    return time.perf_counter() - start


def heldout_loss(apply_fn: Any, params: Any, rows: np.ndarray, batch: int = 128) -> float:
    """Mean cross-entropy per byte of ``rows`` (``[n, seq_len + 1]``: inputs then the next
    byte), as the LM example's ``eval_step`` computes it over full rows."""
    import jax
    import optax

    @jax.jit
    def total(params: Any, tokens: jax.Array) -> jax.Array:
        logits = apply_fn(params, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).sum()

    s = sum(float(total(params, rows[i : i + batch])) for i in range(0, len(rows), batch))
    return s / (len(rows) * (rows.shape[1] - 1))


class _Timer:
    """Steps per second from step ``first`` to the one before the last, synced at both."""

    def __init__(self, first: int, last: int) -> None:
        from distrain._src.train.callbacks.base import Callback

        outer = self

        class Timer(Callback):
            def on_train_batch_end(self, info: Any) -> None:
                import jax

                if info.step in (first, last - 1):
                    jax.block_until_ready(info.state)
                    outer.marks[info.step] = time.perf_counter()

        self.first, self.last, self.marks = first, last, {}
        self.callback = Timer()

    def steps_per_s(self) -> float:
        return (self.last - 1 - self.first) / (self.marks[self.last - 1] - self.marks[self.first])


def _nbytes(tree: Any) -> int:
    import jax

    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def _disk_bytes(directory: str) -> int:
    return sum(
        os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(directory) for f in files
    )


def run_arm(config: str, overrides: list[str], workdir: str, rows: np.ndarray) -> dict[str, Any]:
    """One fine-tune: ``config`` with ``overrides``, its final backup kept in ``workdir``."""
    import jax

    import distrain as dt
    from distrain._src.checkpoint.manager import CheckpointManager
    from distrain._src.models.lora import leaf_path
    from distrain._src.train.optimizer import build_optimizer

    name = os.path.basename(config).removesuffix(".yaml")
    backup = os.path.join(workdir, f"{name}_backup")
    cfg = dt.config.load_config(
        config,
        [*overrides, f"checkpoint.backup_dir={backup}", "checkpoint.delete_backups=false",
         "logging.progress_bar=false", "train.eval_step=null"],
    )  # fmt: skip
    steps = int(cfg.train.steps or 0)
    cfg.checkpoint.backup_freq = steps  # one backup: the final state
    timer = _Timer(min(10, steps // 2), steps)
    result = dt.config.run_config(cfg, callbacks=[timer.callback], progress_bar=False)
    state = result.state
    (step_dir,) = [d for d in os.listdir(backup) if d.isdigit()]
    trained = state.select_trainable(state.params)
    tx, _ = build_optimizer(cfg.optimizer, run_steps=cfg.train.steps)
    flat = {leaf_path(p): x for p, x in jax.tree.leaves_with_path(trained)}
    with CheckpointManager(backup, async_save=False) as manager:
        saved = manager.restore()
    return {
        "loss": heldout_loss(_apply_fn(cfg), state.params, rows),
        "params_total": int(sum(x.size for x in jax.tree.leaves(state.params))),
        "params_trainable": int(sum(x.size for x in jax.tree.leaves(trained))),
        "opt_state_bytes": _nbytes(state.opt_state),
        "opt_state_bytes_of_tx_init_trainable": _nbytes(jax.eval_shape(tx.init, flat)),
        "checkpoint_bytes": _disk_bytes(os.path.join(backup, step_dir)),
        "checkpoint_param_leaves": len(jax.tree.leaves(saved.state["params"])),
        "steps_per_s": timer.steps_per_s(),
        "run_s": result.seconds,
    }


def _apply_fn(cfg: Any) -> Any:
    """The fine-tuned model's ``apply_fn(params, tokens)`` (its graph, abstractly)."""
    from distrain._src.train.pretrained import abstract_model

    return abstract_model(cfg)[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pretrained", default=None, help="a Hugging Face directory (made if empty)")
    p.add_argument("--workdir", default=None, help="where the pretraining and backups go")
    p.add_argument("--steps", type=int, default=None, help="fine-tuning steps (configs')")
    p.add_argument("--rank", type=int, default=None, help="LoRA rank (finetune_lora.yaml's)")
    p.add_argument("--targets", default=None, help="LoRA targets (finetune_lora.yaml's)")
    p.add_argument("--lr-lora", type=float, default=None, help="LoRA peak learning rate")
    p.add_argument("--lr-full", type=float, default=None, help="full fine-tune peak rate")
    p.add_argument("--toy", action="store_true", help="a tiny pretraining (smoke runs only)")
    p.add_argument("--json", default=os.path.join(HERE, "results", "finetune.json"))
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    os.chdir(ROOT)  # the configs' relative paths
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import jax

    import distrain as dt
    from examples.lm import data as lm_data

    workdir = args.workdir or tempfile.mkdtemp(prefix="finetune-")
    os.makedirs(workdir, exist_ok=True)
    pretrained = args.pretrained or os.path.join(workdir, "shakespeare_hf")
    try:
        toy = ["train.steps=20", "model.kwargs.n_layers=1", "model.kwargs.d_model=32",
               "optimizer.schedule.kwargs.warmup_steps=2"] if args.toy else []  # fmt: skip
        pretrain_s = None
        if not os.path.exists(os.path.join(pretrained, "config.json")):
            pretrain_s = pretrain_and_export(pretrained, workdir, toy)
        common = [f"model.pretrained={pretrained}"]
        if args.steps is not None:
            schedule = "optimizer.schedule.kwargs"
            common += [f"train.steps={args.steps}", f"{schedule}.decay_steps={args.steps}",
                       f"{schedule}.warmup_steps={max(1, args.steps // 10)}"]  # fmt: skip
        if args.toy:
            common += ["data.kwargs.max_documents=200", "data.kwargs.heldout_fraction=0.1"]
        lora = list(common)
        if args.rank is not None:
            lora += [f"model.lora.rank={args.rank}", f"model.lora.alpha={2 * args.rank}"]
        if args.targets is not None:
            lora.append(f"model.lora.targets={args.targets}")
        if args.lr_lora is not None:
            lora.append(f"optimizer.schedule.kwargs.peak_value={args.lr_lora}")
        full = list(common)
        if args.lr_full is not None:
            full.append(f"optimizer.schedule.kwargs.peak_value={args.lr_full}")
        lcfg = dt.config.load_config(LORA, lora)
        rows = lm_data.stdlib_splits(**lcfg.data.kwargs)["test"]["tokens"]
        base = dt.models.from_pretrained(pretrained)
        loss_pretrained = heldout_loss(base.apply_fn, base.params, rows)
        f = run_arm(FULL, full, workdir, rows)
        lo = run_arm(LORA, lora, workdir, rows)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    gap = (loss_pretrained - lo["loss"]) / (loss_pretrained - f["loss"])
    assert lcfg.model.lora is not None
    shown = list(argv)  # without --workdir: where scratch files went, not what was run
    if "--workdir" in shown:
        del shown[shown.index("--workdir") : shown.index("--workdir") + 2]
    shown = [a for a in shown if not a.startswith("--workdir=")]
    result = {
        "command": " ".join(["python -m benchmarks.finetune", *map(_relative, shown)]),
        "configs": [FULL, LORA],
        "overrides_full": [_relative(o) for o in full],
        "overrides_lora": [_relative(o) for o in lora],
        "loss_pretrained": loss_pretrained,
        "loss_full": f["loss"],
        "loss_lora": lo["loss"],
        "lora_gap_closed": gap,
        "params_total": lo["params_total"] - lo["params_trainable"],
        "params_trainable_full": f["params_trainable"],
        "params_trainable_lora": lo["params_trainable"],
        "checkpoint_bytes_full": f["checkpoint_bytes"],
        "checkpoint_bytes_adapter": lo["checkpoint_bytes"],
        "checkpoint_param_leaves_full": f["checkpoint_param_leaves"],
        "checkpoint_param_leaves_adapter": lo["checkpoint_param_leaves"],
        "opt_state_bytes_full": f["opt_state_bytes"],
        "opt_state_bytes_lora": lo["opt_state_bytes"],
        "opt_state_bytes_of_tx_init_adapters": lo["opt_state_bytes_of_tx_init_trainable"],
        "steps_per_s_full": f["steps_per_s"],
        "steps_per_s_lora": lo["steps_per_s"],
        "run_s_full": f["run_s"],
        "run_s_lora": lo["run_s"],
        "pretrain_and_export_s": pretrain_s,
        "steps": lcfg.train.steps,
        "heldout_rows": len(rows),
        "lora_rank": lcfg.model.lora.rank,
        "lora_alpha": lcfg.model.lora.alpha,
        "lora_targets": lcfg.model.lora.targets,
        "targets_met": {
            "opt_state_is_the_adapters": lo["opt_state_bytes"]
            == lo["opt_state_bytes_of_tx_init_trainable"],
            "adapter_checkpoint_under_5_percent": lo["checkpoint_bytes"]
            < 0.05 * f["checkpoint_bytes"],
            "lora_closes_80_percent_of_the_gap": gap >= 0.8,
        },
        "loadavg": os.getloadavg(),
        "versions": {"jax": jax.__version__, "python": platform.python_version()},
    }
    print(json.dumps(result, indent=2))
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as out:
        json.dump(result, out, indent=2)
        out.write("\n")
    return 0


def _relative(text: str) -> str:
    """``text`` with this checkout's and the temporary directory's paths made relative
    (no machine paths in result files)."""
    for prefix in (ROOT + os.sep, tempfile.gettempdir() + os.sep):
        text = text.replace(prefix, "")
    return text


if __name__ == "__main__":
    sys.exit(main())
