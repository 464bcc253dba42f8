"""Fault-isolated islands through `dt.Trainer` and `distrain train` (issue 57, item 5):
`Trainer(..., islands=FaultIsolation(...)).fit` runs the islands' loop with the
Trainer's callbacks (a callback's epoch is a round), validation of the global model
every round, and `BackupAndRestore` on each island; a config's `fault_isolation` section
does the same from `distrain train`.
"""

import dataclasses
import json
from pathlib import Path

import numpy as np
import optax
import pytest

QUICKSTART = Path(__file__).resolve().parent.parent / "configs" / "quickstart.yaml"


def _problem():
    import jax
    import jax.numpy as jnp

    import distrain as dt

    rng = np.random.default_rng(0)
    w_true = rng.standard_normal((4, 1)).astype(np.float32)
    x = rng.standard_normal((96, 4)).astype(np.float32)
    data = {"x": x, "y": x @ w_true}

    def loss_of(params, batch):
        return jnp.sum((batch["x"] @ params["w"] - batch["y"]) ** 2, axis=-1)

    def train_step(state, batch):
        def loss_fn(params):
            return dt.compute_average_loss(loss_of(params, batch))

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    def eval_step(state, batch):
        return {
            "loss": dt.metrics.Mean.from_values(
                loss_of(state.params, batch), mask=batch.get("mask")
            )
        }

    state = dt.TrainState.create(params={"w": jnp.zeros((4, 1))}, tx=optax.sgd(0.05, momentum=0.5))
    return train_step, eval_step, state, data


