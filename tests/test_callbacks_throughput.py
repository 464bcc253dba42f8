"""dt.callbacks.Throughput (examples/s, tokens/s, MFU between the Trainer's syncs) and
dt.callbacks.ProfilerWindow (a jax.profiler trace of steps a..b), on real fits."""

import time

import jax
import pytest

import distrain as dt
from distrain._src.train.callbacks.throughput import PEAK_FLOPS, peak_flops_per_device
from tests.linear_problem import new_state, problem, train_step

BATCH = 16


def _fit(callbacks, *, steps=10, log_every=2, steps_per_epoch=None, epochs=None):
    strategy = dt.MirroredStrategy()
    data = dt.data.ArrayPipeline(problem(), global_batch_size=BATCH, seed=0, num_epochs=None)
    trainer = dt.Trainer(strategy, train_step, log_every=log_every)
    return trainer.fit(
        new_state(),
        data,
        steps=steps,
        epochs=epochs,
        steps_per_epoch=steps_per_epoch,
        callbacks=callbacks,
    )


def test_throughput_measures_each_window_after_the_first(devices):
    tp = dt.callbacks.Throughput(BATCH, tokens_per_example=4, flops_per_example=100.0)
    seen = []
    after = dt.callbacks.LambdaCallback(
        on_train_batch_end=lambda info: seen.append((info.step, dict(info.logs or {})))
    )
    _fit([tp, after])
    # Syncs at steps 2, 4, 6, 8, 10: the first only starts the clock (compilation).
    assert [r["step"] for r in tp.records] == [4, 6, 8, 10]
    for r in tp.records:
        assert r["steps"] == 2 and r["seconds"] > 0 and r["examples_per_sec"] > 0
        assert r["tokens_per_sec"] == pytest.approx(4 * r["examples_per_sec"])
        assert r["examples_per_sec"] == pytest.approx(2 * BATCH / r["seconds"])
        assert "mfu" not in r  # CPU: no peak in the table, none given
    # Later callbacks see the numbers in the logs of the same step; steps without a sync
    # get no logs (no sync of the callback's own).
    logs = dict(seen)
    assert logs[4]["tokens_per_sec"] == tp.records[0]["tokens_per_sec"] and "loss" in logs[4]
    assert "examples_per_sec" not in logs[2] and logs[3] == {}
    s = tp.summary()
    assert s["step"] == 10 and s["steps"] == 8
    assert s["examples_per_sec"] == pytest.approx(8 * BATCH / sum(r["seconds"] for r in tp.records))


def test_throughput_mfu_with_a_given_peak(devices):
    fpe, peak = 3e6, 1e9
    tp = dt.callbacks.Throughput(BATCH, flops_per_example=fpe, peak_flops_per_device=peak)
    _fit([tp], steps=6)
    assert tp.records
    for r in tp.records:
        # 8 replicas: the peak of 8 devices.
        assert r["mfu"] == pytest.approx(fpe * r["examples_per_sec"] / (peak * 8)) and r["mfu"] > 0
        assert "tokens_per_sec" not in r
    per_token = dt.callbacks.Throughput(
        BATCH,
        tokens_per_example=10,
        flops_per_token=7.0,
        peak_flops_per_device=peak,
        num_devices=2,
    )
    assert per_token.flops_per_example == 70.0
    assert per_token.measure(4, 2.0)["mfu"] == pytest.approx(70.0 * 32 / (peak * 2))


def test_throughput_window_restarts_after_epoch_end(devices):
    def slow_epoch_end(epoch, logs):
        time.sleep(0.6)  # stands for a validation pass: not training time

    tp = dt.callbacks.Throughput(BATCH)
    lines = []
    tp.print_fn = lines.append
    _fit(
        [dt.callbacks.LambdaCallback(on_epoch_end=slow_epoch_end), tp],
        steps=None,
        epochs=2,
        steps_per_epoch=4,
    )
    assert [r["step"] for r in tp.records] == [4, 6, 8]
    assert tp.records[1]["seconds"] < 0.5  # the window after the epoch end left it out
    assert lines[0].startswith("step 4: ") and "examples/s, MFU n/a" in lines[0]


