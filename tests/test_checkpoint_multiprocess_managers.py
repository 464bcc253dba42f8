"""Checkpoints in 2-process jobs: two managers at once, and directories that are not shared.

Real jobs: `distrain._src.cluster.launch --nproc 2 --devices-per-proc 2` starts the script
below twice on loopback (MultiWorkerMirroredStrategy, gloo), with bounded timeouts.
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

from distrain.checkpoint import CheckpointManager
from tests.processes import xla_flags

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "scripts"

_TWO_MANAGERS = f"""
import os, sys
sys.path.insert(0, {str(SCRIPTS)!r})
import mw_train
from distrain._src.strategy.multi_worker import MultiWorkerMirroredStrategy

strategy = MultiWorkerMirroredStrategy()  # first: before any other JAX call
import jax
from distrain.callbacks import BackupAndRestore, ModelCheckpoint
from distrain._src.train.trainer import Trainer

out = sys.argv[1]
step = mw_train.make_train_step(16)

def train_step(state, batch):
    state, loss = step(state, batch)
    return state, {{"loss": loss}}

callbacks = [
    # Both save at every step: two orbax managers in the same save at the same time.
    ModelCheckpoint(os.path.join(out, "mc"), save_freq=1, max_to_keep=2),
    BackupAndRestore(os.path.join(out, "bk"), save_freq=1, delete_checkpoint=False),
]
with strategy.scope():
    trainer = Trainer(strategy, train_step)
    data = [mw_train.global_batch(i, 16) for i in range(4)]
    trainer.fit(mw_train.initial_state(), data, epochs=6, callbacks=callbacks)
print("DONE", jax.process_index(), flush=True)
"""

_NOT_SHARED = """
import os, sys
from distrain._src.strategy.multi_worker import MultiWorkerMirroredStrategy

strategy = MultiWorkerMirroredStrategy()
import jax
import jax.numpy as jnp
from distrain.checkpoint import CheckpointManager

# Each process its own directory, as with node-local disks: only process 0's has a step.
directory = os.path.join(sys.argv[1], f"node{jax.process_index()}")
with CheckpointManager(directory) as mgr:
    try:
        mgr.restore(target={"w": jnp.zeros(3)})
    except ValueError as e:
        print("ERROR", jax.process_index(), e, flush=True)
        sys.exit(3)
print("RESTORED", jax.process_index(), flush=True)
"""


def _launch(tmp_path, script, timeout=150):
    path = tmp_path / "job.py"
    path.write_text(script)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTRAIN_")}
    env.pop("TF_CONFIG", None)
    env.update(
        XLA_FLAGS=xla_flags(4),
        JAX_PLATFORMS="cpu",
        PYTHONPATH=str(ROOT),
    )
    argv = [sys.executable, "-m", "distrain._src.cluster.launch", "--nproc", "2"]
    argv += ["--devices-per-proc", "2", "--timeout", "30", "--"]
    argv += [sys.executable, str(path), str(tmp_path)]
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, out.decode(errors="replace")


@pytest.mark.one_end("lowest")  # a slow test: see tests/conftest.py
def test_model_checkpoint_and_backup_save_together_on_two_processes(tmp_path):
    code, log = _launch(tmp_path, _TWO_MANAGERS)
    assert code == 0, log[-4000:]
    assert "already ongoing" not in log
    assert "DONE 0" in log and "DONE 1" in log
    with CheckpointManager(tmp_path / "mc") as mgr:
        assert mgr.all_steps() == [23, 24]
    with CheckpointManager(tmp_path / "bk") as mgr:
        assert mgr.all_steps() == [23, 24]


@pytest.mark.one_end("lowest")  # a slow test: see tests/conftest.py
def test_restore_from_directories_that_are_not_shared_is_a_clear_error(tmp_path):
    with CheckpointManager(tmp_path / "node0", async_save=False) as mgr:
        mgr.save(5, {"w": jnp.ones(3)})
    code, log = _launch(tmp_path, _NOT_SHARED, timeout=120)
    assert code != 0, log[-4000:]
    for pid in (0, 1):
        assert f"ERROR {pid} The checkpoint directory" in log, log[-4000:]
    assert "must be shared by all processes" in log
    assert "process 0 sees 1 step(s), the newest 5; process 1 sees no checkpoint" in log
    assert "RESTORED" not in log