@pytest.mark.one_end("lowest")  # a local Ray and its actors: see tests/conftest.py
def test_fit_is_the_islands_loop_with_callbacks_validation_and_backups(local_ray, tmp_path):
    """One island through `Trainer.fit` ends with the parameters `islands.train` gives for
    the same inputs (the same loop); `JSONLinesLogger` writes one epoch event per round
    with the round's loss and the validation of the global model it started from;
    `BackupAndRestore` backs up each round, and a second fit resumes its position from it
    and trains nothing (the run is finished)."""
    import jax

    import distrain as dt

    train_step, eval_step, state, data = _problem()
    iso = dict(sync_every=2, death_timeout=5.0, heartbeat_interval=0.5, island=0, islands=1)
    reference = dt.experimental.islands.train(
        train_step, state, data, batch_size=8, directory=str(tmp_path / "ref"), epochs=1, **iso
    )  # 96 rows / (8 rows x 2 steps): 6 rounds
    assert reference.rounds == 6

    pipeline = dt.data.ArrayPipeline(data, global_batch_size=8)
    islands = dt.experimental.islands.FaultIsolation(directory=str(tmp_path / "run"), **iso)
    backup = dt.callbacks.BackupAndRestore(tmp_path / "backup", delete_checkpoint=False)
    jsonl = tmp_path / "metrics.jsonl"

    class End(dt.callbacks.Callback):
        def on_train_end(self, logs=None):
            self.logs = dict(logs)

    end = End()
    callbacks = [dt.callbacks.JSONLinesLogger(jsonl), backup, end]
    trainer = dt.Trainer(dt.MirroredStrategy(), train_step, eval_step, callbacks=callbacks,
                         islands=islands)  # fmt: skip
    val = dt.data.ArrayPipeline(data, global_batch_size=16, shuffle=False, num_epochs=1)
    final, history = trainer.fit(state, pipeline, epochs=1, validation_data=val)

    np.testing.assert_array_equal(np.asarray(final.params["w"]), reference.params["w"])
    events = [json.loads(x) for x in jsonl.read_text().splitlines()]
    epochs = [e for e in events if e["event"] == "epoch"]
    assert [e["epoch"] for e in epochs] == list(range(6)) == history.epoch
    assert [e["step"] for e in epochs] == [2 * (r + 1) for r in range(6)]
    assert all(np.isfinite(e["loss"]) and np.isfinite(e["val_loss"]) for e in epochs)
    assert [e["rows"] for e in epochs] == [16] * 6  # one island: every round's 2 x 8 rows
    # Validation is of the global model a round starts from: round 0's is the initial one.
    initial = trainer.evaluate(state, val)["loss"]
    assert epochs[0]["val_loss"] == pytest.approx(initial, rel=1e-6)
    assert epochs[-1]["val_loss"] < 0.5 * initial  # 0.41 x after 5 of 6 rounds
    assert history.history["val_loss"] == pytest.approx([e["val_loss"] for e in epochs])
    # on_train_end gets the validation of the final global parameters.
    assert end.logs["val_loss"] == pytest.approx(trainer.evaluate(final, val)["loss"], rel=1e-6)
    assert backup.newest_backup == 12  # the last round's end (step 6 x 2) and the end

    # A second fit of the finished run: the backup gives back the position, and the
    # coordinator (its directory kept) has nothing left: no round is trained.
    again = dt.Trainer(dt.MirroredStrategy(), train_step, eval_step, islands=islands,
                       callbacks=[dt.callbacks.BackupAndRestore(
                           tmp_path / "backup", delete_checkpoint=False)])  # fmt: skip
    _, history2 = again.fit(state, pipeline, epochs=1)
    assert again.loop.initial_step == 12 and history2.epoch == history.epoch

    # The backup's inner optimizer state is what the island joins a run with when no
    # peer heals it: a new run from it equals islands.train started from that state.
    restored = state.replace(opt_state=jax.device_get(again.state.opt_state))
    pairs = zip(jax.tree.leaves(restored.opt_state), jax.tree.leaves(state.opt_state),
                strict=True)  # fmt: skip
    assert not all(np.array_equal(a, b) for a, b in pairs)
    from_backup = dt.Trainer(dt.MirroredStrategy(), train_step, islands=dataclasses.replace(
        islands, directory=str(tmp_path / "from_backup")),
        # No saves: this run's steps (round x H) are older than the backup's.
        callbacks=[dt.callbacks.BackupAndRestore(tmp_path / "backup",
                                                 save_freq=10**6)])  # fmt: skip
    resumed, _ = from_backup.fit(state, pipeline, epochs=1)
    expected = dt.experimental.islands.train(
        train_step, restored, data, batch_size=8, directory=str(tmp_path / "ref2"), epochs=1,
        **iso,
    )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(resumed.params["w"]), expected.params["w"])
    assert not np.array_equal(expected.params["w"], reference.params["w"])

    class Stop(dt.callbacks.Callback):
        def on_train_batch_end(self, info):
            self.trainer.stop_training = True

    # Quantized outer gradients on this path: int8 pseudo-gradients train as float32's do.
    int8 = dt.experimental.islands.train(
        train_step, state, data, batch_size=8, directory=str(tmp_path / "int8"), epochs=1,
        outer_dtype="int8", **iso,
    )  # fmt: skip
    assert not np.array_equal(int8.params["w"], reference.params["w"])
    np.testing.assert_allclose(int8.params["w"], reference.params["w"], atol=0.05)

    fresh = dataclasses.replace(islands, directory=str(tmp_path / "stopped"))
    stopping = dt.Trainer(dt.MirroredStrategy(), train_step, islands=fresh, callbacks=[Stop()])
    with pytest.raises(ValueError, match="a callback set stop_training in a fault-isolated"):
        stopping.fit(state, pipeline)


def test_a_round_trained_again_is_told_to_the_callbacks_and_kept_once_in_the_history(tmp_path):
    """A round a shard holder lost is trained again (`island_loop.IslandLoop.retry`, run
    end to end in tests/test_islands_faults.py): the Trainer's round hooks tell the
    callbacks both attempts, and the history keeps only the applied one."""
    import distrain as dt
    from distrain._src.train.callbacks.base import CallbackList
    from distrain._src.train.islands_fit import _Rounds

    train_step, _, state, _ = _problem()
    iso = dt.experimental.islands.FaultIsolation(sync_every=2, directory=str(tmp_path),
                                                  island=0, islands=1)  # fmt: skip
    trainer = dt.Trainer(dt.MirroredStrategy(), train_step, islands=iso)
    jsonl = tmp_path / "metrics.jsonl"
    callbacks = CallbackList([dt.callbacks.JSONLinesLogger(jsonl)], trainer)
    rounds = _Rounds(trainer, callbacks, 2, (None, 1, None))
    callbacks.call("on_train_begin", None)
    for r, loss, retried in [(0, 1.0, False), (1, 0.9, True), (1, 0.8, False), (2, 0.7, False)]:
        rounds.begin(r, state.params)
        rounds.end(r, {"round": r, "rows": 4, "loss": loss, "compute_s": 0.1, "applied": True})
        if retried:
            rounds.retry(r)
    history = trainer.loop.history
    assert history.epoch == [0, 1, 2] and history.history["loss"] == pytest.approx([1, 0.8, 0.7])
    events = [json.loads(x) for x in jsonl.read_text().splitlines()]
    assert [e["epoch"] for e in events if e["event"] == "epoch"] == [0, 1, 1, 2]


