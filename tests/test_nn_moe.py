"""dt.nn.moe: equal to a plain per-token loop over experts (values and gradients) on one
device and with the experts split over an "expert" axis; capacity, statistics, errors."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import distrain as dt
from distrain._src.nn.moe import update_selection_bias
from distrain._src.nn.moe_exchange import ragged_plan

D, F, E, K = 8, 16, 4, 2
EXPERT_RULES = {r"w_in|w_gate|w_out": P("expert")}


def make_params(seed=0, gate=False, shared=False, experts=E):
    r = np.random.default_rng(seed)
    n = lambda *s: (r.normal(size=s) * 0.3).astype(np.float32)  # noqa: E731
    p = {"router": n(D, experts), "w_in": n(experts, D, F), "w_out": n(experts, F, D)}
    if gate:
        p["w_gate"] = n(experts, D, F)
    if shared:
        p["shared"] = {"w_in": n(D, F), "w_gate": n(D, F), "w_out": n(F, D)}
    return p


def tokens(n=16, seed=1):
    return np.random.default_rng(seed).normal(size=(n, D)).astype(np.float32)


def reference(x, p, top_k=K, capacity=None, act=jax.nn.gelu, groups=1, bias=0.0):
    """A plain loop: each token's chosen experts, one at a time (capacity: the first
    `capacity` choices of each expert in (token, rank) order, in each of `groups` equal
    runs of tokens; experts chosen by probability + `bias`, weighted without it)."""
    logits = x @ p["router"]
    probs = jax.nn.softmax(logits, -1)
    chosen = jax.lax.top_k(probs + bias, top_k)[1]
    w = jnp.take_along_axis(probs, chosen, 1)
    w = w / w.sum(-1, keepdims=True)
    rows, dropped = [], 0
    for t in range(x.shape[0]):
        if t % (x.shape[0] // groups) == 0:
            taken = [0] * p["router"].shape[1]
        y = jnp.zeros(x.shape[1])
        for j in range(top_k):
            e = int(chosen[t, j])
            taken[e] += 1
            if capacity is not None and taken[e] > capacity:
                dropped += 1
                continue
            h = x[t] @ p["w_in"][e]
            h = act(x[t] @ p["w_gate"][e]) * h if "w_gate" in p else act(h)
            y = y + w[t, j] * (h @ p["w_out"][e])
        if "shared" in p:
            s = p["shared"]
            y = y + (act(x[t] @ s["w_gate"]) * (x[t] @ s["w_in"])) @ s["w_out"]
        rows.append(y)
    return jnp.stack(rows), dropped, chosen, w


def moe_and_grads(x, p, **kw):
    """y, the stats, and the gradients of a fixed function of y (x and params)."""
    cot = jnp.asarray(np.random.default_rng(9).normal(size=x.shape).astype(np.float32))

    def f(x, p):
        y, stats = dt.nn.moe(x, p, top_k=K, **kw)
        return jnp.sum(y * cot) + stats["load_balancing_loss"], (y, stats)

    (_, (y, stats)), grads = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(x, p)
    return y, stats, grads


def reference_grads(x, p, capacity=None, groups=1):
    cot = jnp.asarray(np.random.default_rng(9).normal(size=x.shape).astype(np.float32))

    def f(x, p):
        y = reference(x, p, capacity=capacity, groups=groups)[0]
        probs = jax.nn.softmax(x @ p["router"], -1)
        chosen = jax.lax.top_k(probs, K)[1]
        load = jnp.bincount(chosen.reshape(-1), length=p["router"].shape[1]) / chosen.size
        return jnp.sum(y * cot) + p["router"].shape[1] * jnp.sum(load * probs.mean(0))

    return jax.grad(f, argnums=(0, 1))(x, p)


def close(a, b, tol=1e-5):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=tol, atol=tol)


# ------------------------------------------------------------------ one device


@pytest.mark.parametrize("gate, shared", [(False, False), (True, True)])
@pytest.mark.split_ends  # a slow test: see tests/conftest.py
def test_one_device_equals_the_per_token_loop(gate, shared):
    x, p = jnp.asarray(tokens()), make_params(gate=gate, shared=shared)
    want, dropped, chosen, w = reference(x, p)
    weights, experts, _ = dt.nn.route(x @ p["router"], K)
    np.testing.assert_array_equal(experts, chosen)  # the same routing first
    close(weights, w, 1e-6)
    y, stats, grads = jax.jit(moe_and_grads)(x, p)
    close(y, want)
    close(grads, reference_grads(x, p))
    assert dropped == 0 and float(stats["dropped_fraction"]) == 0.0
    load = np.bincount(np.asarray(chosen).ravel(), minlength=E) / chosen.size
    close(stats["expert_load"], load)
    probs = np.asarray(jax.nn.softmax(x @ p["router"], -1))
    close(stats["load_balancing_loss"], E * np.sum(load * probs.mean(0)))
    lse = np.asarray(jax.nn.logsumexp(x @ p["router"], -1))
    close(stats["router_z_loss"], np.mean(lse**2))


def test_a_capacity_drops_the_later_choices_and_reports_them():
    x, p = jnp.asarray(tokens(32)), make_params(seed=4)
    capacity = math.ceil(0.5 * 32 * K / E)
    want, dropped, _, _ = reference(x, p, capacity=capacity)
    y, stats, grads = moe_and_grads(x, p, capacity_factor=0.5)
    assert dropped > 0
    close(stats["dropped_fraction"], dropped / (32 * K))
    close(y, want)
    close(grads, reference_grads(x, p, capacity=capacity))


def test_a_selection_bias_changes_the_routing_only():
    """DeepSeek-V3's balancing bias: experts chosen by score + bias, weighted by the
    unbiased scores; the chosen experts' outputs are the per-token loop's; no gradient
    reaches the bias; the update moves it towards balance."""
    x, p = jnp.asarray(tokens()), make_params(seed=7)
    probs = jax.nn.softmax(x @ p["router"], -1)
    bias = jnp.asarray([0.3, 0.0, -0.3, 0.0], jnp.float32)
    biased = dict(p, selection_bias=bias)
    w, e, _ = dt.nn.route(x @ p["router"], K, selection_bias=bias)
    np.testing.assert_array_equal(e, jax.lax.top_k(probs + bias, K)[1])
    unbiased = jnp.take_along_axis(probs, e, 1)
    close(w, unbiased / unbiased.sum(-1, keepdims=True), 1e-6)
    assert not np.array_equal(e, dt.nn.route(x @ p["router"], K)[1])  # it did reroute
    y, stats, grads = moe_and_grads(x, biased)
    close(y, reference(x, p, bias=bias)[0])
    assert not np.asarray(grads[1]["selection_bias"]).any()
    # A bias equal for every expert changes nothing.
    close(moe_and_grads(x, dict(p, selection_bias=jnp.full(E, 5.0)))[0], moe_and_grads(x, p)[0])
    load = jnp.asarray([0.4, 0.1, 0.25, 0.25])
    close(update_selection_bias(bias, load, 0.01), bias + jnp.asarray([-0.01, 0.01, 0, 0]))


def test_sigmoid_scores_without_renormalization():
    x, p = jnp.asarray(tokens()), make_params(seed=5)
    w, e, scores = dt.nn.route(x @ p["router"], 3, score="sigmoid", renormalize=False)
    np.testing.assert_allclose(scores, jax.nn.sigmoid(x @ p["router"]), rtol=1e-6)
    np.testing.assert_allclose(w, jnp.take_along_axis(scores, e, 1), rtol=1e-6)
    assert (np.diff(np.asarray(w), axis=1) <= 0).all()  # best first


# ------------------------------------------------------------------ the expert axis


def _through(strategy, x, p, **kw):
    """moe_and_grads as each replica of `strategy` runs it on its rows of x."""
    placed = strategy.put_replicated(p)
    rows = strategy.distribute_batch({"x": x})

    def step(p, batch):
        weights, experts, _ = dt.nn.route(batch["x"] @ p["router"], K)
        y, stats, grads = moe_and_grads(batch["x"], p, **kw)
        return y, stats, grads, weights, experts

    out = strategy.run(step, args=(placed, rows))
    return [jax.device_get(r) for r in strategy.experimental_local_results(out)]


@pytest.mark.split_ends  # a slow test: see tests/conftest.py
@pytest.mark.parametrize(
    "replicas, inner, kw",
    [
        (1, {"expert": 4}, {}),
        (2, {"expert": 2, "fsdp": 2}, {}),
        (1, {"expert": 4}, {"capacity_factor": 0.5}),
        (1, {"expert": 2, "tensor": 2}, {}),
        (1, {"context": 2, "expert": 2}, {"exchange": "ragged"}),
    ],
    ids=[
        "1x{expert:4}",
        "2x{expert:2,fsdp:2}",
        "1x{expert:4}+capacity",
        "1x{expert:2,tensor:2}",
        "1x{context:2,expert:2}+ragged",
    ],
)
def test_split_over_the_expert_axis_equals_one_device(devices, replicas, inner, kw):
    n = replicas * math.prod(inner.values())
    strategy = dt.MirroredStrategy(devices[:n], devices_per_replica=inner, layout=EXPERT_RULES)
    x, p = tokens(32), make_params(seed=2, gate=True, shared=True)
    results = _through(strategy, x, p, **kw)
    assert len(results) == replicas
    for i, (y, stats, grads, weights, experts) in enumerate(results):
        part = jnp.asarray(x[i * 32 // replicas : (i + 1) * 32 // replicas])
        want_w, want_e, _ = dt.nn.route(part @ p["router"], K)
        np.testing.assert_array_equal(experts, want_e)  # identical routing first
        close(weights, want_w, 1e-6)
        want_y, want_stats, want_grads = jax.jit(lambda x, p: moe_and_grads(x, p, **kw))(part, p)
        close(y, want_y)
        close(stats, want_stats)  # over the replica's tokens
        close(grads, want_grads)
        if "capacity_factor" in kw:
            assert float(stats["dropped_fraction"]) > 0


def _all_to_all_rows(hlo):
    """``(collectives, rows)``: the all-to-alls of the compiled program and the rows of
    each one's float32 (token) operands, summed over its per-device parts (XLA:CPU
    writes an all-to-all of ``X`` blocks as ``X`` operands ``[1, rows / X, D]``)."""
    ops = [line.split(" all-to-all(")[0] for line in hlo.splitlines() if " all-to-all(" in line]
    rows = [
        sum(
            math.prod(int(n) for n in dims.split(",")[:-1])
            for dims in re.findall(r"f32\[([\d,]+)\]", op)
        )
        for op in ops
        if "f32[" in op
    ]
    return len(ops), rows


@pytest.mark.parametrize(
    "inner, kw, collectives, rows",
    [
        # dropless: X x T_d k rows, T_d = 32 tokens / 4 devices (over both axes), k = 2;
        # the expert ids travel beside them.
        ({"fsdp": 2, "expert": 2}, {}, 3, 2 * (32 // 4) * K),
        # a per-device capacity: E x ceil(c T_d k / E) rows, here 4 x ceil(0.5 x 8 x 2 / 4).
        ({"fsdp": 2, "expert": 2}, {"capacity_factor": 0.5, "capacity_group": "device"}, 2, 4 * 2),
        ({"context": 2, "expert": 2}, {"capacity_factor": 1.0, "capacity_group": "device"}, 2, 16),
    ],
    ids=["dropless", "device-capacity", "context-device-capacity"],
)
def test_the_exchange_buffers_have_the_rows_of_the_formula(devices, inner, kw, collectives, rows):
    strategy = dt.MirroredStrategy(devices[:4], devices_per_replica=inner, layout=EXPERT_RULES)
    placed = strategy.put_replicated(make_params())
    assert placed["w_in"].addressable_shards[0].data.shape == (E // 2, D, F)
    args = (placed, strategy.distribute_batch({"x": tokens(32)}))
    hlo = strategy.compile(lambda p, b: dt.nn.moe(b["x"], p, top_k=K, **kw)[0], args).as_text()
    assert _all_to_all_rows(hlo) == (collectives, [rows] * 2)  # tokens out, results back
    assert "ragged-all-to-all(" not in hlo  # XLA:CPU: the padded exchange
    one = dt.MirroredStrategy(devices[:4])
    args = (one.put_replicated(make_params()), one.distribute_batch({"x": tokens(32)}))
    assert (
        "all-to-all"
        not in one.compile(lambda p, b: dt.nn.moe(b["x"], p, top_k=K)[0], args).as_text()
    )


def test_a_device_capacity_drops_each_devices_later_choices(devices):
    """GShard's groups: each of the 4 devices' 8 tokens (in the call's order) gives each
    expert at most ceil(0.5 x 8 x 2 / 4) = 2 choices; values, gradients and the dropped
    share equal the per-token loop run group by group."""
    strategy = dt.MirroredStrategy(
        devices[:4], devices_per_replica={"fsdp": 2, "expert": 2}, layout=EXPERT_RULES
    )
    x, p = tokens(32, seed=3), make_params(seed=6, gate=True, shared=True)
    kw = {"capacity_factor": 0.5, "capacity_group": "device"}
    ((y, stats, grads, _, _),) = _through(strategy, x, p, **kw)
    want, dropped, _, _ = reference(jnp.asarray(x), p, capacity=2, groups=4)
    assert dropped > 0
    close(stats["dropped_fraction"], dropped / (32 * K))
    close(y, want)
    close(grads, reference_grads(jnp.asarray(x), p, capacity=2, groups=4))
    # Without an expert axis the group is the call: one device, capacity over all 32.
    y1, stats1, _ = moe_and_grads(jnp.asarray(x), p, **kw)
    close(y1, reference(jnp.asarray(x), p, capacity=math.ceil(0.5 * 32 * K / E))[0])


def test_the_ragged_exchange_is_chosen_where_the_platform_has_it(devices):
    """The program lowered for a GPU has XLA's ragged all-to-all (values and gradients);
    for the CPU the padded exchange. Its sizes and offsets: a worked example."""
    mesh = jax.make_mesh((2,), ("expert",), (AxisType.Auto,), devices=devices[:2])
    args = (jnp.asarray(tokens(16)), make_params())
    with jax.set_mesh(mesh):
        traced = jax.jit(moe_and_grads).trace(*args)
        gpu = traced.lower(lowering_platforms=("cuda",)).as_text()
        cpu = traced.lower(lowering_platforms=("cpu",)).as_text()
    assert gpu.count("ragged_all_to_all") == 4  # tokens out and back, and their transposes
    assert "ragged_all_to_all" not in cpu and "all_to_all" in cpu
    counts = jnp.array([[1, 2, 3, 0], [0, 1, 1, 4]])  # [sender, expert]; experts 0-1 on 0
    plan = [ragged_plan(counts, jnp.int32(me)) for me in (0, 1)]
    want = [
        {"send_sizes": [3, 3], "input_offsets": [0, 3], "output_offsets": [0, 0],
         "recv_sizes": [3, 1], "recv_offsets": [0, 3], "back_offsets": [0, 0],
         "here": [[1, 2], [0, 1]]},
        {"send_sizes": [1, 5], "input_offsets": [0, 1], "output_offsets": [3, 3],
         "recv_sizes": [3, 5], "recv_offsets": [0, 3], "back_offsets": [3, 1],
         "here": [[3, 0], [1, 4]]},
    ]  # fmt: skip
    for got, expected in zip(plan, want, strict=True):
        assert {k: np.asarray(v).tolist() for k, v in got.items()} == expected


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"top_k": 5}, "top_k must be an int from 1 to the number of experts (4)"),
        ({"top_k": 0}, "top_k must be an int from 1"),
        ({"top_k": 2, "capacity_factor": 0.0}, "capacity_factor must be a number > 0"),
        ({"top_k": 2, "score": "relu"}, "score must be 'softmax' or 'sigmoid'"),
        ({"top_k": 2, "capacity_group": "expert"}, "capacity_group must be one of"),
        ({"top_k": 2, "exchange": "fast"}, "exchange must be one of"),
    ],
)
def test_bad_arguments(kw, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        dt.nn.moe(jnp.asarray(tokens()), make_params(), **kw)


def test_weights_that_disagree():
    p = make_params()
    p["w_out"] = p["w_out"][:, :, :3]
    with pytest.raises(ValueError, match=r"expected router \[D, E\], w_in and w_gate"):
        dt.nn.moe(jnp.asarray(tokens()), p, top_k=2)
    with pytest.raises(ValueError, match=r"selection_bias'\] must be \[E\] = \[4\]"):
        dt.nn.moe(jnp.asarray(tokens()), dict(make_params(), selection_bias=jnp.zeros(3)), top_k=2)
    with pytest.raises(ValueError, match="missing \\['w_out'\\]"):
        dt.nn.moe(jnp.asarray(tokens()), {"router": p["router"], "w_in": p["w_in"]}, top_k=2)


def test_experts_the_axis_does_not_divide(devices):
    strategy = dt.MirroredStrategy(devices[:4], devices_per_replica={"expert": 4})
    p = strategy.put_replicated(make_params(experts=6))
    with pytest.raises(ValueError, match="they must divide the experts \\(6\\)"):
        strategy.run(
            lambda p, b: dt.nn.moe(b["x"], p, top_k=2)[0],
            args=(p, strategy.distribute_batch({"x": tokens(32)})),
        )
