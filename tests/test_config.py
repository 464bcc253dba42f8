"""Run configs: shipped files load and build; bad files and overrides get clear errors."""

import glob
import math
import os

import jax
import pytest
import yaml

import distrain as dt
from distrain._src.train.config import apply_overrides, config_from_dict
from distrain._src.train.model_fn import split_model as _split_model
from distrain._src.train.strategy_from_config import _optimizer, build_strategy
from distrain.config import (
    ConfigError,
    OptimizerConfig,
    RunConfig,
    build_optimizer,
    load_config,
    resolve_callable,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))


def test_the_three_seed_configs_are_shipped():
    names = {os.path.basename(p) for p in CONFIGS}
    assert {"quickstart.yaml", "mnist_mlp.yaml", "mnist_cnn.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_every_shipped_config_loads_and_builds(path, devices):
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)
    # Everything it names resolves, and the model and optimizer build (no data download;
    # abstractly, as distrain plan does: lm_7b's 6.6B parameters would not fit here).
    fn = resolve_callable(cfg.model.fn, "model.fn")
    if cfg.model.pretrained is not None:  # made by the commands at the config's top
        assert fn is dt.models.from_pretrained
    else:
        params = jax.eval_shape(
            lambda k: _split_model(fn(key=k, **cfg.model.kwargs))[1], jax.random.key(0)
        )
        assert jax.tree.leaves(params)
    resolve_callable(cfg.data.fn, "data.fn")
    resolve_callable(cfg.train.train_step, "train.train_step")
    if cfg.train.eval_step:
        resolve_callable(cfg.train.eval_step, "train.eval_step")
    build_optimizer(cfg.optimizer, run_steps=cfg.train.steps)
    dpr = cfg.strategy.devices_per_replica
    if isinstance(dpr, dict) and math.prod(dpr.values()) > len(devices):  # a cluster's mesh
        from types import SimpleNamespace

        from distrain._src.strategy.replica_mesh import resolve_inner_axes

        cluster = [SimpleNamespace(process_index=0)] * math.prod(dpr.values())
        assert resolve_inner_axes(dpr, cluster, "replica") == dpr
    else:
        assert build_strategy(cfg.strategy).num_replicas_in_sync >= 1


def test_mnist_configs_match_the_seed_models():
    mlp = load_config(os.path.join(ROOT, "configs", "mnist_mlp.yaml"))
    assert mlp.model.kwargs["hidden"] == [256, 256] and mlp.optimizer.name == "adam"
    cnn = load_config(os.path.join(ROOT, "configs", "mnist_cnn.yaml"))
    params = _split_model(
        resolve_callable(cnn.model.fn, "model.fn")(key=jax.random.key(0), **cnn.model.kwargs)
    )[1]
    shapes = {k: v["kernel"].shape for k, v in params.items()}
    assert shapes == {
        "conv1": (3, 3, 1, 32),
        "conv2": (3, 3, 32, 64),
        "dense": (11 * 11 * 64, 64),
        "out": (64, 10),
    }


# The three sections a config must have (they name the user's code).
REQUIRED = {"model": {"fn": "m:f"}, "data": {"fn": "d:f"}, "train": {"train_step": "s:f"}}


def _with(**sections):
    """REQUIRED plus ``sections`` (merged into the required ones)."""
    out = {k: dict(v) for k, v in REQUIRED.items()}
    for name, value in sections.items():
        out[name] = {**out[name], **value} if name in out and isinstance(value, dict) else value
    return out


def _write(p, **sections):
    p.write_text(yaml.safe_dump(_with(**sections)))
    return p


def test_unknown_key_suggests_the_closest(tmp_path):
    p = _write(tmp_path / "c.yaml", train={"epoch": 3})
    with pytest.raises(ConfigError, match=r"Unknown config key 'train.epoch'.*'train.epochs'"):
        load_config(p)
    _write(p, optimiser={"name": "sgd"})
    with pytest.raises(ConfigError, match=r"Did you mean 'optimizer'\?"):
        load_config(p)


