"""ArrayPipeline: seeded shuffle, batching, process slices and exact resume."""

import itertools
import json

import numpy as np
import pytest

from distrain.data import ArrayPipeline


def _data(n=40):
    return {
        "x": np.arange(n, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32),
        "y": np.arange(n, dtype=np.int32),
    }


def _pipe(data=None, **kw):
    kw.setdefault("global_batch_size", 8)
    kw.setdefault("process_index", 0)
    kw.setdefault("process_count", 1)
    return ArrayPipeline(_data() if data is None else data, **kw)


def _ids(batches):
    return [b["y"].tolist() for b in batches]


def test_deterministic_and_seed_dependent():
    a = _ids(itertools.islice(iter(_pipe(seed=3)), 12))
    b = _ids(itertools.islice(iter(_pipe(seed=3)), 12))
    c = _ids(itertools.islice(iter(_pipe(seed=4)), 12))
    assert a == b
    assert a != c
    # Rows stay aligned across keys.
    batch = next(iter(_pipe(seed=3)))
    np.testing.assert_array_equal(batch["x"][:, 0], batch["y"].astype(np.float32))


def test_every_example_once_per_epoch_and_reshuffled():
    pipe = _pipe(seed=0, num_epochs=3)
    assert pipe.steps_per_epoch == 5 and pipe.num_steps == 15
    batches = _ids(iter(pipe))
    assert len(batches) == 15
    epochs = [sum(batches[e * 5 : (e + 1) * 5], []) for e in range(3)]
    for ep in epochs:
        assert sorted(ep) == list(range(40))
    assert epochs[0] != epochs[1] != epochs[2]
    assert epochs[0] != list(range(40))  # actually shuffled


def test_no_reshuffle_repeats_epoch_order_and_no_shuffle_is_identity():
    epochs = _ids(iter(_pipe(seed=0, num_epochs=2, reshuffle_each_epoch=False)))
    assert epochs[:5] == epochs[5:]
    ordered = _ids(iter(_pipe(shuffle=False, num_epochs=1)))
    assert sum(ordered, []) == list(range(40))


def test_drop_remainder_drops_tail_and_stops():
    pipe = _pipe(_data(43), num_epochs=2)
    assert pipe.steps_per_epoch == 5
    batches = _ids(iter(pipe))
    assert len(batches) == 10 and all(len(b) == 8 for b in batches)
    ep0 = sum(batches[:5], [])
    assert len(set(ep0)) == 40 and set(ep0) <= set(range(43))
    it = iter(pipe)
    for _ in range(10):
        next(it)
    with pytest.raises(StopIteration):
        next(it)