def test_peak_flops_table():
    assert peak_flops_per_device("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops_per_device("NVIDIA H100 PCIe") == 756e12
    assert peak_flops_per_device("NVIDIA H100 NVL") == 835e12
    assert peak_flops_per_device("TPU v5") is None  # v5p: not in the table, not v5e's peak
    assert peak_flops_per_device("NVIDIA H200") == 989e12
    assert peak_flops_per_device("NVIDIA A100-SXM4-40GB") == 312e12
    assert peak_flops_per_device("TPU v4") == 275e12
    assert peak_flops_per_device("TPU v5 lite") == 197e12
    assert peak_flops_per_device("cpu") is None
    assert peak_flops_per_device() is None  # this machine's CPU devices
    assert all(name == name.lower() for name, _ in PEAK_FLOPS)
    assert dt.callbacks.Throughput(8).peak_flops is None
    assert dt.callbacks.Throughput(8, peak_flops_per_device=5e12).peak_flops == 5e12


_BAD = [
    ({"global_batch_size": 0}, r"`global_batch_size` must be a positive number\. Received: "),
    ({"global_batch_size": True}, r"`global_batch_size` must be a positive number"),
    ({"tokens_per_example": -1}, r"`tokens_per_example` must be a positive number or None"),
    ({"flops_per_example": 1.0, "flops_per_token": 1.0}, r"flops_per_example or .*not both"),
    ({"flops_per_token": 1.0}, r"needs tokens_per_example"),
    ({"peak_flops_per_device": 0.0}, r"`peak_flops_per_device` must be a positive number"),
    ({"flops_per_example": float("inf")}, r"`flops_per_example` must be finite"),
    ({"num_devices": 0}, r"`num_devices` must be a positive number"),
]


@pytest.mark.parametrize(("kwargs", "match"), _BAD)
def test_throughput_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dt.callbacks.Throughput(**{"global_batch_size": 8, **kwargs})


def _trace_files(logdir):
    return sorted(p.name for p in logdir.rglob("*") if p.is_file() and not p.name.startswith("."))


def test_profiler_window_writes_a_trace_of_its_steps(devices, tmp_path):
    pw = dt.callbacks.ProfilerWindow(2, 4, tmp_path / "profile")
    _fit([pw], steps=6, log_every=3)
    assert pw.traced == (3, 4) and not pw.active
    files = _trace_files(tmp_path / "profile")
    assert any(f.endswith(".xplane.pb") for f in files), files
    # The profiler was stopped: another trace can start.
    jax.profiler.start_trace(str(tmp_path / "again"))
    jax.profiler.stop_trace()


def test_profiler_window_stops_when_fit_ends_first(devices, tmp_path):
    pw = dt.callbacks.ProfilerWindow(0, 100, tmp_path / "p", perfetto=True)
    _fit([pw], steps=3)
    assert pw.traced == (1, 3) and not pw.active
    assert any(f.endswith(".trace.json.gz") for f in _trace_files(tmp_path / "p"))


def test_profiler_window_bad_arguments(tmp_path):
    with pytest.raises(
        ValueError, match=r"stop_step must be greater than start_step\. Received: start_step=5, "
    ):
        dt.callbacks.ProfilerWindow(5, 5, tmp_path)
    with pytest.raises(ValueError, match=r"`start_step` must be an int >= 0\. Received: start_"):
        dt.callbacks.ProfilerWindow(-1, 5, tmp_path)
    with pytest.raises(ValueError, match=r"`stop_step` must be an int >= 0\. Received: stop_step="):
        dt.callbacks.ProfilerWindow(1, 2.5, tmp_path)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OSError, match=r"ProfilerWindow log directory .* is not writable"):
        _fit([dt.callbacks.ProfilerWindow(0, 2, blocker / "sub")], steps=1)
