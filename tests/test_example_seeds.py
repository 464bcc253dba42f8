"""Smoke tests of the seed-program examples (examples/seed_cnn, seed_make_or_restore,
speed_test, mobilenet_v2): a few real steps each on 8 replicas, real checkpoints, real
processes (SIGKILL included)."""

import importlib.util
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import distrain as dt
from distrain.checkpoint import CheckpointManager

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def strategy(devices):
    """One 8-replica strategy for the module, so compiled steps are shared between tests."""
    s = dt.MirroredStrategy()
    assert s.num_replicas_in_sync == len(devices) == 8
    return s


def _quiet(_msg: str) -> None:
    pass


def _subprocess_env() -> dict[str, str]:
    env = dict(os.environ)  # keeps conftest's XLA_FLAGS: 8 virtual CPU devices
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _assert_trees_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ------------------------------------------------------------------------------ seed 000 CNN
@pytest.mark.one_end("lowest")  # a slow test: see tests/conftest.py
def test_seed_cnn_main_trains_on_8_replicas(tmp_path, devices):
    from examples.seed_cnn import main

    png = tmp_path / "curve.png"
    result = main.main(["--epochs", "2", "--plot", str(png)])
    assert result.num_replicas == 8 and result.steps == 2 * 22
    losses = [r["train_loss"] for r in result.history]
    assert all(math.isfinite(x) for x in losses)
    assert losses[1] < losses[0] < math.log(10)
    assert result.test_accuracy > 0.6  # 10 classes: chance is 0.1
    assert png.stat().st_size > 1000


def test_seed_cnn_keeps_the_seeds_valid_padding_on_28x28():
    from flax import nnx

    from examples.seed_cnn.train import CNN

    model = nnx.eval_shape(lambda: CNN(28, rngs=nnx.Rngs(0)))
    assert model.padding == "VALID"
    assert model.dense1.kernel.shape == (11 * 11 * 64, 64)  # 28 -> 26 -> 13 -> 11, as in Keras
    assert nnx.eval_shape(lambda: CNN(8, rngs=nnx.Rngs(0))).dense1.kernel.shape == (1024, 64)


def test_seed_cnn_errors(devices):
    from examples.seed_cnn import main, train

    with pytest.raises(ValueError, match="asks for more replicas than JAX has devices"):
        main.main(["--devices", "16"])
    with pytest.raises(ValueError, match="dataset must be one of"):
        train.Config(dataset="cifar10")
    with pytest.raises(ValueError, match="epochs must be an int >= 1"):
        train.Config(epochs=0)


# ------------------------------------------------------------------- seed 001 make-or-restore
def test_make_or_restore_continuation_equals_one_run(tmp_path, strategy):
    from examples.seed_make_or_restore import train

    config2 = train.Config(epochs=2)
    once = train.run_training(config2, tmp_path / "once", strategy, log=_quiet)
    assert once.resumed_from is None and once.steps_this_run == 2 * 22

    first = train.run_training(train.Config(epochs=1), tmp_path / "twice", strategy, log=_quiet)
    assert first.resumed_from is None and first.steps_this_run == 22
    logs: list[str] = []
    second = train.run_training(config2, tmp_path / "twice", strategy, log=logs.append)
    assert any(m.startswith("Restoring from") and m.endswith("/22") for m in logs)
    assert second.resumed_from == 22 and second.steps_this_run == 22

    _assert_trees_equal(second.state.params, once.state.params)
    _assert_trees_equal(second.state.opt_state, once.state.opt_state)
    assert second.step_losses == once.step_losses  # same batches in the same order
    assert second.history == once.history
    losses = [r["train_loss"] for r in once.history]
    assert all(math.isfinite(x) for x in losses) and losses[1] < losses[0]

    again = train.run_training(config2, tmp_path / "twice", strategy, log=_quiet)
    assert again.steps_this_run == 0  # finished: nothing left to train
    _assert_trees_equal(again.state.params, once.state.params)


@pytest.mark.one_end("newest")  # a real process; see tests/conftest.py
def test_make_or_restore_survives_sigkill(tmp_path, strategy, capsys):
    """A real process is SIGKILLed mid-run; the same command finishes the run exactly."""
    from examples.seed_make_or_restore import main, train

    ckpt, log_path, png = tmp_path / "ckpt", tmp_path / "run1.log", tmp_path / "curve.png"
    argv = ["--ckpt-dir", str(ckpt), "--epochs", "3", "--save-every-steps", "6"]
    total = 3 * 22
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "examples.seed_make_or_restore.main", *argv],
            cwd=ROOT,
            env=_subprocess_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 90
        while not [p for p in ckpt.glob("*") if p.name.isdigit()]:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint was written within 90 s"
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    with CheckpointManager(ckpt) as mgr:
        killed_at = mgr.latest_step()
    assert killed_at is not None and killed_at < total, "the run finished before the kill"

    # The same command again (in this process, which has the same 8 CPU devices).
    rerun = main.main([*argv, "--plot", str(png)])
    assert f"Restoring from {ckpt}/{killed_at}" in capsys.readouterr().out
    assert rerun.resumed_from == killed_at and rerun.resumed_at == [killed_at]
    assert png.stat().st_size > 1000

    reference = train.run_training(
        train.Config(epochs=3, save_every_steps=6), tmp_path / "reference", strategy, log=_quiet
    )
    _assert_trees_equal(rerun.state.params, reference.state.params)
    _assert_trees_equal(rerun.state.opt_state, reference.state.opt_state)
    assert rerun.step_losses == reference.step_losses
    with CheckpointManager(ckpt) as mgr:
        final = mgr.restore(target=reference.state)
    assert final.step == total
    _assert_trees_equal(final.state.params, reference.state.params)


