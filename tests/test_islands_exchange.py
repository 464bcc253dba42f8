"""The islands' sharded exchange (issue 57 item 2), in-process: the parameters and the
outer optimizer state live in shard holders (``param_shards.py``), the coordinator
keeps the rounds and the ledger, and its checkpoint is the commit point of a round.
With real Ray actors and SIGKILLs: tests/test_islands_faults.py.
"""

import json
import os
import threading
import time

import numpy as np
import optax
import pytest

from distrain._src.islands import param_shards
from distrain._src.islands.island_coordinator import (
    IslandCoordinator,
    IslandsConfig,
    IslandsFailed,
    committed_rows,
    structure_of,
)

# Odd sizes: 5 + 12 + 7 = 24 elements; 3 shards cut at 8 and 16, both inside leaf 1.
PARAMS = [
    np.arange(5, dtype=np.float32) / 3,
    np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4),
    np.full((7,), 0.25, np.float32),
]
TREEDEF = "PyTreeDef([*, *, *])"
STRUCTURE = structure_of(PARAMS, TREEDEF)
NESTEROV = optax.sgd(0.7, momentum=0.9, nesterov=True)  # DiLoCo's outer optimizer


def _coordinator(run, holders=None, cls=IslandCoordinator, **kw):
    config = dict(
        islands=2, sync_every=2, batch_size=2, num_rows=22, epochs=1, seed=None,
        death_timeout=60.0, heartbeat_interval=0.1, start_timeout=30.0,
    )  # fmt: skip
    return cls(IslandsConfig(**{**config, **kw}), PARAMS, TREEDEF, NESTEROV, str(run), holders)


def _grads(seed):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(p.shape).astype(np.float32) for p in PARAMS]


def _round(coord, tokens, r, submit=None):
    """Both islands lease round ``r`` and submit seeded pseudo-gradients (``submit``
    calls the closing one, island 1's); returns each island's rows."""
    rows = {}
    for i, t in tokens.items():
        coord.wait_round(i, t, r - 1, timeout=10)
        rows[i] = len(coord.lease(i, t, r, timeout=10)[0])
    coord.submit(0, tokens[0], r, _grads(10 * r) if rows[0] else None)
    (submit or coord.submit)(1, tokens[1], r, _grads(10 * r + 1) if rows[1] else None)
    return rows


def _start(coord):
    return {i: coord.join(i, STRUCTURE)[0] for i in (0, 1)}