def test_wrong_type_names_field_and_value(tmp_path):
    p = _write(tmp_path / "c.yaml", train={"epochs": "ten"})
    with pytest.raises(ConfigError, match=r"'train.epochs' must be int \| null. Received: 'ten'"):
        load_config(p)
    p.write_text(yaml.safe_dump(_with()) + "optimizer:\n  learning_rate: 1e-3\n")  # a string
    with pytest.raises(ConfigError, match=r"'optimizer.learning_rate' must be float.*1.0e-3"):
        load_config(p)
    _write(p, data={"shuffle": 1})
    with pytest.raises(ConfigError, match=r"'data.shuffle' must be bool. Received: 1 \(int\)"):
        load_config(p)
    _write(p, strategy={"name": "mirored"})
    with pytest.raises(ConfigError, match=r"'strategy.name' must be one of.*'mirrored'\?"):
        load_config(p)
    _write(p, train=3)
    with pytest.raises(ConfigError, match=r"section 'train' must be a mapping.*Received: 3"):
        load_config(p)
    _write(p, strategy={"devices": ["cpu:0", 1]})
    with pytest.raises(ConfigError, match=r"'strategy.devices\[1\]' must be str. Received: 1"):
        load_config(p)
    _write(p, strategy={"shard_state": "proces"})
    with pytest.raises(ConfigError, match=r"bool \| 'process'. Received: 'proces'.*'process'\?"):
        load_config(p)


def test_value_checks():
    with pytest.raises(ConfigError, match=r"'train.epochs' must be >= 1 or null. Received: 0\."):
        config_from_dict(_with(train={"epochs": 0}))
    with pytest.raises(ConfigError, match="both null"):
        config_from_dict(_with(train={"epochs": None, "steps": None}))
    with pytest.raises(ConfigError, match=r"'checkpoint.save_freq' must be 'epoch' \| int"):
        config_from_dict(_with(checkpoint={"save_freq": "sometimes"}))
    with pytest.raises(ConfigError, match=r"'checkpoint.backup_freq' must be >= 1. Received: 0"):
        config_from_dict(_with(checkpoint={"backup_freq": 0}))
    with pytest.raises(ConfigError, match=r"A config must be a mapping.*Received: \[1\]"):
        config_from_dict([1])
    cfg = config_from_dict(_with(optimizer={"learning_rate": 1}, logging=None))
    assert cfg.optimizer.learning_rate == 1.0 and isinstance(cfg.optimizer.learning_rate, float)
    assert cfg.logging.progress_bar  # an empty section means its defaults


def test_model_data_and_train_step_are_required_and_all_errors_are_reported():
    with pytest.raises(ConfigError) as e:
        config_from_dict({"train": {"epochs": 0, "train_step": "s:f"}, "data": {"fn": 1}})
    msg = str(e.value)
    assert "Config section 'model' is required; it needs fn." in msg
    assert "'data.fn' must be str. Received: 1 (int)." in msg
    assert "'train.epochs' must be >= 1" in msg
    with pytest.raises(ConfigError) as e:
        config_from_dict({1: "x", **_with(train={2: 3})})  # YAML reads `1:` as a number
    assert "Unknown config key '1'." in str(e.value)
    assert "Unknown config key 'train.2'. Valid keys in 'train': train_step," in str(e.value)
    with pytest.raises(ConfigError, match=r"'train.train_step' is required: an import path"):
        config_from_dict({**REQUIRED, "train": {}})


def test_missing_file_lists_nearby_configs(tmp_path):
    (tmp_path / "good.yaml").write_text("{}\n")
    with pytest.raises(ConfigError, match=r"does not exist.*good.yaml"):
        load_config(tmp_path / "quikstart.yaml")