def test_fit_over_islands_refuses_what_does_not_apply(tmp_path):
    """Wrong input, one line each, before anything connects; the options' defaults are
    the coordinator's."""
    import distrain as dt
    from distrain._src.islands.islands_config import IslandsConfig

    fields = dataclasses.fields
    coordinator = {f.name: f.default for f in fields(IslandsConfig)}
    options = {f.name: f.default for f in fields(dt.experimental.islands.FaultIsolation)}
    shared = set(coordinator) & set(options) - {"islands", "batch_size"}  # the run's sizes
    assert {k: options[k] for k in shared} == {k: coordinator[k] for k in shared}
    assert len(shared) == 11

    train_step, _, state, data = _problem()
    iso = dt.experimental.islands.FaultIsolation(sync_every=2, directory=str(tmp_path),
                                                  island=0, islands=1)  # fmt: skip
    with pytest.raises(TypeError, match="`islands` must be dt.experimental.islands.Fault"):
        dt.Trainer(dt.MirroredStrategy(), train_step, islands={"sync_every": 2})
    trainer = dt.Trainer(dt.MirroredStrategy(), train_step, islands=iso)
    pipeline = dt.data.ArrayPipeline(data, global_batch_size=8)
    with pytest.raises(ValueError, match=r"steps, steps_per_epoch and initial_epoch do not "
                       r"apply. Received: \{'steps': 4\}"):  # fmt: skip
        trainer.fit(state, pipeline, steps=4)
    with pytest.raises(ValueError, match="keep a goodput ledger of their own"):
        trainer.fit(state, pipeline, callbacks=[dt.callbacks.Goodput(str(tmp_path / "g"))])
    with pytest.raises(ValueError, match=r"need the rows of one inner step: pass "
                       r"FaultIsolation\(batch_size=...\)"):  # fmt: skip
        trainer.fit(state, data)


CONFIG = """
name: islands_e2e
seed: 0
strategy: {name: multi_worker_mirrored}   # inside each island: its 2 processes
model:
  fn: examples.classification:mlp
  kwargs: {input_shape: [8, 8, 1], hidden: [32], num_classes: 10}
data:
  fn: examples.classification:digits      # 1438 train / 359 test images
  global_batch_size: 32
  validation_split: test
optimizer: {name: adam, learning_rate: 0.003}
train:
  train_step: examples.classification:classification_train_step
  eval_step: examples.classification:classification_eval_step
  epochs: 2             # with min_islands: 2 the rejoin cannot miss the rows' end
  log_every: 1
logging: {dir: LOGS, jsonl: true, progress_bar: false}
checkpoint: {backup_dir: BACKUPS, backup_freq: epoch}
fault_isolation:
  sync_every: 4
  directory: RUN
  death_timeout: 5.0
  heartbeat_interval: 0.5
  start_timeout: 120.0
  min_islands: 2        # rounds wait for island 1's rejoin: on a loaded machine island 0
                        # alone could otherwise finish the rows before island 1 is back
"""


