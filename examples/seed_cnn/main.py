"""Trains the seed-000 CNN with MirroredStrategy; prints test accuracy and time.

Kept short on purpose: the logic is in ``train.py``, which the tests import.

    python -m examples.seed_cnn.main --epochs 20 --plot examples/seed_cnn/learning_curve.png
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from examples.cpu_devices import mirrored_strategy, use_cpu_devices


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--dataset",
        choices=("digits", "mnist"),
        default="digits",
        help="digits: offline 8x8 digits; mnist: downloads ~11 MB once",
    )
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--global-batch-size", type=int, default=64)
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--devices", type=int, default=8, help="replicas (virtual CPU devices)")
    p.add_argument("--max-steps", type=int, default=None, help="stop early (smoke tests)")
    p.add_argument("--plot", default=None, help="write the learning curve to this PNG")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None):
    args = parse_args(argv)
    use_cpu_devices(args.devices)
    strategy = mirrored_strategy(args.devices)
    from examples.seed_cnn import train

    config = train.Config(
        dataset=args.dataset,
        epochs=args.epochs,
        global_batch_size=args.global_batch_size,
        learning_rate=args.learning_rate,
        seed=args.seed,
        max_steps=args.max_steps,
    )
    result = train.train(config, strategy)
    print(
        f"test accuracy {result.test_accuracy:.4f} after {result.steps} steps on "
        f"{result.num_replicas} replicas in {result.seconds:.1f} s"
    )
    if args.plot:
        train.plot_history(
            result.history,
            args.plot,
            f"seed 000 CNN, {args.dataset}, MirroredStrategy x{result.num_replicas}",
        )
    return result


if __name__ == "__main__":
    main()
