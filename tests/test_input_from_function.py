"""distribute_datasets_from_function: TensorFlow's pattern (dataset_fn batches by
ctx.get_per_replica_batch_size(global)) with InputOptions(per_replica_batches=True)
gives each replica its per-replica batch, as in TF; without the option it is refused,
never silently split again; distrain's process-local batches keep working."""

import numpy as np
import pytest

import distrain as dt

GLOBAL = 64
PER_REPLICA = dt.InputOptions(per_replica_batches=True)


def _rows(strategy, batch, key="x"):
    return np.asarray(strategy.gather(batch)[key])


def test_tf_pattern_gives_each_replica_its_per_replica_batch(devices):
    strategy = dt.MirroredStrategy()  # 8 replicas in this process
    data = np.arange(4 * GLOBAL)

    def dataset_fn(ctx):
        per_replica = ctx.get_per_replica_batch_size(GLOBAL)
        assert per_replica == 8
        # The TF idiom: shard by pipeline, batch by the per-replica size.
        mine = data[ctx.input_pipeline_id :: ctx.num_input_pipelines]
        return [{"x": mine[i : i + per_replica]} for i in range(0, len(mine), per_replica)]

    dist = strategy.distribute_datasets_from_function(dataset_fn, PER_REPLICA)
    batches = list(dist)
    assert len(batches) == 4  # 32 per-replica batches / 8 replicas
    for b in batches:
        shards = strategy.experimental_local_results(b)
        assert [len(s["x"]) for s in shards] == [8] * 8  # not 1 row each
    # Replica r of step s gets element s*8 + r of the dataset, as TF's round robin does.
    np.testing.assert_array_equal(_rows(strategy, batches[0]), data[:GLOBAL])
    np.testing.assert_array_equal(np.concatenate([_rows(strategy, b) for b in batches]), data)


def test_tf_pattern_state_round_trips(devices):
    strategy = dt.MirroredStrategy()
    data = {"x": np.arange(2 * GLOBAL, dtype=np.float32)}

    def dataset_fn(ctx):
        return dt.data.ArrayPipeline(
            data,
            global_batch_size=ctx.get_per_replica_batch_size(GLOBAL),
            shuffle=False,
            num_epochs=1,
            process_index=0,
            process_count=1,
        )

    it = iter(strategy.distribute_datasets_from_function(dataset_fn, PER_REPLICA))
    first = next(it)
    state = it.get_state()
    second = next(it)
    np.testing.assert_array_equal(_rows(strategy, first), data["x"][:GLOBAL])
    it2 = iter(strategy.distribute_datasets_from_function(dataset_fn, PER_REPLICA))
    it2.set_state(state)
    np.testing.assert_array_equal(_rows(strategy, next(it2)), _rows(strategy, second))


def test_tf_pattern_last_partial_group_is_masked_with_mask_key(devices):
    strategy = dt.MirroredStrategy()
    data = np.arange(GLOBAL + 20, dtype=np.float32)

    def dataset_fn(ctx):
        n = ctx.get_per_replica_batch_size(GLOBAL)
        return [{"x": data[i : i + n]} for i in range(0, len(data), n)]

    batches = list(
        strategy.distribute_datasets_from_function(
            dataset_fn, dt.InputOptions(mask_key="mask", per_replica_batches=True)
        )
    )
    assert len(batches) == 2
    last = strategy.gather(batches[1])
    assert np.asarray(last["mask"]).sum() == 20 and len(last["x"]) == GLOBAL


def test_process_local_batches_keep_working(devices):
    strategy = dt.MirroredStrategy()

    def dataset_fn(ctx):
        # distrain's own form: this process's rows of each global batch.
        rows = GLOBAL // ctx.num_input_pipelines
        return [{"x": np.arange(rows, dtype=np.float32)}]

    (batch,) = list(strategy.distribute_datasets_from_function(dataset_fn))
    shards = strategy.experimental_local_results(batch)
    assert [len(s["x"]) for s in shards] == [8] * 8


