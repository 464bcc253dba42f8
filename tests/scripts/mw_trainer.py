"""Trainer.fit under MultiWorkerMirroredStrategy, for tests/test_multi_worker_trainer.py.

Trains the model of mw_train.py for 2 epochs of 4 batches with a progress bar, a CSV
log and TensorBoard files whose paths name the process, so the test can check that
only the chief wrote or printed anything. Writes --out/result_<process id>.npz.
"""

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mw_train  # noqa: E402  (same model and data as the strategy.run tests)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from distrain import MultiWorkerMirroredStrategy

    strategy = MultiWorkerMirroredStrategy()  # first: before any other JAX call

    import jax

    from distrain import Trainer
    from distrain.callbacks import CSVLogger, ProgressBar, TensorBoard

    pid = jax.process_index()
    step = mw_train.make_train_step(16)

    def train_step(state, batch):
        state, loss = step(state, batch)
        return state, {"loss": loss}

    callbacks = [
        ProgressBar(sys.stdout),
        CSVLogger(os.path.join(args.out, f"log_{pid}.csv")),
        TensorBoard(os.path.join(args.out, f"tb_{pid}")),
    ]
    with strategy.scope():
        trainer = Trainer(strategy, train_step, log_every=2)
        data = [mw_train.global_batch(i, 16) for i in range(4)]
        state, _ = trainer.fit(mw_train.initial_state(), data, epochs=2, callbacks=callbacks)
    np.savez(
        os.path.join(args.out, f"result_{pid}.npz"),
        chief=trainer.is_chief,
        **{k: np.asarray(v) for k, v in state.params.items()},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
