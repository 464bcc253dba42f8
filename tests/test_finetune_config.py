"""Fine-tuning from a config (issue 54, section 4): ``model.pretrained``, ``model.lora`` and
``optimizer.trainable`` in ``distrain train`` and ``distrain plan``.

A tiny GPT-2 is exported to the Hugging Face layout here; the LoRA run trains its adapters
on Python source (``examples.lm.data:stdlib_splits``). A real ``distrain train`` process is
SIGKILLed mid-run and run again: it must end where an uninterrupted run ends, bit for bit,
from checkpoints that hold the adapters and never the base.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest
import yaml
from flax import nnx

import distrain as dt
from distrain._src.models.lora import leaf_path
from distrain._src.models.peft_format import base_sha256
from distrain._src.train.config import load_config
from distrain._src.train.config_errors import ConfigError
from distrain._src.train.plan import plan_config
from distrain._src.train.pretrained import (
    abstract_model,
    new_state,
    pretrained_model,
    with_lora_dropout,
)
from distrain._src.train.run import _init_model
from distrain._src.train.state import Base, checkpointed, restored_over
from distrain.checkpoint import CheckpointManager
from tests.processes import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 16


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """Two tiny pretrained GPT-2 directories of the same shapes, different weights."""
    root = tmp_path_factory.mktemp("bases")
    kwargs = dict(vocab_size=256, seq_len=16, d_model=32, n_layers=1, n_heads=2)
    cfg = dt.models.LMConfig(**kwargs, positions="learned")
    # One compiled initialisation (an eager one compiles a program per parameter).
    _, params = _init_model(dt.models.transformer, jax.random.key(0), **kwargs, positions="learned")
    dt.models.save_pretrained(str(root / "base"), params, cfg)
    moved = jax.tree.map(lambda x: x + 1e-3, params)
    dt.models.save_pretrained(str(root / "other"), moved, cfg)
    return str(root / "base"), str(root / "other")


def _config(tmp_path, base, **sections):
    """A tiny LoRA run (dropout on: its masks must resume exactly too), as a YAML file."""
    data = {
        "name": "tiny_lora",
        "seed": 0,
        "strategy": {"name": "one_device"},
        "model": {
            "pretrained": base,
            "lora": {"rank": 2, "alpha": 4, "dropout": 0.1, "targets": "attn/(qkv|out)$"},
        },
        "data": {
            "fn": "examples.lm.data:stdlib_splits",
            "kwargs": {
                "seq_len": 16,
                "max_documents": 40,
                "heldout_fraction": 0.2,
                "max_test_rows": 32,
            },
            "global_batch_size": 8,
            "validation_split": None,
        },
        "optimizer": {"name": "adamw", "learning_rate": 0.01},
        "train": {
            "train_step": "examples.lm.train:train_step",
            "epochs": None,
            "steps": STEPS,
            "log_every": 10,
        },
        "logging": {"progress_bar": False},
        "checkpoint": {"backup_freq": 2, "delete_backups": False},
    }
    for name, fields in sections.items():
        data[name] = {**data.get(name, {}), **fields}
    path = tmp_path / f"run{len(list(tmp_path.glob('run*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _newest(directory):
    with CheckpointManager(directory, async_save=False) as manager:
        return manager.restore()


def _cli(config, *overrides):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTRAIN_")}
    # 8 devices, as this process has: its compilations are then the CLI's, from the cache.
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(8), PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "distrain.cli", "train", "--config", config, *overrides]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )  # fmt: skip


def _kill_after_backup(proc, backups, step):
    """SIGKILLs ``proc``'s group once ``backups`` holds a committed step >= ``step``."""
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            done = (
                [int(n) for n in os.listdir(backups) if n.isdigit()]
                if os.path.isdir(backups)
                else []
            )
            if done and max(done) >= step:
                os.killpg(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.02)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, out


def _flat(tree):
    return {leaf_path(p): np.asarray(x) for p, x in jax.tree.leaves_with_path(tree)}


