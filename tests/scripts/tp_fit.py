"""Fits on a tensor-parallel replica mesh {"fsdp": 4, "tensor": 2} (8 CPU devices) with
the layout of docs/scaling.md, from host and from device-resident input, with a padded
last batch. Run by tests/test_tensor_parallel_rows.py, which reads the process's stderr
for XLA's warnings (printed from C++)."""

import os

os.environ["XLA_FLAGS"] = (
    "--xla_force_host_platform_device_count=8 "
    + os.environ.get("DISTRAIN_TEST_XLA_COMPILE_FLAGS", "")  # tests/conftest.py
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import distrain as dt  # noqa: E402


def init_params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w1": jax.random.normal(k1, (64, 128)) * 0.1,
        "b1": jnp.zeros(128),
        "w2": jax.random.normal(k2, (128, 10)) * 0.1,
        "b2": jnp.zeros(10),
    }


def tensor_parallel_step(state, batch):
    def loss_fn(params):
        h = batch["x"] @ params["w1"] + params["b1"]
        h = jax.lax.with_sharding_constraint(h, P("fsdp", "tensor"))
        logits = jax.nn.relu(h) @ params["w2"] + params["b2"]
        per_example = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        return dt.compute_average_loss(per_example, mask=batch["mask"])

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


def docs_layout_fit(mode):
    strategy = dt.MirroredStrategy(
        devices_per_replica={"fsdp": 4, "tensor": 2},
        layout={"w1": P("fsdp", "tensor"), "w2": P("tensor", None)},
    )
    r = np.random.default_rng(0)
    data = {"x": r.normal(size=(80, 64)).astype(np.float32), "y": r.integers(0, 10, 80)}
    pipeline = dt.data.ArrayPipeline(
        data, global_batch_size=32, drop_remainder=False, mask_key="mask", num_epochs=1
    )  # 32 + 32 + 16 real rows of 32
    state = dt.TrainState.create(params=init_params(), tx=optax.adam(1e-3))
    trainer = dt.Trainer(strategy, tensor_parallel_step, input_mode=mode)
    state, history = trainer.fit(state, pipeline, epochs=1)
    assert trainer.input_mode == mode and int(state.step) == 3
    print(f"docs layout, {mode} input: loss {history.history['loss'][-1]:.4f}", flush=True)


if __name__ == "__main__":
    for mode in ("host", "device"):
        docs_layout_fit(mode)
