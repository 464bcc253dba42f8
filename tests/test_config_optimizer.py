"""optimizer.schedule / clip_global_norm / weight_decay_mask: what optax gets, what the
loggers write as ``learning_rate``, every error; and nanoGPT's recipe config runs."""

import csv
import hashlib
import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import distrain as dt
from distrain._src.train.config import config_from_dict, config_to_dict
from distrain._src.train.optimizer import LearningRateLogger, build_optimizer, schedule_count
from distrain.config import ConfigError, OptimizerConfig, load_config, run_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
RECIPE = ROOT / "configs" / "shakespeare_char.yaml"
REQUIRED = {"model": {"fn": "m:f"}, "data": {"fn": "d:f"}, "train": {"train_step": "s:f"}}
WARMUP_COSINE = {
    "name": "warmup_cosine_decay_schedule",
    "kwargs": {
        "init_value": 0.0,
        "peak_value": 1e-3,
        "warmup_steps": 3,
        "decay_steps": 10,
        "end_value": 1e-4,
    },
}


def _rank_at_least_2(params):
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def _params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"w": jax.random.normal(k1, (3, 4)), "b": jax.random.normal(k2, (4,))}


def _updates(tx, steps=5):
    """The updates of ``steps`` steps with large gradients (global norm ~10: clipped)."""
    params = _params()
    state = tx.init(params)
    update = jax.jit(tx.update)  # one program, not one per eager op
    out = []
    for i in range(steps):
        grads = jax.tree.map(
            lambda p, i=i: 3.0 * jax.random.normal(jax.random.key(10 + i), p.shape), params
        )
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
        out.append(updates)
    return out


def _assert_same_updates(a, b):
    for ua, ub in zip(a, b, strict=True):
        for x, y in zip(jax.tree.leaves(ua), jax.tree.leaves(ub), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ------------------------------------------------------------------ what optax gets


def test_the_recipe_section_is_the_hand_built_optax_chain():
    cfg = OptimizerConfig.model_validate(
        {
            "name": "adamw",
            "kwargs": {"b1": 0.9, "b2": 0.99, "weight_decay": 0.1},
            "schedule": WARMUP_COSINE,
            "clip_global_norm": 1.0,
            "weight_decay_mask": "ndim >= 2",
        }
    )
    tx, schedule = build_optimizer(cfg, run_steps=10)
    by_hand = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(
            optax.warmup_cosine_decay_schedule(0.0, 1e-3, 3, 10, 1e-4),
            b1=0.9,
            b2=0.99,
            weight_decay=0.1,
            mask=_rank_at_least_2,
        ),
    )
    _assert_same_updates(_updates(tx), _updates(by_hand))
    assert [float(schedule(i)) for i in (0, 3, 10)] == pytest.approx([0.0, 1e-3, 1e-4])


@pytest.mark.parametrize(
    "section, by_hand",
    [
        # each field alone, against the optax it must become (each differs from without it)
        (
            {"name": "sgd", "schedule": {"name": "linear_schedule", "kwargs": {
                "init_value": 0.1, "end_value": 0.0, "transition_steps": 4}}},
            optax.sgd(optax.linear_schedule(0.1, 0.0, 4)),
        ),
        ({"name": "adam", "clip_global_norm": 0.5},
         optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-3))),
        ({"name": "adamw", "kwargs": {"weight_decay": 0.5}, "weight_decay_mask": "ndim >= 2"},
         optax.adamw(1e-3, weight_decay=0.5, mask=_rank_at_least_2)),
        # adafactor calls its mask weight_decay_mask
        ({"name": "adafactor", "learning_rate": 0.01, "kwargs": {"weight_decay_rate": 0.5},
          "weight_decay_mask": "ndim >= 2"},
         optax.adafactor(0.01, weight_decay_rate=0.5, weight_decay_mask=_rank_at_least_2)),
    ],
    ids=["schedule", "clip", "mask", "adafactor-mask"],
)  # fmt: skip
def test_each_field_maps_onto_optax(section, by_hand):
    tx, _ = build_optimizer(OptimizerConfig.model_validate(section), run_steps=5)
    _assert_same_updates(_updates(tx), _updates(by_hand))
    without = {k: v for k, v in section.items() if k in ("name", "kwargs", "learning_rate")}
    with pytest.raises(AssertionError):  # the field changes the updates
        _assert_same_updates(_updates(tx), _updates(build_optimizer(
            OptimizerConfig.model_validate(without))[0]))  # fmt: skip