def test_lora_run_sigkilled_and_resumed_equals_the_uninterrupted_run(bases, tmp_path):
    """`distrain train` of a LoRA config, SIGKILLed mid-run (real SIGKILL, real CLI
    process) and run again, ends with the uninterrupted run's adapters, optimizer state,
    step and rng, bit for bit; its checkpoints hold no frozen leaf and the base's hash;
    the frozen base is the pretrained model's, bit for bit; a different base is refused,
    naming both hashes."""
    base, other = bases
    config = _config(tmp_path, base)
    killed, reference = str(tmp_path / "killed"), str(tmp_path / "reference")

    # The uninterrupted run first: its compilations fill the cache the processes read.
    cfg = load_config(config, [f"checkpoint.backup_dir={reference}"])
    result = dt.config.run_config(cfg, progress_bar=False, print_fn=None)
    proc = _cli(config, f"checkpoint.backup_dir={killed}")
    code, out = _kill_after_backup(proc, killed, 4)
    assert code == -signal.SIGKILL, out
    assert _newest(killed).step < STEPS  # killed mid-run
    again = _cli(config, f"checkpoint.backup_dir={killed}")
    out, _ = again.communicate(timeout=240)
    assert again.returncode == 0, out
    assert re.search(r"resumed from the backup of step \d+", out), out
    resumed, uninterrupted = _newest(killed), _newest(reference)
    assert resumed.step == uninterrupted.step == STEPS
    a, b = _flat(resumed.state), _flat(uninterrupted.state)
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)

    # On disk: the adapters (and their optimizer state), never a frozen leaf.
    params = resumed.state["params"]
    saved = [leaf_path(p) for p, _ in jax.tree.leaves_with_path(params)]
    assert saved and all(p.endswith(("/lora_a", "/lora_b")) for p in saved), saved
    pretrained = dt.models.from_pretrained(base)
    assert resumed.metadata["bases"] == [{"sha256": base_sha256(pretrained.params), "path": base}]
    # In memory: the base as read, bit for bit; the adapters as saved.
    trained = _flat(result.state.params)
    for key, value in _flat(nnx.to_pure_dict(pretrained.params)).items():
        np.testing.assert_array_equal(trained[key], value, err_msg=key)
    for key, value in _flat(params).items():
        np.testing.assert_array_equal(trained[key], value, err_msg=key)
    assert np.abs(params["blocks"]["0"]["attn"]["qkv"]["lora_b"]).max() > 0  # it trained

    # Resumed over another base (what BackupAndRestore does with it): refused, naming both.
    theirs = base_sha256(dt.models.from_pretrained(other).params)
    ours = resumed.metadata["bases"][0]["sha256"]
    elsewhere = result.state.replace(base=Base(sha256=theirs, path=other))
    with CheckpointManager(killed, async_save=False) as manager:
        again = manager.restore(target=checkpointed(elsewhere))
    with pytest.raises(ValueError, match=rf"{ours}.*{theirs}") as e:
        restored_over(elsewhere, again, killed)
    assert "\n" not in str(e.value) and base in str(e.value) and other in str(e.value)


def test_full_finetune_checkpoint_holds_everything_and_the_base_hash(bases, tmp_path):
    """Without model.lora everything trains: what the checkpoint callbacks save
    (``checkpointed``) is the whole state, with the base's hash in the metadata; a state
    with frozen leaves but no base is saved whole, with no hash."""
    from distrain._src.train.state import checkpoint_metadata

    config = _config(tmp_path, bases[0])
    data = yaml.safe_load(open(config))
    del data["model"]["lora"]
    open(config, "w").write(yaml.safe_dump(data))
    cfg = load_config(config)
    _, params = abstract_model(cfg)
    base = Base(sha256="ab" * 32, path=bases[0])
    state = jax.eval_shape(new_state(cfg, optax.adamw(0.01), base), params, jax.random.PRNGKey(0))
    assert state.trainable is None and state.base == base
    assert _flat(checkpointed(state)).keys() == _flat(state).keys()
    assert checkpoint_metadata(state) == {"bases": [{"sha256": "ab" * 32, "path": bases[0]}]}
    # Frozen leaves without a base to re-read them from are saved too (Python API's default).
    lora_cfg = load_config(_config(tmp_path, bases[0]))
    _, adapted = abstract_model(lora_cfg)
    frozen = jax.eval_shape(new_state(lora_cfg, optax.adamw(0.01)), adapted, jax.random.PRNGKey(0))
    assert frozen.trainable is not None and frozen.base is None
    assert _flat(checkpointed(frozen)).keys() == _flat(frozen).keys()
    assert checkpoint_metadata(frozen) == {}


