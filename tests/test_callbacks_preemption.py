"""BackupAndRestore under a real SIGTERM: the run saves, exits 143, and the same command
run again finishes with parameters bit-identical to a run that was never interrupted."""

import importlib.util
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from distrain.checkpoint import PREEMPTION_EXIT_CODE

SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import jax, jax.numpy as jnp, numpy as np, optax
    import distrain as dt
    from distrain._src.data.pipeline import ArrayPipeline
    from distrain import callbacks as cb
    from distrain._src.train.metrics import Mean
    from distrain._src.train.trainer import Trainer

    def train_step(state, batch):
        def loss_fn(p):
            err = (batch["x"] @ p["w"] + p["b"] - batch["y"]) ** 2
            return dt.compute_average_loss(err), err
        grads, err = jax.grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads), {"loss": Mean.from_values(err)}

    def data():
        rng = np.random.default_rng(0)
        x = rng.normal(size=(160, 4)).astype(np.float32)
        y = (x @ np.arange(1, 5, dtype=np.float32)).astype(np.float32)
        return ArrayPipeline({"x": x, "y": y}, global_batch_size=32, seed=0)

    def fit(callbacks=()):
        state = dt.TrainState.create(params={"w": jnp.zeros(4), "b": jnp.zeros(())},
                                     tx=optax.adam(0.05))
        trainer = Trainer(dt.MirroredStrategy(), train_step, callbacks=list(callbacks))
        state, _ = trainer.fit(state, data(), epochs=4)
        return trainer, state

    if __name__ == "__main__":
        slow = float(os.environ.get("SLOW", "0"))

        def announce(info):
            print(f"STEP {info.step}", flush=True)
            time.sleep(slow)

        trainer, state = fit([
            cb.BackupAndRestore(sys.argv[1], save_freq=1000, delete_checkpoint=False),
            cb.LambdaCallback(on_train_batch_end=announce),
        ])
        np.savez(sys.argv[2], w=np.asarray(state.params["w"]), b=np.asarray(state.params["b"]),
                 initial_step=trainer.loop.initial_step)
    """
)


def _run(script, backup, out, slow, sigterm_after_step=None, timeout=180):
    env = {**os.environ, "SLOW": str(slow)}  # inherits conftest's 8 virtual CPU devices
    proc = subprocess.Popen(
        [sys.executable, str(script), str(backup), str(out)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        if sigterm_after_step is not None:
            deadline = time.monotonic() + timeout
            for line in proc.stdout:
                if line.strip() == f"STEP {sigterm_after_step}":
                    proc.send_signal(signal.SIGTERM)
                    break
                assert time.monotonic() < deadline, "the run did not reach the step in time"
        _, err = proc.communicate(timeout=timeout)
        return proc.returncode, err
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.one_end("lowest")  # a slow test: see tests/conftest.py
def test_sigterm_saves_exits_143_and_resumes_exactly(tmp_path, devices):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    backup, out = tmp_path / "backup", tmp_path / "out.npz"

    rc, err = _run(script, backup, out, slow=0.3, sigterm_after_step=3)
    assert rc == PREEMPTION_EXIT_CODE, err[-3000:]
    saved = sorted(int(s) for s in os.listdir(backup) if s.isdigit())
    assert len(saved) == 1 and 3 <= saved[0] < 20  # saved where it stopped, mid-run

    rc, err = _run(script, backup, out, slow=0.0)
    assert rc == 0, err[-3000:]
    resumed = np.load(out)
    assert int(resumed["initial_step"]) == saved[0]

    spec = importlib.util.spec_from_file_location("preempt_job", script)
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    _, reference = job.fit()  # the same run, never interrupted, in this process
    np.testing.assert_array_equal(resumed["w"], np.asarray(reference.params["w"]))
    np.testing.assert_array_equal(resumed["b"], np.asarray(reference.params["b"]))
