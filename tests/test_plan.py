"""`distrain plan`: "will it fit?" from abstract shapes, in a subprocess with N virtual
CPU devices (real `distrain` processes; nothing allocated for the state)."""

import json
import subprocess
import sys

import jax
import optax
import pytest

import distrain as dt
from distrain._src.train.plan import parse_bytes

TINY = [
    "--config",
    "configs/lm_tiny.yaml",
    "strategy.devices_per_replica={fsdp: 4, tensor: 2}",
    "strategy.layout=examples.lm.model:TENSOR_PARALLEL_LAYOUT",
    "data.abstract={tokens: {shape: [129], dtype: int32}}",  # reads no data
]


def plan(*args, timeout=240):
    cmd = [sys.executable, "-m", "distrain.cli", "plan", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


def test_plan_gives_the_allocated_state_bytes_and_a_verdict(devices):
    out = plan(*TINY, "--devices", "8", "--device-memory", "1GiB", "--json")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["devices"] == 8 and got["devices_per_replica"] == {"fsdp": 4, "tensor": 2}
    assert got["device_memory_bytes"] == 2**30 and got["fits"] is True
    assert got["peak_bytes_per_device"] > got["state_bytes_per_device"] > 0

    # The same state, allocated here on 8 devices as distrain train builds it.
    from distrain._src.train.config import load_config
    from distrain._src.train.run import _init_model, _optimizer, build_strategy, resolve_callable

    cfg = load_config("configs/lm_tiny.yaml", TINY[2:])
    strategy = build_strategy(cfg.strategy)
    fn = resolve_callable(cfg.model.fn, "model.fn")
    _, params = _init_model(fn, jax.random.key(cfg.seed), **cfg.model.kwargs)
    tx = _optimizer(cfg.optimizer.name, cfg.optimizer.learning_rate, cfg.optimizer.kwargs)
    state = dt.TrainState.create(params=params, tx=tx, rng=jax.random.PRNGKey(cfg.seed + 1))
    report = strategy.memory_report(strategy.put_replicated(state))
    assert got["state_bytes_per_device"] == report["bytes_per_device"]
    assert got["state_bytes_total"] == report["bytes_full_copy"]
    assert isinstance(tx, optax.GradientTransformation)

    text = plan(*TINY, "--devices", "8", "--device-memory", "1KiB")
    assert text.returncode == 0, text.stderr
    assert "does NOT fit" in text.stdout and "step peak per device" in text.stdout


@pytest.mark.parametrize(
    "args, match",
    [
        (["--devices", "8", "--device-memory", "80 gigs"], r"--device-memory must be a size"),
        (["--devices", "8", "--processes", "3"], r"--processes \(3\) must be a positive divisor"),
        (
            ["--devices", "12", "--processes", "2", "strategy.devices_per_replica=4"],
            r"divide the devices of every process or be a multiple",
        ),
        (["--devices", "6"], r"needs 8 devices per replica, which must divide"),
    ],
)
def test_bad_plans_are_one_error_line(args, match):
    out = plan(*TINY, *args)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("distrain plan: error:"), out.stderr
    import re

    assert re.search(match, lines[0]), lines[0]


def test_parse_bytes():
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("16g") == 16 * 10**9
    assert parse_bytes("1024") == 1024
    with pytest.raises(ValueError, match=r"Received: '80 GiBs'"):
        parse_bytes("80 GiBs")