def test_the_sharded_rounds_equal_the_star_bit_for_bit(tmp_path):
    """S=3 (boundaries inside a leaf) gives exactly S=1's parameters after 3 rounds, the
    last one with uneven row weights (4 and 2 rows); both match the star's arithmetic,
    and each holder receives only its shard of each pseudo-gradient."""
    finals, received = {}, {}
    for shards in (1, 3):
        coord = _coordinator(tmp_path / f"s{shards}", exchange_shards=shards)
        tokens = _start(coord)
        for r in range(3):
            rows = _round(coord, tokens, r)
        assert rows == {0: 4, 1: 2} and coord.status()["round"] == 3
        finals[shards] = coord.params()
        received[shards] = [h.bytes_received for h in coord._exchange.holders.holders]
        coord.stop()
    for a, b in zip(finals[1], finals[3], strict=True):
        np.testing.assert_array_equal(a, b)
    nbytes = sum(p.nbytes for p in PARAMS)  # 96: 2 islands x 3 rounds each time
    assert received[1] == [6 * nbytes] and received[3] == [6 * nbytes // 3] * 3
    # The star, as the coordinator computed it before the shards (NumPy mean, optax).
    params, state = [p.copy() for p in PARAMS], NESTEROV.init(PARAMS)
    for r, weights in enumerate([(0.5, 0.5), (0.5, 0.5), (4 / 6, 2 / 6)]):
        g0, g1 = _grads(10 * r), _grads(10 * r + 1)
        mean = [a * weights[0] + b * weights[1] for a, b in zip(g0, g1, strict=True)]
        updates, state = NESTEROV.update(mean, state, params)
        params = [np.asarray(x) for x in optax.apply_updates(params, updates)]
    for a, b in zip(finals[3], params, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    assert not np.allclose(finals[3][1], PARAMS[1])
    assert sorted(os.listdir(tmp_path / "s3" / "shards")) == ["round-0000002", "round-0000003"]


def test_a_restart_between_the_shards_save_and_the_commit_resumes_the_round_before(tmp_path):
    """The holders saved round 2, the coordinator died before its checkpoint (the commit
    point): a new coordinator resumes at round 1 with round 1's parameters and momentum,
    the uncommitted shards are deleted, and round 1's rows are trained again, once."""
    gate = threading.Event()

    class Dies(IslandCoordinator):  # its process "dies" in round 1's commit
        def _save(self, r, *args):
            if r == 1:
                gate.wait(30)
                raise OSError("the old coordinator's process is gone")
            return super()._save(r, *args)

    run = tmp_path / "run"
    coord = _coordinator(run, cls=Dies)
    tokens = _start(coord)
    _round(coord, tokens, 0)
    after_one = coord.params()
    closing = threading.Thread(target=lambda: _round(coord, tokens, 1, _quiet(coord)))
    closing.start()
    staged = run / "shards" / "round-0000002"
    deadline = time.time() + 30
    while len(list(staged.glob("*.npz")) if staged.exists() else []) < 2:
        assert time.time() < deadline, "the holders never saved round 2"
        time.sleep(0.02)
    again = _coordinator(run)  # the restarted coordinator, the old one still mid-commit
    assert again.status()["round"] == 1 and again.status()["committed_rows"] == 8
    assert not staged.exists()  # saved, never committed: deleted
    for a, b in zip(again.params(), after_one, strict=True):
        np.testing.assert_array_equal(a, b)
    gate.set()
    closing.join(timeout=30)
    coord.stop()
    # Trained again, the rounds give what an uninterrupted run gives, every row once.
    tokens = _start(again)
    for r in (1, 2):
        _round(again, tokens, r)
    straight = _coordinator(tmp_path / "straight")
    t = _start(straight)
    for r in range(3):
        _round(straight, t, r)
    for a, b in zip(again.params(), straight.params(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert np.array_equal(np.sort(committed_rows(str(run))), np.arange(22))
    again.stop()
    straight.stop()


def _quiet(coord):
    """Island 1's closing submission, whose failure (the old coordinator's) is expected."""

    def submit(*args):
        try:
            coord.submit(*args)
        except IslandsFailed:
            pass

    return submit


def test_a_shard_that_cannot_be_saved_or_served_stops_the_run_in_one_line(tmp_path):
    """A holder's save fails: nothing is applied. A holder that cannot serve a committed
    round: the round stays committed, the run stops, and a restart resumes after it."""
    run = tmp_path / "run"
    coord = _coordinator(run)
    tokens = _start(coord)
    (run / "shards").write_text("not a directory")  # a real failure of every holder
    with pytest.raises(IslandsFailed) as failed:
        _round(coord, tokens, 0)
    message = str(failed.value)
    assert "\n" not in message and "not applied" in message
    assert "round 0's update in the parameter shards failed (ShardFailed: shard 0 could " in message
    assert "NotADirectoryError" in message
    assert coord.status()["round"] == 0 and not (run / "checkpoints").exists()
    np.testing.assert_array_equal(coord.params()[1], PARAMS[1])
    coord.stop()
    (run / "shards").unlink()

    # Committed, then holder 0 lost its staged shard and its file (a restart, a disk).
    class Unserved(IslandCoordinator):
        def _save(self, r, *args):
            super()._save(r, *args)
            holders = self._exchange.holders.holders
            holders[0]._staged = None
            os.remove(param_shards.shard_path(self.directory, r + 1, 0, 2))

    coord = _coordinator(tmp_path / "unserved", cls=Unserved)
    tokens = _start(coord)
    served = r"^round 0 was committed, but a shard holder could not serve round 1 \(FileNotFound"
    with pytest.raises(IslandsFailed, match=served + r"Error: .*resumes from round 1\.$"):
        _round(coord, tokens, 0)
    coord.stop()
    assert len(committed_rows(str(tmp_path / "unserved"))) == 8


def test_a_round_a_restarted_holder_lost_is_trained_again_and_the_run_ends_the_same(tmp_path):
    """Ray restarted holder 1 after island 0 sent it its shard of round 0: the mean
    cannot be taken, so nothing is applied, the round's rows go back to the front of the
    queue, and wait_round gives round 0 again, once, to each island that submitted it.
    Trained again, the run ends bit for bit as the run without the restart: the same
    parameters and the same rows, each committed once."""
    def run(directory, lose=False):
        coord = _coordinator(directory)
        tokens = _start(coord)
        holders = coord._exchange.holders.holders

        def restart_holder_1(*args):  # what Ray does to a holder whose process died
            holders[1] = param_shards.ShardHolder(holders[1].directory, 1, 2,
                                                  [np.asarray(p) for p in holders[1]._params],
                                                  NESTEROV)  # fmt: skip
            coord.submit(*args)

        if lose:
            _round(coord, tokens, 0, restart_holder_1)  # no error: the round is retried
            assert coord.status()["round"] == 0 and not (directory / "checkpoints").exists()
            for i, t in tokens.items():  # round 0 again, once (then the open round waits)
                assert coord.wait_round(i, t, 0, timeout=5).round == 0
                assert coord.wait_round(i, t, 0, timeout=0.2) is None
        rows = [_round(coord, tokens, r) for r in range(3)]  # 8 + 8 + 6 of the 22 rows
        params = coord.params()
        coord.stop()
        return rows, params, committed_rows(str(directory))

    reference = run(tmp_path / "reference")
    lost = run(tmp_path / "lost", lose=True)
    assert lost[0] == reference[0] == [{0: 4, 1: 4}, {0: 4, 1: 4}, {0: 4, 1: 2}]
    for got, want in zip(lost[1], reference[1], strict=True):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(lost[2], reference[2])
    assert np.array_equal(np.sort(lost[2]), np.arange(22))
    events = [json.loads(x) for x in (tmp_path / "lost" / "events.jsonl").read_text().splitlines()]
    [retried] = [e for e in events if e["event"] == "round_retried"]
    assert (retried["round"], retried["islands"], retried["rows_returned"]) == (0, [0, 1], 8)
    assert retried["error"].startswith("update in the parameter shards failed (PseudoGradient"
                                       "Lost: shard 1 of 2 has no pseudo-gradient of island 0 "
                                       "for round 0 (the holder restarted")  # fmt: skip
    assert not any(e["event"] in ("failed", "save_failed") for e in events)


def test_checkpoints_that_cannot_resume_are_refused_in_one_line(tmp_path):
    """The star's checkpoints (parameters inside), another number of shards, and holders
    that served a later round than any checkpoint: each refused in one line."""
    old = tmp_path / "old" / "checkpoints" / "round-0000001"
    old.mkdir(parents=True)
    np.savez(old / "state.npz", p0=PARAMS[0], p1=PARAMS[1], p2=PARAMS[2])
    (old / "meta.json").write_text(json.dumps({"round": 1, "structure": STRUCTURE}))
    star = r"round-0000001 holds a checkpoint of the islands' star exchange .* or start this"
    with pytest.raises(ValueError, match=star + r" one in another directory\.$") as e:
        _coordinator(tmp_path / "old")
    assert "\n" not in str(e.value)

    coord = _coordinator(tmp_path / "run")  # 2 shards: one per island
    tokens = _start(coord)
    _round(coord, tokens, 0)
    holders = coord._exchange.holders
    coord.stop()
    other = r"holds the parameters in 2 shards; this run has exchange_shards=3 \(3 shards\)\. "
    with pytest.raises(ValueError, match=other + r"Resume with exchange_shards=2\.$"):
        _coordinator(tmp_path / "run", exchange_shards=3)
    for name in ("checkpoints", "rows"):
        for path in sorted((tmp_path / "run" / name).rglob("*"), reverse=True):
            path.rmdir() if path.is_dir() else path.unlink()
    later = r"holds no checkpoint, but its shard holders served a later round \(shard 0 holds "
    with pytest.raises(ValueError, match=later + r"round 1 and has no file of round 0\)"):
        _coordinator(tmp_path / "run", holders=holders)  # the detached actors of a wiped run
    with pytest.raises(ValueError, match=r"exchange_shards must be None .* or >= 1\. Received: "
                       "exchange_shards=0"):  # fmt: skip
        IslandsConfig(islands=2, sync_every=1, batch_size=1, num_rows=4, exchange_shards=0)


@pytest.mark.parametrize(
    "optimizer, elementwise",
    [
        (NESTEROV, True),
        (optax.adam(0.1), True),
        (optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.7)), False),  # global norm
        (optax.lamb(0.1), False),  # a trust ratio per leaf
        (optax.adafactor(0.1), False),  # a factored second moment (the 130 x 130 leaf)
    ],
    ids=["nesterov", "adam", "clip_global_norm", "lamb", "adafactor"],
)
def test_an_outer_optimizer_that_is_not_elementwise_is_refused_in_one_line(
    tmp_path, optimizer, elementwise
):
    # A holder updates its 1-D segments alone: anything but an elementwise update would
    # silently differ from the whole leaves' (the coordinator, and islands.train, refuse).
    if elementwise:
        param_shards.check_elementwise(optimizer)
        return
    config = IslandsConfig(islands=2, sync_every=2, batch_size=2, num_rows=22)
    with pytest.raises(ValueError, match="must update every element from its own values"):
        IslandCoordinator(config, PARAMS, TREEDEF, optimizer, str(tmp_path))
    assert not os.path.exists(tmp_path / "shards")  # refused before anything was written


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_an_outer_codec_packs_each_segment_and_the_holders_average_its_decoding(tmp_path, codec):
    """`outer_dtype` on the fault-isolated path: each island packs every segment it sends
    (absmax per segment, S = 3 cuts inside a leaf), the holders receive the codec's bytes
    and average the decoded values: the star's arithmetic on the decoded segments."""
    from distrain._src.islands import codecs

    coord = _coordinator(tmp_path, exchange_shards=3, outer_dtype=codec)
    tokens = _start(coord)
    for r in range(3):
        _round(coord, tokens, r)
    final = coord.params()
    plan = coord._exchange.plan
    received = [h.bytes_received for h in coord._exchange.holders.holders]
    coord.stop()

    def decoded(grads):  # what the holders average: each segment through the codec
        parts = [[codecs.unpack(codecs.pack(x, codec), x.size) for x in param_shards.split(
            grads, segments)] for segments in plan]  # fmt: skip
        return param_shards.join(parts, plan, param_shards.specs_of(PARAMS))

    params, state = [p.copy() for p in PARAMS], NESTEROV.init(PARAMS)
    for r, weights in enumerate([(0.5, 0.5), (0.5, 0.5), (4 / 6, 2 / 6)]):
        g0, g1 = decoded(_grads(10 * r)), decoded(_grads(10 * r + 1))
        mean = [a * weights[0] + b * weights[1] for a, b in zip(g0, g1, strict=True)]
        updates, state = NESTEROV.update(mean, state, params)
        params = [np.asarray(x) for x in optax.apply_updates(params, updates)]
    for a, b in zip(final, params, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    # 6 submissions per holder (2 islands x 3 rounds), each its segments' payloads.
    per_holder = [sum(codecs.payload_bytes((s.stop - s.start,), codec) for s in segs)
                  for segs in plan]  # fmt: skip
    assert received == [6 * b for b in per_holder]
    assert sum(per_holder) < sum(p.nbytes for p in PARAMS)  # tiny leaves: the scales weigh

    holder = param_shards.LocalHolders.of(str(tmp_path / "h"), PARAMS, 1, NESTEROV).holders[0]
    short = codecs.pack(np.ones(3, np.float32), codec)
    with pytest.raises(ValueError, match=f"a {codec} segment of 5 elements is"):
        holder.put(0, "t", 0, [short, PARAMS[1].ravel(), PARAMS[2]])
    with pytest.raises(ValueError, match="outer_dtype must be one of"):
        _coordinator(tmp_path / "bad", outer_dtype="int2")
