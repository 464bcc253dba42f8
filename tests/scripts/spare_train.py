"""Trainer.fit under MultiWorkerMirroredStrategy, for tests/test_spares.py: a job that a
test SIGKILLs mid-run, restarted by `distrain launch` in warm spares.

Each finished step prints "pid P step N" (P: this process's pid) and sleeps --step-sleep
seconds; BackupAndRestore saves every --save-freq steps; a Goodput ledger keeps the time
in --out. On the first attempt every process holds after step --hold-at (saved) until the
file --out/go exists, so that the test can kill a worker at a known step when it chooses.
At the end each process writes --out/result_<process id>.npz: its pid, the first step
this attempt finished and the final parameters.
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
    parser.add_argument("--save-freq", type=int, default=2)
    parser.add_argument("--step-sleep", type=float, default=0.05)
    parser.add_argument("--hold-at", type=int, default=6)
    args = parser.parse_args()

    from distrain import MultiWorkerMirroredStrategy

    strategy = MultiWorkerMirroredStrategy()  # first: before any other JAX call

    import numpy as np

    from distrain import Trainer
    from distrain.callbacks import BackupAndRestore, Callback, Goodput

    first: list[int] = []

    class Steps(Callback):
        def on_train_batch_end(self, info):
            first.append(info.step)
            print(f"pid {os.getpid()} step {info.step}", flush=True)
            time.sleep(args.step_sleep)
            held = time.monotonic()
            first_attempt = os.environ["DISTRAIN_RESTART_COUNT"] == "0"
            while first_attempt and info.step == args.hold_at and time.monotonic() - held < 120:
                if os.path.exists(os.path.join(args.out, "go")):
                    break
                time.sleep(0.05)

    step = mw_train.make_train_step(16)

    def train_step(state, batch):
        state, loss = step(state, batch)
        return state, {"loss": loss}

    callbacks = [
        BackupAndRestore(os.path.join(args.out, "backup"), save_freq=args.save_freq),
        Goodput(args.out),
        Steps(),
    ]
    with strategy.scope():
        trainer = Trainer(strategy, train_step, log_every=1)
        data = [mw_train.global_batch(i, 16) for i in range(args.steps)]
        state, _ = trainer.fit(mw_train.initial_state(), data, epochs=1, callbacks=callbacks)
    params = {k: np.asarray(v) for k, v in state.params.items()}
    index = int(os.environ["DISTRAIN_PROCESS_ID"])
    np.savez(
        os.path.join(args.out, f"result_{index}.npz"), pid=os.getpid(), first=first[0], **params
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