def test_the_mask_keeps_vectors_from_decaying():
    cfg = OptimizerConfig.model_validate(
        {"name": "adamw", "kwargs": {"weight_decay": 0.5}, "weight_decay_mask": "ndim >= 2"}
    )
    tx, schedule = build_optimizer(cfg)
    assert schedule is None
    params = _params()
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zeros, tx.init(params), params)  # only weight decay moves them
    assert not np.any(np.asarray(updates["b"]))
    np.testing.assert_allclose(updates["w"], -1e-3 * 0.5 * params["w"], rtol=1e-6)


def test_a_config_with_a_schedule_round_trips():
    cfg = config_from_dict({**REQUIRED, "optimizer": {"name": "adamw", "schedule": WARMUP_COSINE}})
    assert config_from_dict(config_to_dict(cfg)) == cfg  # learning_rate stays its default


# ------------------------------------------------------------------ the logged value


@pytest.mark.parametrize(
    "strategy, steps_per_execution, log_every", [("one_device", 1, 3), ("mirrored", 2, 4)]
)
@pytest.mark.split_ends  # a slow test: see tests/conftest.py
def test_logged_learning_rate_is_the_schedule_at_the_logged_steps(
    devices, tmp_path, strategy, steps_per_execution, log_every
):
    overrides = [
        f"strategy.name={strategy}",  # mirrored: the count is read from 8 replicated copies
        "train.epochs=null",
        "train.steps=12",
        f"train.steps_per_execution={steps_per_execution}",
        f"train.log_every={log_every}",
        "data.validation_split=null",
        "optimizer.schedule={name: linear_schedule, kwargs: {init_value: 0.01, "
        "end_value: 0.001, transition_steps: 12}}",
        f"logging.dir={tmp_path}",
        "logging.jsonl=true",
        "logging.csv=true",
        "logging.progress_bar=false",
    ]
    seen = []
    probe = dt.callbacks.LambdaCallback(on_train_batch_end=lambda i: seen.append((i.step, i.logs)))
    result = run_config(
        load_config(QUICKSTART, overrides), callbacks=[probe], progress_bar=False, print_fn=None
    )
    schedule = optax.linear_schedule(0.01, 0.001, 12)
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = {e["step"]: e["learning_rate"] for e in steps if e["event"] == "step"}
    assert sorted(logged) == list(range(log_every, 13, log_every))
    for step, value in logged.items():
        # The rate the step-th update used; not the window's mean (the rate changes every
        # step, so a mean over the window would differ).
        assert value == float(schedule(step - 1)), step
        window = np.mean([float(schedule(i)) for i in range(step - log_every, step)])
        assert not math.isclose(value, window)
    (epoch,) = [e for e in steps if e["event"] == "epoch"]
    assert epoch["step"] == 12 and epoch["learning_rate"] == float(schedule(11))
    (row,) = list(csv.DictReader((tmp_path / "epochs.csv").open()))
    assert float(row["learning_rate"]) == float(schedule(11))
    # The callbacks after the configured ones see it too; the optimizer really counted.
    assert [s for s, logs in seen if logs] == sorted(logged)
    assert all(logs["learning_rate"] == logged[s] for s, logs in seen if logs)
    assert schedule_count(result.state.opt_state) == 12


def test_logged_rate_before_any_update_is_the_first_steps():
    tx = optax.sgd(optax.linear_schedule(0.5, 0.0, 10))
    opt_state = tx.init(_params())
    logger = LearningRateLogger(optax.linear_schedule(0.5, 0.0, 10), state_fn=lambda s: s)
    assert schedule_count(opt_state) == 0 and logger.value(opt_state) == 0.5
    _, opt_state = tx.update(_params(), opt_state, _params())
    _, opt_state = tx.update(_params(), opt_state, _params())
    assert logger.value(opt_state) == float(optax.linear_schedule(0.5, 0.0, 10)(1))
    with pytest.raises(ValueError, match=r"exactly one optax.ScaleByScheduleState.*Received 0"):
        schedule_count(optax.adam(1e-3).init(_params()))


