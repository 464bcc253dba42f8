"""Test programs for tests/test_sidecar.py (the evaluator task, issue 53).

``digits`` is a ``data.fn`` for ``distrain train``: the quickstart's splits, the test
split as whole global batches whose reads in the evaluator process (``DISTRAIN_TASK_TYPE
=evaluator``) do what the test needs, once each, counted across the evaluator's
restarts in ``hooks``:

* the first read waits for the training's finish mark, then garbles checkpoint
  ``garble`` (its ``meta`` item no longer parses) before the evaluator reaches it;
* read number ``kill_at`` SIGKILLs the evaluator mid-evaluation (``distrain launch``
  restarts it).

Run as a program, it is one process of a sidecar that spans processes: ``python -m
tests.scripts.sidecar_job CKPT_DIR WORKDIR`` under the ``DISTRAIN_*`` variables of the
evaluator's own world, evaluating the linear problem's checkpoints; every process prints
``P<i> STEP <step> <loss>`` for each checkpoint it records.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

from distrain._src.data.pipeline import ArrayPipeline
from distrain._src.padding import MASK_KEY
from distrain._src.train.callbacks import finish_mark


class _Hooked:
    """The test split's global batches, with the hooks of the module docstring."""

    def __init__(self, batches: Iterable[Any], hooks: str, garble: int, kill_at: int) -> None:
        self.batches, self.hooks, self.garble, self.kill_at = batches, hooks, garble, kill_at

    def __iter__(self) -> Iterator[Any]:
        if os.environ.get("DISTRAIN_TASK_TYPE") == "evaluator":
            os.makedirs(self.hooks, exist_ok=True)
            reads = len([n for n in os.listdir(self.hooks) if n.startswith("read-")]) + 1
            open(os.path.join(self.hooks, f"read-{reads}"), "w").close()
            if reads == 1:
                self._garble_after_training()
            if reads == self.kill_at:
                print(f"SIGKILL to the evaluator in evaluation {reads}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        return iter(self.batches)

    def _garble_after_training(self) -> None:
        directory = os.environ["SIDECAR_TEST_CHECKPOINTS"]
        deadline = time.monotonic() + 120
        while not finish_mark.read(directory)[0] and time.monotonic() < deadline:
            time.sleep(0.05)
        with open(os.path.join(directory, str(self.garble), "meta", "metadata"), "w") as f:
            f.write("garbled{")
        print(f"garbled the checkpoint of step {self.garble}", flush=True)


def digits(*, hooks: str, garble: int, kill_at: int) -> dict[str, Any]:
    """The quickstart's splits; the test split in batches of 64 with the hooks."""
    from examples.classification import digits as quickstart_digits

    splits = quickstart_digits()
    test = ArrayPipeline(  # whole global batches: each process takes its slice of them
        splits["test"],
        global_batch_size=64,
        shuffle=False,
        num_epochs=1,
        drop_remainder=False,
        mask_key=MASK_KEY,
        process_index=0,
        process_count=1,
    )
    return {"train": splits["train"], "test": _Hooked(test, hooks, garble, kill_at)}


def test_data() -> Any:
    """The linear problem's evaluation data (tests/linear_problem.py), in whole batches."""
    from tests import linear_problem as lp

    return ArrayPipeline(
        lp.problem(40, seed=1),
        global_batch_size=8,
        shuffle=False,
        num_epochs=1,
        drop_remainder=False,
        mask_key=MASK_KEY,
        process_index=0,
        process_count=1,
    )


def main(checkpoint_dir: str, workdir: str) -> int:
    import jax

    import distrain as dt
    from tests import linear_problem as lp

    strategy = dt.MultiWorkerMirroredStrategy()  # the evaluators' own world
    me = jax.process_index()

    def record(epoch: int, logs: Any) -> None:
        step = sidecar.trainer.loop.global_step
        print(f"P{me} STEP {step} {logs['eval/loss']!r}", flush=True)
        if me == 1:
            time.sleep(0.05)  # process 1 lags behind process 0's looks at the directory

    sidecar = dt.SidecarEvaluator(
        lp.eval_step,
        test_data(),
        checkpoint_dir,
        state=lp.new_state(),
        strategy=strategy,
        every_checkpoint=True,
        poll_interval=0.02,
        timeout=120,
        workdir=workdir,
        callbacks=[dt.callbacks.LambdaCallback(on_epoch_end=record)],
    )
    sidecar.start()
    print(f"P{me} DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