@pytest.mark.parametrize("procs", [2, 4])
def test_process_slices_concatenate_to_single_process_batch(procs):
    single = list(itertools.islice(iter(_pipe(seed=7, global_batch_size=8)), 12))
    parts = [
        list(itertools.islice(iter(_pipe(seed=7, process_index=p, process_count=procs)), 12))
        for p in range(procs)
    ]
    for step, full in enumerate(single):
        for key in ("x", "y"):
            joined = np.concatenate([parts[p][step][key] for p in range(procs)])
            np.testing.assert_array_equal(joined, full[key])
        assert all(len(parts[p][step]["y"]) == 8 // procs for p in range(procs))


def test_resume_equals_uninterrupted_and_state_is_json():
    uninterrupted = _ids(iter(_pipe(seed=1, num_epochs=3)))
    it = iter(_pipe(seed=1, num_epochs=3))
    head = _ids(itertools.islice(it, 7))
    state = json.loads(json.dumps(it.get_state()))
    assert state["step"] == 7
    fresh = iter(_pipe(seed=1, num_epochs=3))
    fresh.set_state(state)
    assert head + _ids(fresh) == uninterrupted


@pytest.mark.parametrize("save_procs,load_procs", [(1, 4), (4, 2), (2, 1)])
def test_resume_across_process_counts(save_procs, load_procs):
    reference = _ids(itertools.islice(iter(_pipe(seed=5)), 20))
    it = iter(_pipe(seed=5, process_index=0, process_count=save_procs))
    for _ in range(9):  # crosses an epoch boundary (5 steps per epoch)
        next(it)
    state = it.get_state()
    resumed = []
    for p in range(load_procs):
        r = iter(_pipe(seed=5, process_index=p, process_count=load_procs))
        r.set_state(state)
        resumed.append(_ids(itertools.islice(r, 11)))
    joined = [sum((resumed[p][s] for p in range(load_procs)), []) for s in range(11)]
    assert joined == reference[9:]


def test_padding_and_mask_on_last_batch():
    pipe = _pipe(_data(21), drop_remainder=False, mask_key="mask", num_epochs=2, seed=2)
    assert pipe.steps_per_epoch == 3
    batches = list(iter(pipe))
    assert len(batches) == 6
    for b in batches:  # structure never changes
        assert set(b) == {"x", "y", "mask"}
        assert b["x"].shape == (8, 3) and b["mask"].dtype == np.float32
    np.testing.assert_array_equal(batches[0]["mask"], np.ones(8, np.float32))
    last = batches[2]
    np.testing.assert_array_equal(last["mask"], [1, 1, 1, 1, 1, 0, 0, 0])
    assert not last["x"][5:].any() and not last["y"][5:].any()
    epoch0 = np.concatenate([b["y"][b["mask"] == 1] for b in batches[:3]])
    assert sorted(epoch0.tolist()) == list(range(21))
    # Process 1 of 2 holds the padded half: rows 4..7 of the global batch.
    p1 = list(
        iter(
            _pipe(
                _data(21),
                drop_remainder=False,
                mask_key="mask",
                num_epochs=2,
                seed=2,
                process_index=1,
                process_count=2,
            )
        )
    )
    np.testing.assert_array_equal(p1[2]["mask"], [1, 0, 0, 0])
    np.testing.assert_array_equal(p1[2]["y"][:1], last["y"][4:5])


def test_unpadded_short_last_batch_without_mask():
    batches = list(
        iter(
            _pipe(
                (np.arange(20), np.arange(20) * 2),
                drop_remainder=False,
                num_epochs=1,
                shuffle=False,
                process_index=1,
                process_count=2,
            )
        )
    )
    assert [len(b[0]) for b in batches] == [4, 4, 2]
    assert isinstance(batches[0], tuple)
    np.testing.assert_array_equal(batches[2][0], [18, 19])
    np.testing.assert_array_equal(batches[2][1], [36, 38])


def test_single_array_and_random_access():
    pipe = _pipe(np.arange(40), seed=9, num_epochs=1)
    assert pipe.process_local is True and pipe.global_batch_size == 8
    batches = list(iter(pipe))
    np.testing.assert_array_equal(pipe.batch(3), batches[3])
    np.testing.assert_array_equal(pipe.as_map_dataset()[4], batches[4])
    with pytest.raises(IndexError, match="step 5 is past the end: the pipeline has 5 steps"):
        pipe.batch(5)


def test_throughput_is_vectorised():
    # A loose floor (the benchmark is >1000/s): a per-example python loop would be far slower.
    import time

    rng = np.random.default_rng(0)
    data = {"image": rng.random((6000, 784), dtype=np.float32), "label": np.zeros(6000, np.int32)}
    it = iter(ArrayPipeline(data, global_batch_size=512, process_index=0, process_count=1))
    next(it)
    t = time.perf_counter()
    for _ in range(200):
        next(it)
    assert 200 / (time.perf_counter() - t) > 200


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (
            dict(global_batch_size=6, process_count=4),
            r"global_batch_size \(6\) must be divisible by process_count \(4\)",
        ),
        (
            dict(global_batch_size=0),
            r"global_batch_size must be an int >= 1; received global_batch_size=0",
        ),
        (
            dict(global_batch_size=64),
            r"global_batch_size \(64\) is larger than the dataset \(40 rows\)",
        ),
        (dict(seed=-1), r"seed must be an int >= 0; received seed=-1"),
        (dict(num_epochs=0), r"num_epochs must be an int >= 1"),
        (
            dict(process_index=2, process_count=2),
            r"process_index must be in \[0, process_count=2\); received process_index=2",
        ),
        (dict(mask_key="y"), r"mask_key='y' is already a key of data"),
        (
            dict(global_batch_size=16, drop_remainder=False, process_count=16),
            r"last batch is not padded: it has 8 rows .* process_count \(16\)",
        ),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _pipe(**kwargs)


def test_bad_data():
    with pytest.raises(ValueError, match=r"same leading length.*'a': 3, 'b': 4"):
        _pipe({"a": np.zeros(3), "b": np.zeros(4)}, global_batch_size=1)
    with pytest.raises(ValueError, match="data has no rows"):
        _pipe({"a": np.zeros((0, 2))})
    with pytest.raises(ValueError, match="mask_key needs a dict dataset"):
        _pipe((np.zeros(8),), mask_key="mask")
    with pytest.raises(ValueError, match=r"is a scalar; expected an array"):
        _pipe({"a": np.float32(1.0)})
    with pytest.raises(ValueError, match="data is an empty dict"):
        _pipe({})


def test_set_state_rejects_foreign_state():
    it = iter(_pipe(seed=1))
    with pytest.raises(ValueError, match=r"saved with seed=2 but this pipeline has seed=1"):
        it.set_state({"step": 3, "seed": 2})
    with pytest.raises(ValueError, match="must be a dict with a 'step' key"):
        it.set_state({"position": 3})
    with pytest.raises(ValueError, match=r"state\['step'\] must be an int >= 0"):
        it.set_state({"step": -1})
