"""Trains the seed-000 CNN with MirroredStrategy; prints test accuracy and time.

Kept short on purpose: the logic is in ``train.py``, which the tests import.

    python -m examples.seed_cnn.main --epochs 20 --plot examples/seed_cnn/learning_curve.png
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence


def use_cpu_devices(n: int) -> None:
    """Asks XLA for ``n`` virtual CPU devices, one replica each.

    XLA reads the flag once, when JAX creates its CPU backend (the first time any
    device is used), so it must be set before that; it has no effect afterwards
    (e.g. under pytest, whose conftest already set 8) and none on GPUs or TPUs.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


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
    import jax  # after use_cpu_devices: the flag must be set before the backend starts

    import distrain as dt
    from examples.seed_cnn import train

    if jax.device_count() < args.devices:
        raise ValueError(
            f"--devices {args.devices} asks for more replicas than JAX has devices "
            f"({jax.device_count()}); XLA_FLAGS was set before this command ran. Use "
            f"--devices {jax.device_count()} or fewer."
        )
    config = train.Config(
        dataset=args.dataset,
        epochs=args.epochs,
        global_batch_size=args.global_batch_size,
        learning_rate=args.learning_rate,
        seed=args.seed,
        max_steps=args.max_steps,
    )
    strategy = dt.MirroredStrategy(jax.devices()[: args.devices])
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
