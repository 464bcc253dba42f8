"""Keras guide's MNIST MLP with dt.Trainer. Kept short: the logic is in train.py.

python -m examples.mnist_mlp.main                      # MNIST (downloads ~11 MB once)
python -m examples.mnist_mlp.main --dataset digits     # offline 8x8 digits
"""

import argparse

from examples.mnist_mlp.train import train_and_evaluate

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dataset", choices=["mnist", "digits"], default="mnist")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--global-batch-size", type=int, default=512)
    p.add_argument("--steps", type=int, default=None, help="total steps instead of epochs")
    args = p.parse_args()
    train_and_evaluate(
        dataset=args.dataset,
        epochs=args.epochs,
        global_batch_size=args.global_batch_size,
        steps=args.steps,
    )