def _asks_per_replica_size(ctx):
    """TF's idiom: 8-row batches (64 // 8 replicas), 2 steps' worth."""
    n = ctx.get_per_replica_batch_size(GLOBAL)
    return [{"x": np.arange(i, i + n, dtype=np.float32)} for i in range(0, 2 * GLOBAL, n)]


def test_tf_pattern_without_the_option_is_refused_not_split_again(devices):
    """Issue 23: TF's dataset_fn idiom must not silently give each replica 1 row of the 8
    TF gives it (nor be guessed from the first batch): the user says which form it is."""
    strategy = dt.MirroredStrategy()
    with pytest.raises(
        ValueError,
        match=r"get_per_replica_batch_size\(64\).*\(8 rows\).*"
        r"over this process's 8 replicas.*per_replica_batches=True",
    ):
        next(iter(strategy.distribute_datasets_from_function(_asks_per_replica_size)))
    # Said explicitly, either form is taken as said.
    tf_form = list(strategy.distribute_datasets_from_function(_asks_per_replica_size, PER_REPLICA))
    assert [len(s["x"]) for s in strategy.experimental_local_results(tf_form[0])] == [8] * 8
    process_rows = list(
        strategy.distribute_datasets_from_function(
            _asks_per_replica_size, dt.InputOptions(per_replica_batches=False)
        )
    )
    assert len(process_rows) == 16
    assert [len(s["x"]) for s in strategy.experimental_local_results(process_rows[0])] == [1] * 8


def test_per_replica_batches_is_refused_where_it_means_nothing(devices):
    strategy = dt.MirroredStrategy()
    with pytest.raises(
        ValueError,
        match=r"per_replica_batches=True\) is for .*"
        "distribute_datasets_from_function",
    ):
        strategy.experimental_distribute_dataset([{"x": np.zeros(8)}], PER_REPLICA)
    with pytest.raises(ValueError, match=r"`per_replica_batches` must be True, False or None"):
        dt.InputOptions(per_replica_batches="yes")


@pytest.mark.parametrize(
    ("bad", "error"),
    [(0, ValueError), (-8, ValueError), (True, TypeError), (8.0, TypeError), ("64", TypeError)],
)
def test_get_per_replica_batch_size_rejects_bad_values(bad, error):
    """Not an int: TypeError (the class TF's compute_average_loss raises for a float)."""
    ctx = dt.InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=8)
    with pytest.raises(error, match=r"global_batch_size must be a positive int.*Received"):
        ctx.get_per_replica_batch_size(bad)


def test_get_per_replica_batch_size_not_divisible_says_what_to_use():
    ctx = dt.InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=8)
    with pytest.raises(ValueError, match=r"global batch size \(60\).*replicas \(8\).*56 or 64"):
        ctx.get_per_replica_batch_size(60)
    assert "mask_key" not in str(
        pytest.raises(ValueError, ctx.get_per_replica_batch_size, 60).value
    )


_TWO_PROCESS_SCRIPT = """
import json, sys
import numpy as np
import distrain as dt

strategy = dt.MultiWorkerMirroredStrategy()
data = np.arange(64, dtype=np.float32)

def dataset_fn(ctx):
    per_replica = ctx.get_per_replica_batch_size(16)  # 16 over 2 x 2 replicas: 4
    mine = data[ctx.input_pipeline_id :: ctx.num_input_pipelines]
    return [{"x": mine[i : i + per_replica]} for i in range(0, len(mine), per_replica)]

steps = []
options = dt.InputOptions(per_replica_batches=True)
for batch in strategy.distribute_datasets_from_function(dataset_fn, options):
    local = [np.asarray(s["x"]).tolist() for s in strategy.experimental_local_results(batch)]
    steps.append({"local": local, "global": np.asarray(strategy.gather(batch)["x"]).tolist()})
print("RESULT " + json.dumps(steps), flush=True)
"""


