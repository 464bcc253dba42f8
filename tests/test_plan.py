"""`distrain plan`: "will it fit?" from abstract shapes, in a subprocess with N virtual
CPU devices (real `distrain` processes; nothing allocated for the state)."""

import json
import math
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
    "strategy.layout=distrain.models:TENSOR_PARALLEL_LAYOUT",
    "data.abstract={tokens: {shape: [129], dtype: int32}}",  # reads no data
]


def plan(*args, timeout=240):
    cmd = [sys.executable, "-m", "distrain.cli", "plan", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


@pytest.mark.one_end("lowest")  # a slow test: see tests/conftest.py
def test_plan_gives_the_allocated_state_bytes_and_a_verdict(devices):
    out = plan(*TINY, "--devices", "8", "--device-memory", "1GiB", "--json")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["devices"] == 8 and got["devices_per_replica"] == {"fsdp": 4, "tensor": 2}
    assert got["device_memory_bytes"] == 2**30 and got["fits"] is True
    assert got["peak_bytes_per_device"] > got["state_bytes_per_device"] > 0
    # 32 rows split over the replica's batch axes, far under 1 GiB: nothing to say.
    assert got["batch"]["splits"] is True and got["batch"]["rows"] == 32
    assert got["problems"] == [] and got["advice"] == []

    # The same state, allocated here on 8 devices as distrain train builds it.
    from distrain._src.train.config import load_config
    from distrain._src.train.import_paths import resolve_callable
    from distrain._src.train.run import _init_model
    from distrain._src.train.strategy_from_config import _optimizer, build_strategy

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
    assert "  problem: the step's peak per device" in text.stdout
    assert "  to change: train.grad_accum_steps=2: the same update" in text.stdout


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
@pytest.mark.split_ends  # a slow test: see tests/conftest.py
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


def test_devices_that_do_not_fit_the_mesh_name_the_override():
    out = plan("--config", "configs/lm_7b.yaml", "--devices", "8")
    assert out.returncode == 2
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("distrain plan: error: --devices 8 does not fit"), line
    assert "strategy.devices_per_replica={fsdp: 64}" in line
    assert "add the override 'strategy.devices_per_replica={fsdp: 8}'" in line
    assert "--devices a multiple of 64" in line


@pytest.mark.one_end("newest")  # a slow test: see tests/conftest.py
def test_a_batch_that_does_not_split_and_a_peak_over_memory_are_said(devices):
    """lm_tiny as one replica over {fsdp: 8} with 4 rows: the rows cannot split over 8
    devices, so every device computes all 4; and 1 MiB cannot hold the step."""
    from distrain._src.train.plan import _report

    args = [
        "--config",
        "configs/lm_tiny.yaml",
        "strategy.devices_per_replica={fsdp: 8}",
        "data.global_batch_size=4",
        "model.kwargs.remat=none",
        "data.abstract={tokens: {shape: [129], dtype: int32}}",
    ]
    out = plan(*args, "--devices", "8", "--device-memory", "1MiB", "--json")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["batch"] == {
        "rows": 4,
        "replicas": 1,
        "rows_per_replica": 4,
        "row_axes": {"fsdp": 8},
        "splits": False,
        "rows_per_device": 4,
    }
    split, over = got["problems"]
    assert "the batch does not split over a replica's devices" in split
    assert "4 rows per replica" in split and "{fsdp: 8}" in split and "8 copies" in split
    assert over.startswith("the step's peak per device") and "exceeds --device-memory" in over
    advice = "\n".join(got["advice"])
    assert "data.global_batch_size=8 (1 row(s) per device" in advice
    assert "model.kwargs.remat=dots_saveable" in advice
    # Fewer of the same 8 devices on the batch: 4 rows over fsdp 4, whole over tensor 2.
    assert "'strategy.devices_per_replica={fsdp: 4, tensor: 2}' with " in advice
    assert "strategy.layout=distrain.models:TENSOR_PARALLEL_LAYOUT" in advice
    assert "1 per device" in advice
    assert "the state alone (1.25 MiB per device) does not fit" in advice
    text = _report(got, 1)
    assert "batch rows per device:   4 (4 rows, 4 per replica, whole on every device" in text
    assert f"  problem: {split}" in text and f"  to change: {got['advice'][0]}" in text


def _cfg(accum=1, kwargs=None, fn="mylab.model:net"):
    from types import SimpleNamespace

    return SimpleNamespace(
        train=SimpleNamespace(grad_accum_steps=accum),
        model=SimpleNamespace(fn=fn, kwargs=kwargs or {}),
    )


def _plan(peak, memory, state=1, rows=64, per_device=8, mesh=None, row_axes=None):
    mesh = {"fsdp": 8} if mesh is None else mesh
    return {
        "devices": math.prod(mesh.values()),
        "devices_per_replica": mesh,
        "peak_bytes_per_device": peak,
        "state_bytes_per_device": state,
        "device_memory_bytes": memory,
        "memory_analysis": {"temp_bytes": peak - state},
        "batch": {
            "rows": rows,
            "replicas": 1,
            "rows_per_replica": rows,
            "row_axes": mesh if row_axes is None else row_axes,
            "splits": True,
            "rows_per_device": per_device,
        },
    }


def test_advice_when_the_peak_is_over_or_close_to_the_memory():
    from distrain._src.train.plan_advice import problems_and_advice

    assert problems_and_advice(_plan(50, 100), _cfg()) == ([], [])
    assert problems_and_advice(_plan(50, None), _cfg()) == ([], [])

    problems, advice = problems_and_advice(_plan(95, 100), _cfg())
    assert len(problems) == 1 and "with 5 B to spare" in problems[0] and "10%" in problems[0]
    assert advice  # what to change, as for a peak over the memory

    problems, advice = problems_and_advice(_plan(300, 100, state=20), _cfg(accum=2))
    assert problems == [
        "the step's peak per device (300 B) exceeds --device-memory (100 B) by 200 B: the "
        "state is 20 B of it, activations, gradients and workspace 280 B."
    ]
    assert advice[0].startswith("train.grad_accum_steps=4: the same update in micro-batches")
    assert advice[1].startswith("data.global_batch_size=32: half the rows per device")
    assert advice[2].startswith("rematerialization: wrap the model's blocks in jax.checkpoint")
    assert len(advice) == 3  # 8 rows per device: a tensor axis would not lower the peak

    # One row per device: split each row, on more devices.
    plan = _plan(300, 100, state=20, rows=64, per_device=1, mesh={"fsdp": 64})
    _, advice = problems_and_advice(plan, _cfg(kwargs={"remat": "none"}))
    assert advice[0].startswith("model.kwargs.remat=dots_saveable")
    assert advice[1].startswith(
        "one row per device is the fewest the batch gives: to split each row, a tensor axis "
        "on 8 times the devices, --devices 512 'strategy.devices_per_replica={fsdp: 64, "
        "tensor: 8}' with layout rules that split the weights over 'tensor'"
    )
    assert len(advice) == 2

    # The state alone too large: more devices first; a stronger remat policy; a mesh
    # that already has a tensor axis gets no tensor advice; one row per device cannot
    # be halved.
    plan = _plan(300, 100, state=150, per_device=1, mesh={"fsdp": 4, "tensor": 2})
    plan["batch"]["row_axes"] = {"fsdp": 4}
    _, advice = problems_and_advice(plan, _cfg(kwargs={"remat": "dots_saveable"}))
    assert advice[0].startswith("the state alone (150 B per device) does not fit")
    assert advice[1].startswith("model.kwargs.remat=nothing_saveable")
    assert len(advice) == 2

    # The LM's blocks recomputed but unrolled: scan them (issue 58); not when they
    # already are, not for a model without the field, not with one block.
    lm = "distrain.models:transformer"
    _, advice = problems_and_advice(plan, _cfg(kwargs={"remat": "nothing_saveable"}, fn=lm))
    assert advice[1].startswith("model.kwargs.scan_layers=true: the blocks stacked")
    for kwargs, fn in [
        ({"remat": "nothing_saveable", "scan_layers": True}, lm),
        ({"remat": "nothing_saveable", "n_layers": 1}, lm),
        ({"remat": "nothing_saveable"}, "mylab.model:net"),
    ]:
        _, advice = problems_and_advice(plan, _cfg(kwargs=kwargs, fn=fn))
        assert not any("scan_layers" in a for a in advice)


@pytest.mark.one_end("lowest")  # a slow test: see tests/conftest.py
def test_the_advice_for_experts_keeps_their_layout_and_plans(devices):
    """Issue 58: a mixture of experts whose peak is over the memory gets a per-device
    capacity, not a tensor layout that would replace its experts' rules; the capacity
    it names plans (in this process: 8 devices)."""
    from distrain._src.train.config import load_config
    from distrain._src.train.plan import plan_config

    moe = [
        "strategy.devices_per_replica={expert: 2, fsdp: 4}",
        "strategy.layout={'mlp/w_in|mlp/w_out': [expert, fsdp]}",
        "model.kwargs.moe_experts=4",
        "model.kwargs.n_layers=1",
        "model.kwargs.d_model=64",
        "data.global_batch_size=8",
        "data.abstract={tokens: {shape: [129], dtype: int32}}",
    ]
    got = plan_config(load_config("configs/lm_tiny.yaml", moe), device_memory=1024)
    assert got["fits"] is False and got["batch"]["rows_per_device"] == 1
    assert not any("TENSOR_PARALLEL_LAYOUT" in a or "tensor" in a for a in got["advice"])
    (capacity,) = [a for a in got["advice"] if a.startswith("model.kwargs.moe_capacity")]
    overrides = capacity.split(":")[0].split()
    assert overrides == [
        "model.kwargs.moe_capacity_factor=1.25",
        "model.kwargs.moe_capacity_group=device",
    ]
    bounded = plan_config(load_config("configs/lm_tiny.yaml", moe + overrides), 1024)
    assert bounded["peak_bytes_per_device"] < got["peak_bytes_per_device"]
    assert not any(a.startswith("model.kwargs.moe_capacity") for a in bounded["advice"])