def test_plan_counts_optimizer_state_for_the_trainable_leaves_only(bases, tmp_path, monkeypatch):
    """`distrain plan`'s optimizer-state bytes are those of tx.init(adapters), built from
    config.json and the files' headers: no weight is read."""
    from distrain._src.models import safetensors_io

    def no_reading(*args, **kwargs):
        raise AssertionError("distrain plan read a weight")

    monkeypatch.setattr(safetensors_io.Weights, "read", no_reading)
    monkeypatch.chdir(ROOT)
    cfg = load_config(_config(tmp_path, bases[0]))
    plan = plan_config(cfg)
    _, params = abstract_model(cfg)
    adapters = {
        leaf_path(p): x for p, x in jax.tree.leaves_with_path(params) if "lora_" in leaf_path(p)
    }
    expected = jax.eval_shape(optax.adamw(0.01).init, adapters)
    nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(expected))
    assert plan["opt_state_bytes_total"] == nbytes
    assert plan["trainable_param_bytes_total"] == sum(x.size * 4 for x in adapters.values())
    assert plan["param_bytes_total"] > 10 * plan["trainable_param_bytes_total"]


def test_wrong_fine_tuning_input_is_one_line_naming_the_fix(bases, tmp_path):
    base, _ = bases
    tx = optax.adamw(0.01)
    lora = {"rank": 2, "alpha": 4, "targets": "attn/(q|v)$"}  # GPT-2 has qkv and out
    nothing = load_config(_config(tmp_path, base, optimizer={"trainable": "no_such_leaf"}))
    _, params = abstract_model(nothing)
    cases = [
        (
            r"'optimizer.trainable' \('no_such_leaf'\) matches no parameter.*give a regex",
            lambda: jax.eval_shape(new_state(nothing, tx), params, jax.random.PRNGKey(0)),
        ),
        (
            r"'optimizer.trainable' must be a regular expression. Received: '\('",
            lambda: new_state(
                load_config(_config(tmp_path, base, optimizer={"trainable": "("})), tx
            ),
        ),
        (
            r"'model.lora': LoraConfig.targets='attn/\(q\|v\)\$' matches no .*'blocks/0/attn/qkv'",
            lambda: abstract_model(load_config(_config(tmp_path, base, model={"lora": lora}))),
        ),
        (
            r"'model.lora' adapts a pretrained model: set model.pretrained .* or remove",
            lambda: load_config(_config(tmp_path, base, model={"pretrained": None})),
        ),
        (
            r"'model.fn' \('distrain.models:transformer'\) and 'model.pretrained' both name",
            lambda: load_config(
                _config(tmp_path, base, model={"fn": "distrain.models:transformer"})
            ),
        ),
        (
            r"'model.pretrained' \('.*nowhere'\): .*config.json",
            lambda: abstract_model(load_config(_config(tmp_path, str(tmp_path / "nowhere")))),
        ),
    ]
    headless = tmp_path / "headless"  # config.json without weights
    headless.mkdir()
    shutil.copy(os.path.join(base, "config.json"), headless)
    headless_cfg = load_config(_config(tmp_path, str(headless)))
    cases += [
        (
            r"'model.pretrained' \('.*headless'\): .*model.safetensors",
            lambda: abstract_model(headless_cfg),
        ),
        (
            r"'model.pretrained' \('.*headless'\): .*model.safetensors",
            lambda: pretrained_model(headless_cfg, dt.OneDeviceStrategy(jax.devices()[0])),
        ),
        (
            r"'model.lora': LoraConfig.targets must be a regular expression",
            lambda: abstract_model(
                load_config(_config(tmp_path, base, model={"lora": {**lora, "targets": "("}}))
            ),
        ),
        (
            r"Config section 'model': distrain.models:from_pretrained cannot be called with",
            lambda: pretrained_model(
                load_config(_config(tmp_path, base, model={"kwargs": {"dtyp": "float32"}})),
                dt.OneDeviceStrategy(jax.devices()[0]),
            ),
        ),
    ]
    for pattern, call in cases:
        with pytest.raises(ConfigError, match=pattern) as e:
            call()
        assert "\n" not in str(e.value), str(e.value)
    # The adapters' dropout draws from the state's rng: a state without one is refused.
    dropped = with_lora_dropout(lambda state, batch: state, load_config(_config(tmp_path, base)))
    bare = jax.eval_shape(lambda p: dt.TrainState.create(params=p, tx=tx), params)
    with pytest.raises(ValueError, match=r"draws its masks from the state's rng.*rng=\.\.\."):
        dropped(bare, None)