def test_make_or_restore_errors(tmp_path, devices):
    from examples.seed_make_or_restore import main, train

    with pytest.raises(ValueError, match="save_every_steps must be an int >= 1"):
        main.main(["--ckpt-dir", str(tmp_path), "--save-every-steps", "0"])
    with pytest.raises(ValueError, match="dataset must be one of"):
        train.Config(dataset="cifar10")


# ---------------------------------------------------------------------- seed 003 speed test
@pytest.mark.one_end("newest")  # a real process; see tests/conftest.py
def test_speed_test_prints_both_timings(capsys):
    from examples.speed_test import main

    normal, dist = main.main(["--epochs", "1", "--timeout", "120"])
    out = capsys.readouterr().out
    assert normal["num_devices"] == 1 and dist["num_devices"] == 8
    assert normal["steps"] == dist["steps"] == 1438 // 200
    for run in (normal, dist):
        assert run["total_seconds"] > 0 and run["steps_per_second"] > 0
        assert math.isfinite(run["final_loss"]) and run["final_loss"] < math.log(10)
    row = next(line for line in out.splitlines() if line.startswith("time taken, s"))
    assert row.split()[-2:] == [f"{normal['total_seconds']:.2f}", f"{dist['total_seconds']:.2f}"]
    assert "share this machine's" in out


def test_speed_test_flags_and_errors(devices):
    from examples.speed_test import main

    assert main.xla_flags_with_devices("--foo --xla_force_host_platform_device_count=8", 1) == (
        "--foo --xla_force_host_platform_device_count=1"
    )
    assert main.xla_flags_with_devices("", 8) == "--xla_force_host_platform_device_count=8"
    with pytest.raises(ValueError, match="asks for more replicas than this process has"):
        main.main(["--mode", "distributed", "--devices", "16"])


# ----------------------------------------------------------------------- seed 004 MobileNetV2
def test_mobilenet_v2_has_the_keras_parameter_count():
    from flax import nnx

    from examples.mobilenet_v2.model import MobileNetV2

    model = nnx.eval_shape(lambda: MobileNetV2(1000, 1.0, rngs=nnx.Rngs(0)))
    count = lambda kind: sum(x.size for x in jax.tree.leaves(nnx.state(model, kind)))
    # tf.keras.applications.MobileNetV2(weights=None): 3,504,872 trainable + 34,112 BN averages.
    assert count(nnx.Param) == 3_504_872
    assert count(nnx.BatchStat) == 34_112
    with pytest.raises(ValueError, match="stages must be in"):
        MobileNetV2(2, 1.0, stages=8, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="width_multiplier must be > 0"):
        MobileNetV2(2, 0.0, rngs=nnx.Rngs(0))


@pytest.mark.one_end("lowest")  # a slow test: see tests/conftest.py
def test_mobilenet_v2_step_learns_and_keeps_batch_stats_replicated(strategy):
    from examples.mobilenet_v2 import data, train

    config = train.Config(stages=1, global_batch_size=32)
    graphdef, state = train.create_state(config, strategy)
    batch = strategy.distribute_batch(data.make_stripes(32, seed=3))
    stats0 = state.extra["batch_stats"]
    losses = []
    for _ in range(6):  # fit one batch: the loss must fall
        state, metrics = strategy.run(train.train_step, args=(graphdef, state, batch))
        losses.append(float(strategy.reduce("sum", metrics["loss"])))
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert len(strategy.experimental_local_results(metrics["loss"])) == 8
    mean = state.extra["batch_stats"]["stem"]["bn"]["mean"]
    assert mean.sharding.is_fully_replicated  # averaged over replicas, one value everywhere
    assert not np.allclose(np.asarray(mean), np.asarray(stats0["stem"]["bn"]["mean"]))
    assert int(state.step) == 6


