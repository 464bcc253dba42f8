"""Smoke test of examples/mnist_mlp: the Keras guide's MLP through dt.Trainer, few steps.

MNIST cannot be downloaded here, so the smoke test uses the example's offline
``--dataset digits`` path; the MNIST loader itself is tested in test_datasets.py.
"""

import pytest

from examples.mnist_mlp.train import MLP, load, train_and_evaluate


def test_mnist_mlp_example_few_steps(devices):
    logs = []
    out = train_and_evaluate(
        dataset="digits", steps=30, global_batch_size=64, progress=False, log=logs.append
    )
    assert logs[0] == "Number of devices: 8"
    assert out["steps"] == 30
    assert out["history"]["loss"][-1] < out["history"]["loss"][0]
    assert out["test"]["accuracy"] > 0.6  # 30 steps: far above chance (0.1)
    assert logs[-1].startswith("test: loss=")


def test_mnist_mlp_matches_the_keras_model():
    from flax import nnx

    shapes = {
        k: v["kernel"].shape
        for k, v in nnx.to_pure_dict(nnx.state(MLP(784, rngs=nnx.Rngs(0)))).items()
    }
    assert shapes == {"d1": (784, 256), "d2": (256, 256), "out": (256, 10)}
    with pytest.raises(ValueError, match="dataset must be 'mnist' or 'digits'"):
        load("cifar", 0)