def test_unparsable_and_non_mapping_files(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("train:\n  epochs: [1, 2\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(p)
    p.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping of keys to values at the top level"):
        load_config(p)


def test_overrides_are_typed_and_checked(tmp_path):
    p = _write(tmp_path / "c.yaml")
    cfg = load_config(
        p, ["train.epochs=5", "model.kwargs.hidden=[8, 8]", "optimizer.learning_rate=0.01"]
    )
    assert cfg.train.epochs == 5 and cfg.model.kwargs["hidden"] == [8, 8]
    assert cfg.optimizer.learning_rate == 0.01
    with pytest.raises(ConfigError, match=r"'train.epocs'.*'train.epochs'"):
        load_config(p, ["train.epocs=5"])
    with pytest.raises(ConfigError, match="must look like key=value"):
        load_config(p, ["train.epochs"])
    with pytest.raises(ConfigError, match="'train.epochs' must be int"):
        load_config(p, ["train.epochs=lots"])
    with pytest.raises(ConfigError, match="not a section"):
        apply_overrides({"train": 3}, ["train.epochs=1"])


def test_import_paths_resolve_or_explain():
    assert callable(resolve_callable("examples.classification:mlp", "model.fn"))
    assert callable(resolve_callable("examples.classification.mlp", "model.fn"))
    with pytest.raises(ConfigError, match=r"'model.fn'.*no attribute 'mpl'.*classification:mlp"):
        resolve_callable("examples.classification:mpl", "model.fn")
    with pytest.raises(ConfigError, match=r"cannot import module 'no_such_pkg"):
        resolve_callable("no_such_pkg.models:net", "model.fn")
    with pytest.raises(ConfigError, match="import path"):
        resolve_callable("mlp", "model.fn")
    with pytest.raises(ConfigError, match="not callable"):
        resolve_callable("examples.classification:__doc__", "model.fn")


def test_unknown_optimizer_suggests():
    with pytest.raises(ConfigError, match=r"no optimizer 'adamm'.*'adam"):
        _optimizer("adamm", 1e-3, {})


@pytest.mark.parametrize("shape", [(3, 26, 26, 4), (2, 7, 9, 3)])
@pytest.mark.split_ends  # a slow test: see tests/conftest.py
def test_example_max_pool_matches_nnx_max_pool_values_and_gradients(shape):
    import jax.numpy as jnp
    from flax import nnx

    from examples.classification import max_pool_2x2

    x = jax.random.normal(jax.random.key(0), shape)
    ct = jax.random.normal(jax.random.key(1), (shape[0], shape[1] // 2, shape[2] // 2, shape[3]))

    def reference(x):
        return nnx.max_pool(x, window_shape=(2, 2), strides=(2, 2))

    # Through a ReLU, as in the CNN: its zeros tie inside a window.
    out, vjp = jax.vjp(lambda x: max_pool_2x2(jax.nn.relu(x)), x)
    ref_out, ref_vjp = jax.vjp(lambda x: reference(jax.nn.relu(x)), x)
    assert jnp.array_equal(out, ref_out)
    assert jnp.array_equal(vjp(ct)[0], ref_vjp(ct)[0])


def test_the_configs_in_the_docs_are_valid_and_the_reference_lists_every_field():
    import re

    with open(os.path.join(ROOT, "docs", "getting_started.md")) as f:
        text = f.read()
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", text, re.S)]
    (recipe_optimizer,) = [b for b in blocks if set(b) == {"optimizer"}]
    reference, custom = [b for b in blocks if b is not recipe_optimizer]
    for data in (reference, custom):
        config_from_dict(data)
    # The optimizer section shown is configs/shakespeare_char.yaml's.
    recipe = load_config(os.path.join(ROOT, "configs", "shakespeare_char.yaml"))
    assert OptimizerConfig.model_validate(recipe_optimizer["optimizer"]) == recipe.optimizer
    # The reference is configs/quickstart.yaml, annotated, and names every field.
    quickstart = load_config(os.path.join(ROOT, "configs", "quickstart.yaml"))
    assert config_from_dict(reference) == quickstart
    full = config_from_dict(reference).model_dump()
    missing = {
        f"{section}.{name}"
        for section, fields in full.items()
        if isinstance(fields, dict)
        for name in set(fields) - set(reference[section])
    }
    assert not missing, f"docs/getting_started.md's reference config lacks {sorted(missing)}"


def test_tracker_sections_are_checked(tmp_path):
    cfg = load_config(
        _write(tmp_path / "c.yaml"),
        ["logging.wandb={project: p, mode: offline, tags: [a]}", "logging.mlflow={}"],
    )
    assert cfg.logging.wandb.project == "p" and cfg.logging.wandb.tags == ["a"]
    assert cfg.logging.mlflow.experiment == "distrain" and cfg.logging.mlflow.tracking_uri is None
    assert load_config(_write(tmp_path / "d.yaml")).logging.wandb is None
    with pytest.raises(ConfigError, match=r"logging\.wandb\.project. is required: the name of"):
        load_config(_write(tmp_path / "e.yaml", logging={"wandb": {"mode": "offline"}}))
    with pytest.raises(ConfigError, match=r"logging\.wandb\.mode.*online"):
        load_config(_write(tmp_path / "f.yaml", logging={"wandb": {"project": "p", "mode": "x"}}))
    with pytest.raises(ConfigError, match=r"logging\.mlflow\.experimnt.*experiment"):
        load_config(_write(tmp_path / "g.yaml", logging={"mlflow": {"experimnt": "e"}}))


def test_default_strategy_inside_a_parameter_server_scope_is_a_config_error():
    # dt.get_strategy() there returns the ParameterServerStrategy (not a dt.Strategy),
    # which the Trainer cannot run; strategy.name=default says so instead of failing later.
    import distrain as dt

    cfg = load_config(os.path.join(ROOT, "configs", "quickstart.yaml"), ["strategy.name=default"])
    ps = dt.experimental.ParameterServerStrategy(num_workers=1)
    try:
        with (
            ps.scope(),
            pytest.raises(
                ConfigError,
                match=r"strategy.name=default trains on the current strategy.*"
                r"ParameterServerStrategy\(.*name a strategy: mirrored",
            ),
        ):
            build_strategy(cfg.strategy)
    finally:
        ps.shutdown()
    assert isinstance(build_strategy(cfg.strategy), dt.Strategy)  # outside: the default
