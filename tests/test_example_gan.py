"""Smoke tests of examples/gan: the custom GAN loop on 8 replicas, its metric, and resumption."""

import dataclasses
import pathlib
import sys

import jax
import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # examples/ is not a package

import distrain as dt  # noqa: E402
from examples.gan import train as gan  # noqa: E402


def test_metric_scores_the_true_mixture_as_perfect():
    q = gan.sample_quality(gan.make_dataset(20_000, seed=1))
    assert q.modes_covered == 8
    assert q.high_quality_fraction > 0.98  # 3 std of a 2-D Gaussian holds 1 - e^-4.5 = 98.9%
    np.testing.assert_allclose(q.per_mode_fraction, 1 / 8, atol=0.01)


def test_metric_catches_mode_collapse_and_blur():
    collapsed = np.repeat(gan.mode_centers()[:1], 1000, axis=0)
    q = gan.sample_quality(collapsed)
    assert q.modes_covered == 1 and q.high_quality_fraction == 1.0
    blurred = gan.make_dataset(5000) * 1.2  # every point 0.4 off its mode
    q = gan.sample_quality(blurred)
    assert q.modes_covered == 0 and q.high_quality_fraction == 0.0


def test_dataset_is_fixed_by_its_seed():
    np.testing.assert_array_equal(gan.make_dataset(100, 3), gan.make_dataset(100, 3))
    assert not np.array_equal(gan.make_dataset(100, 3), gan.make_dataset(100, 4))


def test_config_rejects_batch_not_divisible_by_replicas_times_pack():
    with pytest.raises(
        ValueError, match=r"batch_size \(60\) .* \(8 x 2\); choose a multiple of 16"
    ):
        gan.GANConfig(batch_size=60, pack=2).validate(8)


TINY = gan.GANConfig(
    steps=6,
    batch_size=64,
    n_critic=2,
    pack=2,
    latent_dim=4,
    hidden=32,
    dataset_size=2048,
    log_every=1,
)


@pytest.fixture(scope="module")
def strategy(devices):
    return dt.MirroredStrategy()


@pytest.fixture(scope="module")
def full_run(strategy, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("gan_full")
    return gan.train(TINY, strategy, workdir=str(workdir), save_every=3, num_eval_samples=512)


def test_training_is_distributed_and_moves(strategy, full_run):
    assert strategy.num_replicas_in_sync == 8 and full_run.num_replicas == 8
    h = full_run.history
    assert [r["step"] for r in h] == list(range(1, TINY.steps + 1))
    d_losses = [r["d_loss"] for r in h]
    g_losses = [r["g_loss"] for r in h]
    assert np.all(np.isfinite(d_losses)) and np.all(np.isfinite(g_losses))
    assert np.ptp(d_losses) > 1e-4  # the discriminator is learning
    # Both models come back as one replicated copy: their gradients were all-reduced.
    for tree in (full_run.state.g.params, full_run.state.d.params):
        leaf = jax.tree.leaves(tree)[0]
        assert leaf.sharding.is_fully_replicated
    assert int(full_run.state.d.step) == TINY.steps * TINY.n_critic
    assert int(full_run.state.g.step) == TINY.steps
    _, init = gan.init_state(TINY)
    moved = jax.tree.map(
        lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()),
        init.g.params,
        full_run.state.g.params,
    )
    assert max(jax.tree.leaves(moved)) > 0
    assert full_run.samples.shape == (512, 2) and np.all(np.isfinite(full_run.samples))


def test_interrupted_run_resumes_to_the_same_parameters(strategy, full_run, tmp_path):
    workdir = str(tmp_path / "ckpt")
    first = gan.train(
        TINY, strategy, workdir=workdir, save_every=3, stop_after=4, num_eval_samples=8
    )
    assert first.steps == 4 and first.resumed_from is None
    assert (tmp_path / "ckpt" / "4").is_dir()  # the interrupted step was saved

    resumed = gan.train(TINY, strategy, workdir=workdir, save_every=3, num_eval_samples=512)
    assert resumed.resumed_from == 4 and resumed.steps == TINY.steps
    # Same data position, same keys, same updates: bit-identical to the uninterrupted run.
    for a, b in zip(jax.tree.leaves(full_run.state), jax.tree.leaves(resumed.state), strict=True):
        np.testing.assert_array_equal(_raw(a), _raw(b))

    # The loss history was restored from the checkpoint and continued identically.
    def losses(h):
        return [(r["step"], r["d_loss"], r["g_loss"]) for r in h]

    assert losses(resumed.history) == losses(full_run.history)
    np.testing.assert_array_equal(resumed.samples, full_run.samples)


def test_a_different_config_cannot_restore_the_checkpoint(strategy, tmp_path):
    workdir = str(tmp_path / "ckpt")
    gan.train(TINY, strategy, workdir=workdir, stop_after=1, num_eval_samples=8)
    wider = dataclasses.replace(TINY, hidden=48)
    with pytest.raises(ValueError, match="shape"):
        gan.train(wider, strategy, workdir=workdir, num_eval_samples=8)


def _raw(x):
    """A leaf as NumPy; typed PRNG keys as their key data."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


@pytest.mark.one_end("lowest")  # a slow test: see tests/conftest.py
def test_replicas_that_span_two_devices_train_as_one_device_replicas(devices):
    """The GAN's step (two optimizers, n_critic discriminator steps) unchanged on 4
    replicas of 2 devices each equals 4 replicas of one device each."""
    cfg = dataclasses.replace(TINY, steps=3)
    runs = [
        gan.train(cfg, strategy, num_eval_samples=64)
        for strategy in (
            dt.MirroredStrategy(devices[:4]),
            dt.MirroredStrategy(devices_per_replica=2, min_shard_bytes=0),
        )
    ]
    assert runs[1].num_replicas == 4
    for a, b in zip(jax.tree.leaves(runs[0].state), jax.tree.leaves(runs[1].state), strict=True):
        np.testing.assert_allclose(_numbers(a), _numbers(b), rtol=1e-5, atol=1e-6)


def _numbers(x):
    """An array's values (a typed PRNG key's data)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)
