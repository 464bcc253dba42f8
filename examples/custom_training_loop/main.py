"""The TensorFlow guide's custom training loop on 8x8 digits (offline). Logic: train.py.

python -m examples.custom_training_loop.main
XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m examples.custom_training_loop.main
"""

import argparse

from examples.custom_training_loop.train import run

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--global-batch-size", type=int, default=64)
    args = p.parse_args()
    run(epochs=args.epochs, global_batch_size=args.global_batch_size)