@pytest.mark.one_end("lowest")  # a slow test: see tests/conftest.py
def test_mobilenet_v2_sync_batch_norm_matches_one_device(strategy, devices):
    """With --sync-batch-norm, 8 replicas normalise over the global batch: one step
    gives the loss and parameters of one device on the whole batch."""
    from examples.mobilenet_v2 import data, train

    config = train.Config(stages=1, global_batch_size=32, sync_batch_norm=True)
    batch = data.make_stripes(32, seed=4)
    results = []
    for s in (strategy, dt.MirroredStrategy(devices[:1])):
        graphdef, state = train.create_state(config, s)
        state, metrics = s.run(train.train_step, args=(graphdef, state, s.distribute_batch(batch)))
        results.append((float(s.reduce("sum", metrics["loss"])), state))
    (loss8, state8), (loss1, state1) = results
    np.testing.assert_allclose(loss8, loss1, rtol=1e-5)
    # Compare gradients through Adam's first moment (0.1 * grad after one step), not the
    # parameters: Adam's first step moves every parameter by ~lr * sign(grad), which
    # turns rounding noise into differences of ~lr.
    # Tolerance: 1% of each leaf's largest entry (float32 sums in another order through
    # batch norm's mean subtraction: measured <= 0.03%); per-replica statistics differ by
    # 8% to 70% of it on every leaf (measured), and by 0.8% in the loss.
    mu8 = jax.tree_util.tree_leaves_with_path(state8.opt_state[0].mu)
    mu1 = jax.tree.leaves(state1.opt_state[0].mu)
    scale = max(float(np.abs(b).max()) for b in mu1)
    noise = 1e-5 * scale  # float32 rounding of this step's sums sits near 1e-7 of it
    zero = []
    for (path, a), b in zip(mu8, mu1, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        if np.abs(b).max() < noise:
            # Zero in exact arithmetic (the project batch norm's bias, whose shift the
            # next batch norm subtracts again): both sides must be rounding noise.
            zero.append(jax.tree_util.keystr(path))
            assert np.abs(a).max() < noise, (zero[-1], np.abs(a).max(), noise)
            continue
        np.testing.assert_allclose(
            a, b, rtol=1e-2, atol=1e-2 * np.abs(b).max(), err_msg=jax.tree_util.keystr(path)
        )
    assert len(zero) <= 1, f"gradients at rounding level, compared as noise only: {zero}"


def test_mobilenet_v2_main_smoke(tmp_path, devices):
    from examples.mobilenet_v2 import main

    png = tmp_path / "curve.png"
    result = main.main(
        [
            "--stages",
            "1",
            "--num-train",
            "64",
            "--num-test",
            "32",
            "--global-batch-size",
            "32",
            "--epochs",
            "2",
            "--plot",
            str(png),
        ]
    )
    assert result.num_replicas == 8 and result.steps == 4
    assert all(math.isfinite(r["train_loss"]) for r in result.history)
    assert 0.0 <= result.test_accuracy <= 1.0
    assert png.stat().st_size > 1000


def test_stripes_are_balanced_and_seeded():
    from examples.mobilenet_v2 import data

    a, b = data.make_stripes(200, seed=5), data.make_stripes(200, seed=5)
    np.testing.assert_array_equal(a["image"], b["image"])
    assert a["image"].shape == (200, 32, 32, 3) and a["image"].dtype == np.uint8
    assert np.bincount(a["label"]).tolist() == [100, 100]
    # Brightness alone does not give the class away (the areas overlap by design).
    mean = a["image"].reshape(200, -1).mean(1)
    assert abs(mean[a["label"] == 0].mean() - mean[a["label"] == 1].mean()) < 10
    with pytest.raises(ValueError, match="image_size >= 24"):
        data.make_stripes(10, image_size=16)


def test_cats_vs_dogs_loader_reads_a_jpeg_directory(tmp_path):
    from PIL import Image

    from examples.mobilenet_v2 import data, train

    rng = np.random.default_rng(0)
    for cls, n in (("Cat", 3), ("Dog", 2)):
        folder = tmp_path / "PetImages" / cls
        folder.mkdir(parents=True)
        for i in range(n):
            pixels = rng.integers(0, 255, (40 + i, 50, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(folder / f"{i}.jpg")
    (tmp_path / "PetImages" / "Cat" / "666.jpg").write_bytes(b"not a jpeg")  # as in the archive
    loaded, skipped = data.load_cats_vs_dogs(tmp_path, image_size=32)
    assert skipped == 1
    assert loaded["image"].shape == (5, 32, 32, 3) and loaded["image"].dtype == np.uint8
    assert loaded["label"].tolist() == [0, 0, 0, 1, 1]
    train_split, test_split = train.load_data(
        train.Config(dataset="cats_vs_dogs", data_dir=str(tmp_path))
    )
    assert len(train_split["label"]) + len(test_split["label"]) == 5

    with pytest.raises(FileNotFoundError, match="Expected the cats-vs-dogs images"):
        data.load_cats_vs_dogs(tmp_path / "missing")
    (tmp_path / "broken" / "Cat").mkdir(parents=True)
    (tmp_path / "broken" / "Dog").mkdir()
    (tmp_path / "broken" / "Dog" / "1.jpg").write_bytes(b"junk")
    with pytest.raises(ValueError, match="No image in .* could be decoded"):
        data.load_cats_vs_dogs(tmp_path / "broken")


@pytest.mark.skipif(
    importlib.util.find_spec("tensorflow_datasets") is not None,
    reason="tensorflow_datasets is installed: the error path cannot occur",
)
def test_cats_vs_dogs_without_directory_needs_tfds():
    from examples.mobilenet_v2 import data

    with pytest.raises(ImportError, match="tensorflow_datasets, which is not installed"):
        data.load_cats_vs_dogs(None)
