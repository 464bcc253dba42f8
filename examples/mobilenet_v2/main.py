"""Trains MobileNetV2 with MirroredStrategy (seed 004) on synthetic stripes or cats vs dogs.

Kept short on purpose: the model is in ``model.py``, the data in ``data.py`` and the
loop in ``train.py``.

    python -m examples.mobilenet_v2.main --plot examples/mobilenet_v2/learning_curve.png
    python -m examples.mobilenet_v2.main --dataset cats_vs_dogs --data-dir ~/data/kagglecatsanddogs
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from examples.cpu_devices import mirrored_strategy, use_cpu_devices


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", choices=("stripes", "cats_vs_dogs"), default="stripes")
    p.add_argument(
        "--data-dir",
        default=None,
        help="cats_vs_dogs: unpacked kagglecatsanddogs archive (else tfds)",
    )
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--width-multiplier", type=float, default=0.35, help="Keras' alpha")
    p.add_argument(
        "--stages", type=int, default=7, help="bottleneck stages to build (7 = the whole network)"
    )
    p.add_argument(
        "--sync-batch-norm",
        action="store_true",
        help="batch statistics over the global batch (all replicas)",
    )
    p.add_argument("--num-train", type=int, default=4096, help="synthetic training images")
    p.add_argument("--num-test", type=int, default=1024, help="synthetic test images")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--global-batch-size", type=int, default=128)
    p.add_argument("--learning-rate", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--devices", type=int, default=8, help="replicas (virtual CPU devices)")
    p.add_argument("--max-steps", type=int, default=None, help="stop early (smoke tests)")
    p.add_argument("--plot", default=None, help="write the learning curve to this PNG")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None):
    args = parse_args(argv)
    use_cpu_devices(args.devices)
    strategy = mirrored_strategy(args.devices)
    from examples.mobilenet_v2 import train

    config = train.Config(
        dataset=args.dataset,
        data_dir=args.data_dir,
        image_size=args.image_size,
        width_multiplier=args.width_multiplier,
        stages=args.stages,
        sync_batch_norm=args.sync_batch_norm,
        num_train=args.num_train,
        num_test=args.num_test,
        epochs=args.epochs,
        global_batch_size=args.global_batch_size,
        learning_rate=args.learning_rate,
        seed=args.seed,
        max_steps=args.max_steps,
    )
    result = train.train(config, strategy)
    print(
        f"test accuracy {result.test_accuracy:.4f} after {result.steps} steps on "
        f"{result.num_replicas} replicas in {result.seconds:.0f} s"
    )
    if args.plot:
        train.plot_history(
            result.history,
            args.plot,
            f"MobileNetV2 x{args.width_multiplier}, {args.dataset} "
            f"{args.image_size}px, MirroredStrategy x{result.num_replicas}",
        )
    return result


if __name__ == "__main__":
    main()
