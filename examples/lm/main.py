"""A byte-level transformer LM with dt.Trainer: tokens/s, MFU, held-out loss, samples.

python -m examples.lm.main --config configs/lm_tiny.yaml --out runs/lm
python -m examples.lm.main --config configs/lm_gpt2_small.yaml --steps 200   # on a GPU

--out DIR writes result.json and learning_curve.png there: runs/ is not tracked by git,
whereas examples/lm/ holds the committed result (write there only to replace it).

The config is the one `distrain train --config` reads; the logic is in train.py.
"""

import argparse

from examples.cpu_devices import use_cpu_devices


def _window(text: str) -> tuple[int, int]:
    a, _, b = text.partition(":")
    return int(a), int(b)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default="configs/lm_tiny.yaml")
    p.add_argument(
        "overrides", nargs="*", help="config overrides, e.g. optimizer.learning_rate=1e-3"
    )
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the config's)")
    p.add_argument("--eval-every", type=int, default=50, help="steps between held-out evaluations")
    p.add_argument(
        "--devices",
        type=int,
        default=None,
        help="devices (CPU: that many virtual devices; default all devices)",
    )
    p.add_argument(
        "--shard-state",
        action="store_true",
        help="MirroredStrategy(shard_state=True): FSDP-style state storage",
    )
    p.add_argument("--bf16", action="store_true", help="mixed precision: compute in bfloat16")
    p.add_argument(
        "--peak-flops",
        type=float,
        default=None,
        help="peak FLOP/s per device for MFU (default: known accelerators; none on CPU)",
    )
    p.add_argument(
        "--profile",
        type=_window,
        default=None,
        metavar="A:B",
        help="jax.profiler trace of steps A+1..B into WORKDIR/profile",
    )
    p.add_argument("--workdir", default=None, help="backups (exact resume) and checkpoints")
    p.add_argument("--out", default=None, help="write result.json and learning_curve.png here")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args()
    if args.devices is not None:
        use_cpu_devices(args.devices)  # before JAX starts

    import dataclasses

    from examples.lm.train import settings_from_config, train_and_evaluate

    s = settings_from_config(args.config, args.overrides)
    s.eval_every = args.eval_every
    s.devices, s.peak_flops, s.profile = args.devices, args.peak_flops, args.profile
    if args.shard_state:  # else the config's strategy.shard_state
        s.shard_state = True
    if args.steps is not None:
        s.steps = args.steps
    if args.bf16:
        s.model = dataclasses.replace(s.model, dtype="bfloat16")
    train_and_evaluate(s, workdir=args.workdir, out_dir=args.out, progress=not args.no_progress)
