"""Trains the seed-001 MLP; restores the latest checkpoint in --ckpt-dir if there is one.

Interrupt it at any point and run the same command again: it continues where the
last checkpoint left off and ends with the same parameters as an uninterrupted run.

    python -m examples.seed_make_or_restore.main --epochs 10 --ckpt-dir /tmp/seed001
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from examples.cpu_devices import mirrored_strategy, use_cpu_devices


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt-dir", required=True, help="checkpoints are written and read here")
    p.add_argument(
        "--dataset",
        choices=("digits", "mnist"),
        default="digits",
        help="digits: offline 8x8 digits; mnist: downloads ~11 MB once",
    )
    p.add_argument("--epochs", type=int, default=10, help="total epochs, over all runs")
    p.add_argument("--global-batch-size", type=int, default=64)
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--save-every-steps",
        type=int,
        default=None,
        help="also checkpoint every N steps (default: every epoch)",
    )
    p.add_argument("--devices", type=int, default=8, help="replicas (virtual CPU devices)")
    p.add_argument("--plot", default=None, help="write the per-step loss curve to this PNG")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None):
    args = parse_args(argv)
    use_cpu_devices(args.devices)
    strategy = mirrored_strategy(args.devices)
    from examples.seed_make_or_restore import train

    config = train.Config(
        dataset=args.dataset,
        epochs=args.epochs,
        global_batch_size=args.global_batch_size,
        learning_rate=args.learning_rate,
        seed=args.seed,
        save_every_steps=args.save_every_steps,
    )
    result = train.run_training(config, args.ckpt_dir, strategy)
    print(
        f"test accuracy {result.test_accuracy:.4f}; this run trained {result.steps_this_run} "
        f"steps in {result.seconds:.1f} s (resumed from step {result.resumed_from})"
    )
    if args.plot and result.step_losses:
        train.plot_losses(
            result.step_losses,
            result.steps_per_epoch,
            args.plot,
            f"seed 001 MLP, {args.dataset}, MirroredStrategy x{args.devices}",
            result.resumed_at,
        )
    return result


if __name__ == "__main__":
    main()
