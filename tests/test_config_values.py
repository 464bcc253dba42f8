"""Config values that would train silently wrong are config errors; so are duplicate keys."""

import subprocess
import sys

import pytest

from distrain._src.train.config import config_from_dict
from distrain.config import ConfigError, load_config

REQUIRED = {"model": {"fn": "m:f"}, "data": {"fn": "d:f"}, "train": {"train_step": "s:f"}}


def _with(section, values):
    return {**REQUIRED, section: {**REQUIRED.get(section, {}), **values}}


@pytest.mark.parametrize(
    "section, key, value, match",
    [
        ("optimizer", "learning_rate", -0.1, r"learning_rate' must be > 0.0. Received: -0.1"),
        ("optimizer", "learning_rate", 0.0, r"'optimizer.learning_rate' must be > 0.0"),
        ("optimizer", "learning_rate", float("nan"), r"learning_rate' must be a finite.*nan"),
        ("optimizer", "learning_rate", float("inf"), r"learning_rate' must be a finite.*inf"),
        ("data", "global_batch_size", 0, r"'data.global_batch_size' must be >= 1. Received: 0"),
        ("data", "global_batch_size", -8, r"'data.global_batch_size' must be >= 1. Received: -8"),
        ("data", "eval_batch_size", 0, r"'data.eval_batch_size' must be >= 1 or null"),
        ("checkpoint", "max_to_keep", 0, r"'checkpoint.max_to_keep' must be >= 1"),
        ("train", "grad_accum_steps", 0, r"'train.grad_accum_steps' must be >= 1. Received: 0"),
        ("train", "policy", "bfloat16", r"'train.policy' must be one of.*'mixed_bfloat16'"),
    ],
)
def test_bad_values_are_config_errors(section, key, value, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict(_with(section, {key: value}))


def test_negative_seed_is_a_config_error():
    with pytest.raises(ConfigError, match=r"'seed' must be >= 0. Received: -1"):
        config_from_dict({**REQUIRED, "seed": -1})


def test_duplicate_yaml_key_names_the_key_and_line(tmp_path):
    p = tmp_path / "dup.yaml"
    p.write_text("train:\n  epochs: 3\n  log_every: 5\n  epochs: 7\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'epochs'.*line 4.*line 2"):
        load_config(p)
    p.write_text("name: a\nseed: 1\nname: b\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'name'.*line 3.*line 1"):
        load_config(p)


def test_same_key_in_different_sections_is_fine(tmp_path):
    p = tmp_path / "ok.yaml"
    p.write_text(
        "model:\n  fn: m:f\n  kwargs: {a: 1}\ndata:\n  fn: d:f\n  kwargs: {a: 2}\n"
        "train: {train_step: 's:f'}\n"
    )
    cfg = load_config(p)
    assert cfg.model.kwargs == {"a": 1} and cfg.data.kwargs == {"a": 2}


def test_cli_negative_learning_rate_exits_2_with_one_line(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "distrain.cli",
            "train",
            "--config",
            "configs/quickstart.yaml",
            "optimizer.learning_rate=-0.1",
            "train.epochs=1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("distrain train: error:")
    assert "'optimizer.learning_rate' must be > 0.0. Received: -0.1." in lines[0]


def test_yaml_merge_keys_still_override(tmp_path):
    p = tmp_path / "merge.yaml"
    p.write_text(
        "model:\n  fn: m:f\n  kwargs: &k {a: 1, b: 2}\ndata:\n  fn: d:f\n  kwargs:\n"
        "    <<: *k\n    b: 3\ntrain: {train_step: 's:f'}\n"
    )
    assert load_config(p).data.kwargs == {"a": 1, "b": 3}


def test_shard_state_needs_a_data_parallel_strategy():
    with pytest.raises(ConfigError, match=r"strategy.shard_state applies to.*'one_device'"):
        config_from_dict(_with("strategy", {"name": "one_device", "shard_state": True}))