# ------------------------------------------------------------------------- errors


def _optimizer_section(**optimizer):
    return {**REQUIRED, "optimizer": optimizer}


def _schedule(name="warmup_cosine_decay_schedule", **kwargs):
    return {"name": name, "kwargs": {**WARMUP_COSINE["kwargs"], **kwargs}}


@pytest.mark.parametrize(
    "data, match",
    [
        (_optimizer_section(schedule=_schedule(warmup_steps=-1)),
         r"'optimizer.schedule.kwargs.warmup_steps' must be an int >= 0 .*Received: -1\."),
        (_optimizer_section(schedule=_schedule(decay_steps=2.5)),
         r"'optimizer.schedule.kwargs.decay_steps' must be an int >= 0 .*Received: 2.5\."),
        ({**_optimizer_section(schedule=_schedule(warmup_steps=50)),
          "train": {"train_step": "s:f", "steps": 20}},
         r"'optimizer.schedule.kwargs.warmup_steps' \(50\) is longer than the run \(train.steps "
         r"is 20\).*Use warmup_steps <= 20 or a longer run\."),
        (_optimizer_section(learning_rate=0.003, schedule=_schedule()),
         r"'optimizer.learning_rate' and 'optimizer.schedule' both set the learning rate\. "
         r"Received: optimizer.learning_rate=0.003 and optimizer.schedule.name="
         r"'warmup_cosine_decay_schedule'\. Remove learning_rate"),
        (_optimizer_section(schedule={"kwargs": {}}),
         r"Config field 'optimizer.schedule.name' is required: an optax schedule"),
        (_optimizer_section(schedule="cosine"),
         r"Config section 'optimizer.schedule' must be a mapping"),
        (_optimizer_section(clip_global_norm=0.0),
         r"'optimizer.clip_global_norm' must be > 0.0 or null\. Received: 0.0\."),
        (_optimizer_section(clip_global_norm=-1),
         r"'optimizer.clip_global_norm' must be > 0.0 or null\. Received: -1\."),
        (_optimizer_section(clip_global_norm=float("inf")),
         r"'optimizer.clip_global_norm' must be a finite number"),
        (_optimizer_section(weight_decay_mask="ndim>=2"),
         r"'optimizer.weight_decay_mask' must be 'ndim >= 2' \| null\. Received: 'ndim>=2' "
         r"\(str\)\. Did you mean 'ndim >= 2'\?"),
        (_optimizer_section(weight_decay_mask="all"),
         r"'optimizer.weight_decay_mask' must be 'ndim >= 2' \| null\. Received: 'all'"),
    ],
    ids=["negative-warmup", "fractional-steps", "warmup-longer-than-run", "lr-and-schedule",
         "schedule-without-name", "schedule-not-a-mapping", "clip-zero", "clip-negative",
         "clip-inf", "mask-misspelt", "mask-unknown"],
)  # fmt: skip
def test_bad_sections_are_config_errors_naming_the_field(data, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict(data)


@pytest.mark.parametrize(
    "section, match",
    [
        ({"name": "adamw", "schedule": {"name": "warmup_cosine"}},
         r"'optimizer.schedule.name': optax has no schedule 'warmup_cosine'\. Did you mean "
         r"'warmup_cosine_decay_schedule'\? Schedules: constant_schedule, .*linear_schedule"),
        ({"name": "adamw", "schedule": {"name": "join_schedules"}},
         r"optax has no schedule 'join_schedules'"),
        ({"name": "adamw", "schedule": _schedule(peak_vale=1.0)},
         r"'optimizer.schedule.kwargs' does not fit optax.schedules.warmup_cosine_decay_schedule:"
         r" got an unexpected keyword argument 'peak_vale'\. Its signature: "
         r"warmup_cosine_decay_schedule\(init_value, peak_value, warmup_steps, decay_steps, "
         r"end_value=0.0, exponent=1.0\)\."),
        ({"name": "adamw", "schedule": {"name": "cosine_decay_schedule", "kwargs": {
            "decay_steps": 10}}},
         r"does not fit optax.schedules.cosine_decay_schedule: missing a required argument: "
         r"'init_value'"),
        ({"name": "adamw", "schedule": _schedule(peak_value="1e-3")},
         r"'optimizer.schedule.kwargs.peak_value' must be a number\. Received: '1e-3' \(str\): "
         r"YAML reads 1e-3 as a string; write 1.0e-3\."),
        ({"name": "adamw", "schedule": {"name": "cosine_decay_schedule", "kwargs": {
            "init_value": 1.0, "decay_steps": 0}}},
         r"'optimizer.schedule': optax.schedules.cosine_decay_schedule\(\*\*kwargs\) failed: "
         r"The cosine_decay_schedule requires positive decay_steps, got decay_steps=0\. "
         r"Received: kwargs="),
        ({"name": "adamw", "schedule": _schedule(peak_value=-1e-3)},
         r"'optimizer.schedule' must give learning rates that are finite and >= 0\. Received: "
         r"-0.000333333 at step 1 from warmup_cosine_decay_schedule\(init_value=0.0, "),
        ({"name": "adamw", "schedule": _schedule(peak_value=0.0, end_value=0.0)},
         r"is 0 at every one of the run's 10 steps, so training would change nothing"),
        ({"name": "adam", "weight_decay_mask": "ndim >= 2"},
         r"'optimizer.weight_decay_mask' needs an optimizer with weight decay and a mask\. "
         r"Received: optimizer.name='adam', whose optax function takes no mask or "
         r"weight_decay_mask\. Optimizers that do: .*adamw.*lion.*; or set "
         r"optimizer.weight_decay_mask=null\."),
        ({"name": "adamw", "weight_decay_mask": "ndim >= 2", "kwargs": {"mask": None}},
         r"'optimizer.weight_decay_mask' and 'optimizer.kwargs.mask' both set the weight-decay "
         r"mask\. Keep one of them\."),
        ({"name": "polyak_sgd", "schedule": {"name": "constant_schedule", "kwargs": {
            "value": 1.0}}},
         r"'optimizer.schedule': optax.polyak_sgd keeps 0 schedule step counts"),
        ({"name": "adamm"}, r"'optimizer.name': optax has no optimizer 'adamm'\. Did you mean"),
    ],
    ids=["unknown-schedule", "not-nameable", "bad-kwarg", "missing-kwarg", "yaml-string",
         "optax-refuses", "negative-rate", "all-zero", "mask-without-decay", "mask-twice",
         "no-schedule-count", "unknown-optimizer"],
)  # fmt: skip
def test_what_optax_refuses_is_a_config_error_naming_the_field(section, match):
    with pytest.raises(ConfigError, match=match):
        build_optimizer(OptimizerConfig.model_validate(section), run_steps=10)


def test_warmup_longer_than_a_run_of_epochs_is_found_once_the_data_is_known(devices):
    overrides = [
        "train.epochs=1",
        "optimizer.schedule={name: warmup_constant_schedule, kwargs: {init_value: 0.0, "
        "peak_value: 0.01, warmup_steps: 1000}}",
    ]
    cfg = load_config(QUICKSTART, overrides)  # the run's length is unknown here
    with pytest.raises(
        ConfigError,
        match=r"'optimizer.schedule.kwargs.warmup_steps' \(1000\) is longer than the run "
        r"\(train.epochs=1 x 22 steps per epoch\)",
    ):
        run_config(cfg, progress_bar=False, print_fn=None)


# ------------------------------------------------------------- nanoGPT's recipe


def test_the_recipe_config_is_nanogpts():
    cfg = load_config(RECIPE)
    assert cfg.strategy.name == "one_device" and cfg.train.steps == 2000
    m = cfg.model.kwargs
    assert (m["n_layers"], m["n_heads"], m["d_model"], m["seq_len"]) == (4, 4, 128, 64)
    assert cfg.data.global_batch_size == 12 and cfg.data.kwargs["whole_test"] is True
    opt = cfg.optimizer
    assert (opt.name, opt.clip_global_norm, opt.weight_decay_mask) == ("adamw", 1.0, "ndim >= 2")
    assert opt.kwargs == {"b1": 0.9, "b2": 0.99, "weight_decay": 0.1}
    assert opt.schedule is not None and opt.schedule.model_dump() == {
        "name": "warmup_cosine_decay_schedule",
        "kwargs": {"init_value": 0.0, "peak_value": 1e-3, "warmup_steps": 100,
                   "decay_steps": 2000, "end_value": 1e-4},
    }  # fmt: skip


@pytest.mark.one_end("lowest")  # a slow test: see tests/conftest.py
def test_the_recipe_trains_a_few_steps(devices, tmp_path):
    """The shipped config through examples/lm/curve.py (which is ``distrain train`` plus
    held-out evaluations), offline: a small text in place of TinyShakespeare, found in the
    cache by its checksum; a smaller model; the schedule shortened to the run."""
    from examples.lm.curve import held_out_curve, plot

    text = b"".join(
        f"CITIZEN {i}:\nBefore we proceed any further, hear me speak {i * i}.\n\n".encode()
        for i in range(300)
    )
    (tmp_path / "tinyshakespeare.txt").write_bytes(text)
    overrides = [
        f"data.kwargs.cache_dir={tmp_path}",
        f"data.kwargs.sha256={hashlib.sha256(text).hexdigest()}",
        "data.kwargs.url=http://127.0.0.1:9/unreachable",  # cached: never fetched
        "model.kwargs.n_layers=1",
        "model.kwargs.d_model=32",
        "model.kwargs.n_heads=2",
        "train.steps=4",
        "train.log_every=1",
        "optimizer.schedule.kwargs.warmup_steps=1",
        "optimizer.schedule.kwargs.decay_steps=4",
    ]
    result = held_out_curve(str(RECIPE), overrides, every=2, progress=False)
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 1, 4, 1e-4)
    assert [(r["step"], r["learning_rate"]) for r in result["train"]] == [
        (s, float(schedule(s - 1))) for s in (1, 2, 3, 4)
    ]
    held = result["held_out_loss"]
    assert list(held) == ["0", "2", "4"] and held["4"] < held["0"]
    # run_config's final evaluation of the same state: the same number, deterministically.
    assert result["final_test"]["loss"] == held["4"]
    plot(result, tmp_path / "curve.png", 1.88)
    assert (tmp_path / "curve.png").stat().st_size > 0