@pytest.mark.one_end("lowest")  # ~100 s: 4 JAX processes and a Ray cluster (conftest.py)
def test_distrain_train_with_fault_isolation_survives_a_sigkill(tmp_path):
    """`distrain train` with a `fault_isolation` section under `distrain launch --islands
    2 --nproc-per-island 2`; island 1's process 1 is SIGKILLed after two rounds. Every
    row is committed once; each island writes its own metrics.jsonl with the validation
    of the global model every round; island 1's restart resumes its BackupAndRestore
    backup (its logs go on from there) and both islands end with the final evaluation.
    With ``min_islands: 2`` island 0's rounds wait for island 1's rejoin."""
    import os
    import re
    import signal
    import subprocess
    import sys
    import threading
    import time
    from pathlib import Path

    from distrain._src.islands.island_coordinator import committed_rows
    from tests.processes import stop_launcher
    from tests.test_islands_multiprocess import _env, _island_pids, _lines

    root = Path(__file__).resolve().parent.parent
    run, logs, backups = tmp_path / "run", tmp_path / "logs", tmp_path / "backups"
    config = tmp_path / "islands.yaml"
    text = CONFIG.replace("LOGS", str(logs)).replace("BACKUPS", str(backups))
    config.write_text(text.replace("RUN", str(run)))
    cmd = [
        sys.executable, "-m", "distrain.cli", "launch", "--islands", "2", "--nproc-per-island",
        "2", "--devices-per-proc", "1", "--max-restarts", "2", "--",
        sys.executable, "-m", "distrain.cli", "train", "--config", str(config),
    ]  # fmt: skip
    pipe = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    proc = subprocess.Popen(cmd, env=_env(run), cwd=root, start_new_session=True, **pipe)
    out: list[str] = []
    threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True).start()
    killed_at = None
    try:
        deadline = time.time() + 400
        while proc.poll() is None and time.time() < deadline:
            rounds = [e for e in _lines(run / "island-1/timeline.jsonl") if e["event"] == "round"]
            pids = _island_pids(out, 1)
            if killed_at is None and len(rounds) >= 2 and len(pids) == 2:
                os.kill(pids[1], signal.SIGKILL)
                killed_at = time.time()
            time.sleep(0.05)
        code = proc.wait(timeout=max(1, deadline - time.time()))
    finally:
        stop_launcher(proc)
    log = "".join(out)
    assert code == 0 and killed_at is not None, log[-4000:]
    assert "[launch] island 1 process 1 was killed by SIGKILL" in log, log[-4000:]
    assert log.count("[launch] island 0 process 0 is pid") == 1  # island 0 never restarted
    every_row_twice = np.arange(1438 * 2)
    assert np.array_equal(np.sort(committed_rows(str(run))), every_row_twice)
    assert re.search(r"BackupAndRestore: resumed from the backup of step \d+", log), log[-4000:]
    assert log.count("final test: ") == 2, log[-4000:]  # each island's process 0
    for island in (0, 1):
        events = _lines(logs / f"island-{island}/metrics.jsonl")
        epochs = [e for e in events if e["event"] == "epoch"]
        trained = [e for e in epochs if e["rows"]]  # the run's last rounds may have none
        assert epochs and all("val_accuracy" in e for e in epochs)
        assert trained and all("loss" in e and e["rows"] <= 4 * 32 for e in trained)
        assert [e["epoch"] for e in epochs] == sorted({e["epoch"] for e in epochs})
        # Step r x H + k: the same numbering on every island (the run's last round may
        # hold fewer than H batches).
        assert all(4 * e["epoch"] < e["step"] <= 4 * (e["epoch"] + 1) for e in trained)
    # Island 1's logs: the rounds before its kill, then (from its backup on) the rounds
    # after its rejoin, each once.
    timeline = _lines(run / "island-1/timeline.jsonl")
    assert [e["event"] for e in timeline].count("start") == 2
    late = [e for e in _lines(logs / "island-1/metrics.jsonl") if e["event"] == "epoch"]
    rejoined = [e["round"] for e in timeline if e["event"] == "round" and e["t"] > killed_at]
    assert rejoined and {e["epoch"] for e in late} >= set(rejoined)


def test_a_config_refuses_both_kinds_of_islands():
    from distrain.config import ConfigError, load_config

    both = ["fault_isolation.sync_every=4", "fault_isolation.directory=runs/x",
            "strategy.name=diloco", "strategy.islands.islands=2",
            "strategy.islands.sync_every=2"]  # fmt: skip
    with pytest.raises(ConfigError, match="fault_isolation .* and strategy.name=diloco .* are "
                       "two ways to train islands; received both"):  # fmt: skip
        load_config(QUICKSTART, both)
    cfg = load_config(QUICKSTART, both[:2])
    islands = cfg.fault_isolation.build(seed=3)
    assert (islands.sync_every, islands.directory, islands.seed) == (4, "runs/x", 3)
