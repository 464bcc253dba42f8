"""A batch's rows stay whole over the model axes of a replica's layout ("tensor",
"stage"), so a tensor-parallel step gets them in the layout it wants: XLA no longer
reshards them with a full rematerialization (its "[SPMD] Involuntary full
rematerialization ... inefficient" warning, printed from C++, hence the subprocess)."""

import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import distrain as dt
from distrain._src.strategy import replica_mesh
from distrain._src.train import _input

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(Path(__file__).parent / "scripts" / "tp_fit.py")
WARNING = "Involuntary full rematerialization"
TP = {"w1": P("fsdp", "tensor"), "w2": P("tensor", None)}


@pytest.mark.one_end("lowest")  # a slow test: see tests/conftest.py
def test_a_tensor_parallel_fit_reshards_no_rows(tmp_path):
    """docs/scaling.md's {"fsdp": 4, "tensor": 2} layout, from host and from
    device-resident input (the gather and the padding mask inside the step): before,
    each printed XLA's warning twice (rows [8, 1] -> [1, 4, 2])."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.Popen(
        [sys.executable, SCRIPT],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    assert "docs layout, host input" in out and "docs layout, device input" in out
    assert WARNING not in err, [line[:400] for line in err.splitlines() if WARNING in line]


def tp_batch(rows=32):
    r = np.random.default_rng(0)
    return {"x": r.normal(size=(rows, 64)).astype(np.float32), "y": np.arange(rows)}


def init():
    return {"w1": np.ones((64, 128), np.float32), "w2": np.ones((128, 10), np.float32)}


@pytest.mark.parametrize(
    "kwargs, rows",
    [
        (dict(devices_per_replica={"fsdp": 4, "tensor": 2}, layout=TP), ("replica", "fsdp")),
        (dict(devices_per_replica={"fsdp": 4, "tensor": 2}), ("replica", "fsdp", "tensor")),
        (
            dict(devices_per_replica={"data": 2, "fsdp": 2, "tensor": 2}, layout=TP),
            ("replica", "data", "fsdp"),
        ),
        # "model" is the FSDP axis of devices_per_replica=k: rows still split over it.
        (dict(devices_per_replica=4, layout={"w1": P(None, "model")}), ("replica", "model")),
        # Rows stay split over "stage" (whole over it, XLA aborted compiling the LM's
        # pipeline on {stage: 2, fsdp: 2}: tests/test_example_lm.py).
        (
            dict(devices_per_replica={"stage": 2, "fsdp": 2}, layout={"w": P("stage", "fsdp")}),
            ("replica", "stage", "fsdp"),
        ),
    ],
    ids=["tensor", "no_rules", "three_axes", "model_k4", "stage"],
)
def test_rows_split_over_every_inner_axis_but_the_model_axes(devices, kwargs, rows):
    strategy = dt.MirroredStrategy(**kwargs)
    batch = strategy.distribute_batch(tp_batch())
    for leaf in jax.tree.leaves(batch.value):
        assert leaf.sharding.spec == P(rows)
    # Each replica's component is still its own rows, once each.
    local = strategy.experimental_local_results(batch)
    n = strategy.num_replicas_in_sync
    np.testing.assert_array_equal(
        np.concatenate([np.asarray(c["y"]) for c in local]), np.arange(32)
    )
    assert len(local) == n


def test_rows_that_do_not_divide_over_the_row_devices_are_whole(devices):
    strategy = dt.MirroredStrategy(devices_per_replica={"fsdp": 4, "tensor": 2}, layout=TP)
    assert strategy.batch_sharding(8).spec == P(("replica", "fsdp"))  # 8 % 4 == 0, not % 8
    assert strategy.batch_sharding(6).spec == P("replica")


def test_device_resident_input_gathers_rows_in_the_same_layout(devices):
    # The row ids stream in the rows' layout, so the gather inside the step yields the
    # rows where the step wants them (the subprocess test checks XLA's side).
    strategy = dt.MirroredStrategy(devices_per_replica={"fsdp": 4, "tensor": 2}, layout=TP)
    data = dt.data.ArrayPipeline(tp_batch(64), global_batch_size=32, num_epochs=1)
    route = _input.for_fit(strategy, data, "device", lambda state, batch: (state, {}))
    assert route.mode == "device"
    ids = next(iter(route.batches))
    assert jax.tree.leaves(ids.value)[0].sharding.spec == P(("replica", "fsdp"))


def fake_mesh(shape, names, devices_per_process):
    """A mesh-like grid of devices with process indices (several processes' worth, which
    this one process cannot make): what `row_axes` reads."""
    n = int(np.prod(shape))
    grid = np.array(
        [SimpleNamespace(process_index=i // devices_per_process) for i in range(n)], dtype=object
    ).reshape(shape)
    return SimpleNamespace(
        axis_names=names, shape=dict(zip(names, shape, strict=True)), devices=grid
    )


@pytest.mark.parametrize(
    "shape, names, per_process, want",
    [
        # "tensor" inside each process: each process still feeds a contiguous half.
        ((1, 4, 2), ("replica", "fsdp", "tensor"), 4, ("fsdp",)),
        ((2, 2, 2), ("replica", "fsdp", "tensor"), 4, ("fsdp",)),
        # "tensor" across processes: two processes would need the same rows; all axes.
        ((1, 2, 4), ("replica", "tensor", "fsdp"), 4, ("tensor", "fsdp")),
        ((1, 2, 4), ("replica", "fsdp", "tensor"), 2, ("fsdp", "tensor")),
        ((1, 4, 2), ("replica", "fsdp", "tensor"), 1, ("fsdp", "tensor")),
    ],
)
def test_rows_stay_whole_over_a_model_axis_only_inside_a_process(shape, names, per_process, want):
    mesh = fake_mesh(shape, names, per_process)
    assert replica_mesh.row_axes(mesh, "replica", frozenset({"tensor"})) == want