def test_the_held_out_rows_hold_every_target_once():
    from examples.lm.data import pack, pack_stream

    text = bytes(range(32, 127)) * 3  # 285 bytes: 284 targets, not a multiple of 16
    rows = pack_stream(text, 16)
    real = rows["segment_ids"] > 0
    assert rows["inputs"].shape == (18, 16) and real.sum() == len(text) - 1
    assert rows["targets"][real].tobytes() == text[1:]
    assert rows["inputs"][real].tobytes() == text[:-1]
    assert (rows["positions"] == np.arange(16)).all()
    assert pack([text], 16)[:, 1:].size == 17 * 16  # whole rows only: 12 targets dropped
    with pytest.raises(ValueError, match=r"at least 2 bytes\. Received 1"):
        pack_stream(b"a", 16)


def test_padded_rows_give_the_models_losses_of_whole_rows():
    """The eval step's packed format (segment ids, positions) gives the same per-token
    losses as plain rows where they overlap: the padding changes nothing else."""
    from flax import nnx

    from distrain.models import LMConfig, Transformer, make_apply_fn
    from examples.lm.train import _token_losses

    text = bytes(np.random.default_rng(0).integers(32, 127, 16 * 3 + 6, dtype=np.uint8))
    cfg = LMConfig(seq_len=16, d_model=32, n_layers=1, n_heads=2, positions="learned")
    found = {}

    def init():  # one compiled program instead of one per initializer
        found["graphdef"], params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
        return params

    params = jax.jit(init)()
    apply_fn = make_apply_fn(found["graphdef"])
    from examples.lm.data import pack, pack_stream

    losses = jax.jit(lambda p, batch: _token_losses(p, batch, apply_fn, "mask"))
    lp, w, _ = losses(params, {k: jnp.asarray(v) for k, v in pack_stream(text, 16).items()})
    lt, _, _ = losses(params, {"tokens": jnp.asarray(pack([text], 16))})
    np.testing.assert_allclose(lp[:3], lt, rtol=1e-5, atol=1e-6)
    assert w is not None and float(w.sum()) == len(text) - 1
