"""Trainer.fit under MultiWorkerMirroredStrategy with slow-but-not-stuck work, for
tests/test_hang.py.

On the first attempt (DISTRAIN_RESTART_COUNT=0), after step 3 the training thread compiles
a function whose tracing takes --slow seconds, and after step 6 a save takes --slow
seconds (inside the Trainer's "checkpoint" phase, as BackupAndRestore's saves are): both
longer than the launcher's --hang-timeout, and neither may be called a hang. Every step
prints "step N" and sleeps --step-sleep seconds, so that the test can SIGSTOP a process
mid-run. BackupAndRestore saves every 5 steps; a Goodput ledger keeps the time.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mw_train  # noqa: E402  (same model and data as the strategy.run tests)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--slow", type=float, default=2.5)
    parser.add_argument("--step-sleep", type=float, default=0.05)
    args = parser.parse_args()

    from distrain import MultiWorkerMirroredStrategy

    strategy = MultiWorkerMirroredStrategy()  # first: before any other JAX call

    import jax
    import jax.numpy as jnp

    from distrain import Trainer
    from distrain._src.goodput import ledger as goodput
    from distrain.callbacks import BackupAndRestore, Callback, Goodput

    first_attempt = os.environ.get("DISTRAIN_RESTART_COUNT") == "0"

    class SlowWork(Callback):
        def on_train_batch_end(self, info):
            print(f"step {info.step}", flush=True)
            time.sleep(args.step_sleep)
            if first_attempt and info.step == 3:

                def slow_to_trace(x):
                    time.sleep(args.slow)  # tracing is part of compiling
                    return x + 1

                jax.block_until_ready(jax.jit(slow_to_trace)(jnp.zeros(3)))
                print("slow compile done", flush=True)
            if first_attempt and info.step == 6:
                with goodput.phase("checkpoint"):
                    time.sleep(args.slow)
                print("slow save done", flush=True)

    step = mw_train.make_train_step(16)

    def train_step(state, batch):
        state, loss = step(state, batch)
        return state, {"loss": loss}

    callbacks = [
        BackupAndRestore(os.path.join(args.out, "backup"), save_freq=5),
        Goodput(args.out),
        SlowWork(),
    ]
    with strategy.scope():
        trainer = Trainer(strategy, train_step, log_every=1)
        data = [mw_train.global_batch(i, 16) for i in range(args.steps)]
        trainer.fit(mw_train.initial_state(), data, epochs=1, callbacks=callbacks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