def _two_processes(tmp_path, script_text, devices_per_process):
    """Runs ``script_text`` on 2 processes on 127.0.0.1; returns each one's RESULT json."""
    import json
    import os
    import sys

    from distrain._src.cluster.launch import free_port
    from tests.processes import run_together, xla_flags

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = tmp_path / "script.py"
    script.write_text(script_text)
    port = free_port()
    jobs = []
    for pid in range(2):
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("DISTRAIN_", "SLURM_")) and k != "TF_CONFIG"
        }
        env.update(
            XLA_FLAGS=xla_flags(devices_per_process),
            JAX_PLATFORMS="cpu",
            DISTRAIN_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
            DISTRAIN_NUM_PROCESSES="2",
            DISTRAIN_PROCESS_ID=str(pid),
            DISTRAIN_TIMEOUT_SECONDS="20",
            # this checkout's distrain, not an installed one
            PYTHONPATH=os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")])),
        )
        jobs.append(([sys.executable, str(script)], env))
    results = []
    for code, log, _ in run_together(jobs, 90):
        assert code == 0, log[-3000:]
        results.append(json.loads(log.split("RESULT ", 1)[1].splitlines()[0]))
    return results


def test_tf_pattern_on_two_processes(tmp_path):
    """2 processes x 2 devices: each replica gets its own per-replica batch (4 rows)."""
    data = np.arange(64)
    for pid, steps in enumerate(_two_processes(tmp_path, _TWO_PROCESS_SCRIPT, 2)):
        assert len(steps) == 4
        mine = data[pid::2]
        for s, step in enumerate(steps):
            # This process's replicas get consecutive per-replica batches of its shard.
            assert step["local"] == [
                mine[(2 * s + r) * 4 : (2 * s + r + 1) * 4].tolist() for r in range(2)
            ]
            expected = np.concatenate([data[p::2][8 * s : 8 * s + 8] for p in range(2)])
            assert step["global"] == expected.tolist()


_UNEVEN_SCRIPT = """
import json
import numpy as np
import distrain as dt

strategy = dt.MultiWorkerMirroredStrategy()  # 2 processes x 1 device
out = {}

def uneven_rows(ctx):  # the chief 4 rows, the worker 2
    start, n = (0, 4) if ctx.input_pipeline_id == 0 else (4, 2)
    return [{"x": np.arange(start, start + n, dtype=np.float32) * 3}]

def uneven_count(ctx):  # the chief 2 batches, the worker 1
    return [{"x": np.ones(2, np.float32)}] * (2 - ctx.input_pipeline_id)

def even(ctx):
    return [{"x": np.arange(2, dtype=np.float32) + 2 * ctx.input_pipeline_id}] * 2

threaded = dt.InputOptions(prefetch_thread=True)  # the exchange on the prefetch thread
for name, fn, options in [("rows", uneven_rows, None), ("count", uneven_count, None),
                          ("even", even, None), ("count_threaded", uneven_count, threaded),
                          ("even_threaded", even, threaded)]:
    try:
        batches = list(strategy.distribute_datasets_from_function(fn, options))
        out[name] = [float(strategy.reduce("mean", b, axis=0)["x"]) for b in batches]
    except ValueError as e:
        out[name] = str(e)
print("RESULT " + json.dumps(out), flush=True)
"""


def test_uneven_batches_across_processes_are_refused_on_every_process(tmp_path):
    """Issue 23: the chief 4 rows and the worker 2 gave reduce("mean") 7.875 on one and
    15.75 on the other. TF's uneven per-replica batches cannot be one evenly sharded
    array: every process refuses the step, naming every process's rows."""
    for got in _two_processes(tmp_path, _UNEVEN_SCRIPT, 1):
        assert "batches differ at batch 1" in got["rows"], got
        assert "process 0: 4 rows, process 1: 2 rows" in got["rows"]
        assert "process 0: 2 rows, process 1: no batch (its data ended)" in got["count"]
        assert got["even"] == [1.5, 1.5]  # agreeing processes: the same exact mean
        assert got["count_threaded"] == got["count"]
        assert got["even_threaded"] == [1.5, 1.5]
