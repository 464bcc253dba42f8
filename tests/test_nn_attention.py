"""dt.nn.dot_product_attention over a split sequence equals the unsplit attention.

Forward values and gradients (wrt q, k and v) of the ring and the all-gather variants,
on a "context" axis of 4 and 8 of the 8 virtual CPU devices, causal or not, with and
without segment ids, with and without load balancing, in float32 and bfloat16, are
compared with ``jax.nn.dot_product_attention`` on the whole sequence (one device).
Tolerances: float32 1e-5 (absolute, values and gradients of order 1); bfloat16 3e-2
(the reference itself rounds its probabilities to bfloat16; the ring merges blocks in
float32, so the two round at different places).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

import distrain as dt

B, T, N, D = 2, 32, 4, 8
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 3e-2}


def mesh_of(context):
    grid = np.array(jax.devices()).reshape(8 // context, context)
    return Mesh(grid, ("fsdp", "context"), axis_types=(AxisType.Auto, AxisType.Auto))


def inputs(dtype=jnp.float32, kv_heads=N):
    r = np.random.default_rng(0)
    q = r.normal(size=(B, T, N, D))
    k, v = (r.normal(size=(B, T, kv_heads, D)) for _ in range(2))
    # Documents of uneven lengths, the same in no two rows.
    seg = np.stack([np.repeat([1, 2, 3, 4], n) for n in ([3, 13, 9, 7], [16, 1, 10, 5])])
    w = r.normal(size=(B, T, N, D))  # the cotangent: every output entry matters
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return cast(q), cast(k), cast(v), jnp.asarray(seg, jnp.int32), jnp.asarray(w, jnp.float32)


def value_and_grads(attn, q, k, v, w):
    def loss(q, k, v):
        out = attn(q, k, v)
        return (out.astype(jnp.float32) * w).sum(), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return out, grads


def reference(q, k, v, seg, w, *, causal, segments):
    mask = None
    if segments:
        mask = (seg[:, :, None] == seg[:, None, :])[:, None]
    attn = functools.partial(jax.nn.dot_product_attention, mask=mask, is_causal=causal)
    return jax.jit(value_and_grads, static_argnums=0)(attn, q, k, v, w)


def split(q, k, v, seg, w, *, causal, segments, implementation, context, balance):
    """The op under jit with a context mesh; load balancing permutes the inputs (and
    positions) first and un-permutes the output, as the input path and a per-token
    loss would."""
    mesh = mesh_of(context)
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))

    def attn(q, k, v):
        tree = {"q": q, "k": k, "v": v, "pos": pos, "seg": seg}
        if balance:
            tree = dt.nn.load_balance(tree, context)
        out = dt.nn.dot_product_attention(
            tree["q"], tree["k"], tree["v"], is_causal=causal,
            segment_ids=tree["seg"] if segments else None,
            positions=tree["pos"] if balance else None,
            implementation=implementation,
        )  # fmt: skip
        return dt.nn.load_balance_inverse(out, context) if balance else out

    with jax.sharding.set_mesh(mesh):
        return jax.jit(value_and_grads, static_argnums=0)(attn, q, k, v, w)


def assert_close(got, want, tol):
    for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.shape == e.shape and g.dtype == e.dtype
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(e, np.float32), atol=tol)


# Every mask combination on a ring of 4; the ring of 8 (more blocks, each skipped or
# not by the same rule) with every mask at once: the other combinations at 8 took ~40 s
# of the suite on each jax and exercised no code that these miss.
@pytest.mark.split_ends  # a slow test: see tests/conftest.py
@pytest.mark.parametrize("implementation", ["ring", "all_gather"])
@pytest.mark.parametrize(
    "context, causal, segments, balance",
    [(4, False, False, False), (4, True, False, False), (4, False, True, False),
     (4, True, True, False), (4, True, False, True), (4, True, True, True),
     (8, True, True, True), (8, False, True, False)],
)  # fmt: skip
def test_split_attention_equals_the_whole_float32(
    devices, implementation, context, causal, segments, balance
):
    assert len(devices) == 8
    q, k, v, seg, w = inputs()
    want = reference(q, k, v, seg, w, causal=causal, segments=segments)
    got = split(
        q, k, v, seg, w, causal=causal, segments=segments, implementation=implementation,
        context=context, balance=balance,
    )  # fmt: skip
    assert_close(got, want, TOL[jnp.float32])


@pytest.mark.split_ends
@pytest.mark.parametrize("implementation", ["ring", "all_gather"])
@pytest.mark.parametrize("balance", [False, True])
def test_split_attention_equals_the_whole_bfloat16(devices, implementation, balance):
    q, k, v, seg, w = inputs(jnp.bfloat16)
    want = reference(q, k, v, seg, w, causal=True, segments=True)
    got = split(
        q, k, v, seg, w, causal=True, segments=True, implementation=implementation,
        context=4, balance=balance,
    )  # fmt: skip
    assert got[0].dtype == jnp.bfloat16
    assert_close(got, want, TOL[jnp.bfloat16])


def test_grouped_query_heads(devices):
    q, k, v, seg, w = inputs(kv_heads=2)
    want = reference(q, k, v, seg, w, causal=True, segments=True)
    got = split(
        q, k, v, seg, w, causal=True, segments=True, implementation="ring", context=4,
        balance=False,
    )  # fmt: skip
    assert_close(got, want, TOL[jnp.float32])


def test_without_a_context_axis_it_is_jax_attention(devices):
    q, k, v, seg, w = inputs()
    whole = dt.nn.dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_array_equal(whole, jax.nn.dot_product_attention(q, k, v, is_causal=True))
    mesh = Mesh(np.array(devices).reshape(8, 1), ("fsdp", "context"))  # context of size 1
    with jax.sharding.set_mesh(mesh):
        same = jax.jit(lambda q, k, v: dt.nn.dot_product_attention(q, k, v, is_causal=True))(
            q, k, v
        )
    np.testing.assert_allclose(same, whole, atol=1e-6)


def test_inside_a_shard_map_manual_over_context(devices):
    """Already manual over the axis (a user's own shard_map): local blocks go in."""
    q, k, v, seg, w = inputs()
    mesh = mesh_of(4)
    seq = P(None, "context")

    def body(q, k, v, seg):
        return dt.nn.dot_product_attention(q, k, v, is_causal=True, segment_ids=seg)

    f = jax.shard_map(body, mesh=mesh, in_specs=seq, out_specs=seq, axis_names={"context"})
    got = jax.jit(f)(q, k, v, seg)
    want = reference(q, k, v, seg, w, causal=True, segments=True)[0]
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_through_a_strategy_with_a_context_axis(devices):
    """The LM shape of use: a replica {fsdp: 2, context: 4}, the batch's sequence split by
    the strategy's batch layout, attention inside strategy.run; equal to one device."""
    r = np.random.default_rng(3)
    batch = {
        "x": r.normal(size=(4, T, N * D)).astype(np.float32),
        "segment_ids": np.repeat([[1, 2]], 4 * T // 2, 0).reshape(4, T).astype(np.int32),
    }
    params = {"w": (r.normal(size=(N * D, 3 * N * D)) * 0.2).astype(np.float32)}

    def step(state, batch):
        def loss_fn(p):
            q, k, v = jnp.split((batch["x"] @ p["w"]).reshape(-1, T, 3 * N, D), 3, axis=2)
            y = dt.nn.dot_product_attention(
                q, k, v, is_causal=True, segment_ids=batch["segment_ids"]
            )
            return dt.compute_average_loss((y**2).mean((1, 2, 3)))

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    results = []
    for strategy in (
        dt.MirroredStrategy(devices[:1]),
        dt.MirroredStrategy(
            devices_per_replica={"fsdp": 2, "context": 4},
            batch_layout={"x|segment_ids": P(None, "context")},
        ),
    ):
        state = strategy.put_replicated(dt.TrainState.create(params=params, tx=optax.sgd(0.1)))
        placed = strategy.distribute_batch(batch)
        state, loss = strategy.run(step, args=(state, placed))
        # The ring's ppermutes move data inside a replica: the new parameters are still
        # known to be identical on every replica (one replicated array, no warning).
        assert not isinstance(state.params["w"], dt.PerReplica)
        results.append(jax.device_get((state.params, strategy.reduce("sum", loss))))
    assert_close(results[1], results[0], 1e-5)


# ------------------------------------------------------------------ errors


def test_a_sequence_that_does_not_divide_the_axis(devices):
    q = jnp.ones((1, 30, 2, 4))
    with jax.sharding.set_mesh(mesh_of(4)):
        msg = r"length 30 is not divisible by .*'context' axis \(4\)"
        with pytest.raises(ValueError, match=msg):
            jax.jit(dt.nn.dot_product_attention)(q, q, q)
    with pytest.raises(ValueError, match=r"2 x 4 = 8 chunks, but the sequence length 28 is not"):
        dt.nn.load_balance({"tokens": np.zeros((1, 28))}, 4)


def test_bad_arguments():
    q = jnp.ones((1, 8, 4, 4))
    attn = dt.nn.dot_product_attention
    with pytest.raises(ValueError, match=r"implementation must be one of \[None, 'ring', 'all_"):
        attn(q, q, q, implementation="flash")
    with pytest.raises(
        ValueError, match=(r"key and value must have the same shape.* value \(1, 8, 4, 2\)")
    ):
        attn(q, q, q[..., :2])
    with pytest.raises(
        ValueError, match=(r"must be \[batch, seq, heads, head_dim\]. Received: query \(8, 4, 4\)")
    ):
        attn(q[0], q, q)
    with pytest.raises(ValueError, match=r"query's heads \(4\) must be a multiple of key's \(3\)"):
        attn(q, q[:, :, :3], q[:, :, :3])
    with pytest.raises(
        ValueError, match=(r"segment_ids must be \[batch, seq\] = \(1, 8\). Received shape \(8,\)")
    ):
        attn(q, q, q, segment_ids=jnp.zeros(8))
    with pytest.raises(
        ValueError, match=(r"Leaf \"\['x'\]\" has shape \(1, 6\): expected dimension 1 of length 8")
    ):
        dt.nn.load_balance({"tokens": np.zeros((1, 8)), "x": np.zeros((1, 6))}, 2)
    with pytest.raises(
        ValueError, match=(r"axis_size must be a positive int. Received: axis_size=0")
    ):
        dt.nn.LoadBalance(0)


def test_load_balance_order_and_inverse():
    order = dt.nn.load_balance_order(16, 4)
    # device i (two entries of 4 // 2... ) holds chunks i and 7 - i of 2-token chunks
    assert order.reshape(4, 4).tolist() == [
        [0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]
    ]  # fmt: skip
    tree = {"tokens": np.arange(32).reshape(2, 16), "positions": np.tile(np.arange(16), (2, 1))}
    balanced = dt.nn.load_balance(tree, 4)
    np.testing.assert_array_equal(balanced["positions"][0], order)
    back = dt.nn.load_balance_inverse(balanced, 4)
    jax.tree.map(np.testing.assert_array_equal, back, tree)
    one = dt.nn.LoadBalance(4)({"tokens": np.arange(16)})
    np.testing.assert_array_equal(one["tokens"], order)
    # causal work per device: visible (query, key) pairs are the same on every device
    pos = order.reshape(4, 4)
    work = [(p[:, None] >= np.arange(16)[None]).sum() for p in pos]
    assert len(set(work)) == 1
