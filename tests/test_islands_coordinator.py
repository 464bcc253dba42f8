"""The islands' coordinator under slow and failing saves, restarts inside a round and
hung islands (issue 50), in-process: the coordinator is a plain class (a Ray actor in a
run). The runs with real island processes are in tests/test_islands_faults.py.
"""

import json
import os
import threading
import time

import numpy as np
import optax
import pytest

from distrain._src.islands import island_coordinator as coordinator_module
from distrain._src.islands.island_coordinator import (
    IslandCoordinator,
    IslandsConfig,
    IslandsFailed,
    RejoinRequired,
    committed_rows,
    structure_of,
)

PARAMS = [np.zeros((3,), np.float32), np.ones((2, 2), np.float32)]
TREEDEF = "PyTreeDef({'a': *, 'b': *})"
STRUCTURE = structure_of(PARAMS, TREEDEF)


def _coordinator(tmp_path, cls=IslandCoordinator, **kw):
    config = dict(
        islands=2, sync_every=2, batch_size=2, num_rows=10, epochs=1, seed=None,
        death_timeout=0.6, heartbeat_interval=0.1, start_timeout=30.0,
    )  # fmt: skip
    return cls(IslandsConfig(**{**config, **kw}), PARAMS, TREEDEF, optax.sgd(1.0),
               str(tmp_path / "run"))  # fmt: skip


def _grads(value):
    return [np.full_like(p, value) for p in PARAMS]


def _events(tmp_path, kind):
    lines = [json.loads(x) for x in open(tmp_path / "run" / "events.jsonl")]
    return [e for e in lines if e["event"] == kind]


class _Beats:
    """Heartbeats for the given islands from a thread, as each island's own thread
    sends them; records the slowest call."""

    def __init__(self, coord, tokens):
        self.slowest = 0.0
        self._stop = threading.Event()

        def beat():
            while not self._stop.wait(0.05):
                for island, token in tokens.items():
                    t = time.time()
                    try:
                        coord.heartbeat(island, token)
                    except (RejoinRequired, IslandsFailed):
                        continue
                    self.slowest = max(self.slowest, time.time() - t)

        self._thread = threading.Thread(target=beat, daemon=True)
        self._thread.start()

    def stop(self):
        self._stop.set()
        self._thread.join(timeout=5)


def _start(coord):
    """Both islands join and lease round 0; returns their tokens."""
    tokens = {i: coord.join(i, STRUCTURE)[0] for i in (0, 1)}
    for i, t in tokens.items():
        coord.wait_round(i, t, -1)
        coord.lease(i, t, 0)
    return tokens


def test_a_round_save_longer_than_death_timeout_stops_no_heartbeat(tmp_path):
    class SlowSave(IslandCoordinator):  # a disk that takes 1 s, past death_timeout=0.6
        def _save(self, *args, **kwargs):
            time.sleep(1.0)
            return super()._save(*args, **kwargs)

    coord = _coordinator(tmp_path, SlowSave)
    tokens = _start(coord)
    beats = _Beats(coord, tokens)
    coord.submit(0, tokens[0], 0, _grads(1.0))
    t = time.time()
    coord.submit(1, tokens[1], 0, _grads(3.0))  # closes round 0: the slow save
    assert time.time() - t >= 1.0
    time.sleep(0.3)  # the watcher's next look, after the save
    beats.stop()
    assert not _events(tmp_path, "dead"), "a slow save declared live islands dead"
    assert beats.slowest < 0.5, f"a heartbeat waited {beats.slowest:.2f} s for the save"
    status = coord.status()
    assert status["alive"] == [0, 1] and status["round"] == 1
    r, params, _, _, _ = coord.wait_round(0, tokens[0], 0)
    assert r == 1
    np.testing.assert_allclose(params[0], PARAMS[0] - 2.0)
    coord.stop()


def test_an_island_restarted_after_it_submitted_waits_for_the_next_round(tmp_path):
    coord = _coordinator(tmp_path, death_timeout=30.0)  # no heartbeats here: no deaths
    tokens = _start(coord)
    coord.submit(1, tokens[1], 0, _grads(3.0))
    # Island 1 dies after submitting and its restart joins before round 0 closes: its
    # submission still counts, and the new process must not lease round 0 again.
    new, _ = coord.join(1, STRUCTURE)
    assert coord.wait_round(1, new, -1, timeout=0.3) is None  # round 0 is not its own
    with pytest.raises(RejoinRequired, match="enrolled in round 1"):
        coord.lease(1, new, 0)
    coord.submit(0, tokens[0], 0, _grads(1.0))
    r, params, finished, _, _ = coord.wait_round(1, new, -1, timeout=5)
    assert (r, finished) == (1, False)
    np.testing.assert_allclose(params[0], PARAMS[0] - 2.0)  # both submissions counted
    coord.leave(0, tokens[0])  # island 1 trains the last rows alone
    positions, _ = coord.lease(1, new, 1)
    assert len(positions) == 2  # 10 rows, 8 committed in round 0
    coord.submit(1, new, 1, _grads(1.0))
    _, _, finished, _, _ = coord.wait_round(1, new, 1, timeout=5)
    assert finished and np.array_equal(np.sort(committed_rows(str(tmp_path / "run"))),
                                       np.arange(10))  # fmt: skip
    coord.stop()


def test_a_failed_round_save_applies_nothing_and_says_why_in_one_line(tmp_path):
    # 1 s: long enough that a loaded machine does not declare the islands dead before they
    # submit (0.3 s did, once, at a load average of 10), short enough to wait out below.
    coord = _coordinator(tmp_path, death_timeout=1.0)
    tokens = _start(coord)
    # A real failure: the checkpoint directory's place holds a file.
    (tmp_path / "run" / "checkpoints").write_text("not a directory")
    coord.submit(0, tokens[0], 0, _grads(1.0))
    with pytest.raises(IslandsFailed) as failed:
        coord.submit(1, tokens[1], 0, _grads(3.0))
    message = str(failed.value)
    assert "\n" not in message
    assert "round 0's checkpoint could not be written" in message
    assert "NotADirectoryError" in message and "not applied" in message
    # Nothing was applied in memory, nor counted as committed on disk ...
    np.testing.assert_array_equal(coord.params()[0], PARAMS[0])
    assert coord.status()["round"] == 0 and coord.status()["committed_rows"] == 0
    assert len(committed_rows(str(tmp_path / "run"))) == 0
    # ... and no later trigger applies it again (the islands fall silent and die).
    time.sleep(1.3)
    np.testing.assert_array_equal(coord.params()[0], PARAMS[0])
    assert len(_events(tmp_path, "save_failed")) == 1
    with pytest.raises(IslandsFailed, match="could not be written"):
        coord.heartbeat(0, tokens[0])
    coord.stop()


def test_a_torn_newest_checkpoint_falls_back_to_the_previous_one(tmp_path):
    coord = _coordinator(tmp_path, num_rows=20)
    tokens = {i: coord.join(i, STRUCTURE)[0] for i in (0, 1)}
    after_one = None
    for r in range(2):  # two rounds: checkpoints round-1 and round-2
        for i in (0, 1):
            coord.wait_round(i, tokens[i], r - 1, timeout=5)
            assert coord.lease(i, tokens[i], r, timeout=10) is not None  # (2 s: short, loaded)
        for i in (0, 1):
            coord.submit(i, tokens[i], r, _grads(1.0))
        after_one = coord.params()[0] if r == 0 else after_one  # (the state of round 1)
    coord.stop()
    checkpoints = tmp_path / "run" / "checkpoints"
    assert sorted(os.listdir(checkpoints)) == ["round-0000001", "round-0000002"]
    # The parameters are in the shard holders' files (one shard per island).
    state = tmp_path / "run" / "shards" / "round-0000002" / "shard-1-of-2.npz"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])  # torn by a crash
    with pytest.warns(UserWarning, match=r"round-0000002 is unreadable .*resuming from round 1"):
        again = _coordinator(tmp_path, num_rows=20)
    assert again.status()["round"] == 1 and again.status()["committed_rows"] == 8
    np.testing.assert_array_equal(again.params()[0], after_one)
    # The rows of the round the torn checkpoint held are trained again: none is lost.
    assert np.array_equal(np.sort(committed_rows(str(tmp_path / "run"))), np.arange(8))
    again.stop()


def test_a_hung_island_that_still_heartbeats_is_dead_at_the_round_deadline(tmp_path):
    coord = _coordinator(tmp_path, round_timeout=0.8, death_timeout=30.0)
    tokens = _start(coord)
    leased = time.time()
    beats = _Beats(coord, tokens)  # both heartbeat; island 1's training loop hangs
    coord.submit(0, tokens[0], 0, _grads(1.0))
    r, params, _, hang_s, _ = coord.wait_round(0, tokens[0], 0, timeout=10)
    waited = time.time() - leased
    beats.stop()
    assert r == 1 and 0.8 <= waited < 3.0
    np.testing.assert_allclose(params[0], PARAMS[0] - 1.0)  # the round closed without it
    assert 0.6 < hang_s <= waited  # the survivor's wait beyond its own work
    (dead,) = _events(tmp_path, "dead")
    assert dead["island"] == 1 and dead["hung"] and dead["rows_returned"] == 4
    assert "no submission 0.8 s after its lease" in dead["why"]
    (record,) = _events(tmp_path, "round")
    assert record["hang_s"] == pytest.approx(hang_s)
    # Its late submission is discarded and it is told to rejoin, and why.
    with pytest.raises(RejoinRequired, match="declared dead: hung: .*round deadline"):
        coord.submit(1, tokens[1], 0, _grads(5.0))
    # Its new incarnation enrolls in round 1 and hangs before it leases: the round
    # started by island 0's lease does not wait for it past the deadline either.
    new, _ = coord.join(1, STRUCTURE)
    beats = _Beats(coord, {0: tokens[0], 1: new})
    coord.wait_round(0, tokens[0], 0, timeout=5)
    coord.lease(0, tokens[0], 1)
    coord.submit(0, tokens[0], 1, _grads(0.0))
    assert coord.wait_round(0, tokens[0], 1, timeout=10).round == 2
    beats.stop()
    assert "hung: no lease 0.8 s into its round" in _events(tmp_path, "dead")[-1]["why"]
    # The survivor trains the rows island 1 held: every row exactly once.
    after = 1
    while True:
        r, params, finished, _, _ = coord.wait_round(0, tokens[0], after, timeout=10)
        if finished:
            break
        positions, _ = coord.lease(0, tokens[0], r)
        coord.submit(0, tokens[0], r, _grads(0.0) if len(positions) else None)
        after = r
    assert np.array_equal(np.sort(committed_rows(str(tmp_path / "run"))), np.arange(10))
    coord.stop()


def test_the_round_deadline_follows_the_observed_round_times(tmp_path, monkeypatch):
    monkeypatch.setattr(coordinator_module, "ROUND_TIMEOUT_FLOOR", 0.3)
    coord = _coordinator(tmp_path, num_rows=40, death_timeout=30.0)
    assert coord.status()["round_deadline_s"] == 0.3  # nothing observed yet: the floor
    tokens = {i: coord.join(i, STRUCTURE)[0] for i in (0, 1)}
    for r in range(3):  # rounds of about 0.1 s
        for i in (0, 1):
            coord.wait_round(i, tokens[i], r - 1, timeout=5)
            coord.lease(i, tokens[i], r)
        time.sleep(0.1)
        for i in (0, 1):
            coord.submit(i, tokens[i], r, _grads(0.0))
    deadline = coord.status()["round_deadline_s"]
    assert 5 * 0.1 <= deadline < 5 * 0.3  # 5 x the median lease-to-submit time
    with pytest.raises(ValueError, match="round_timeout must be None or > 0"):
        IslandsConfig(islands=1, sync_every=1, batch_size=1, num_rows=1, round_timeout=0.0)
    coord.stop()


# ------------------------------------------------------------ healing (issue 57, item 4)


class _InProcess:
    """The island side's proxy calls (``remote.Coordinator``: ``__call__`` and ``poll``)
    on the in-process coordinator; in a run they go through Ray."""

    def __init__(self, coord):
        self.coord = coord

    def __call__(self, method, *args):
        return getattr(self.coord, method)(*args)

    def poll(self, method, *args, until=10.0):
        deadline = time.time() + until
        while (result := self(method, *args)) is None:
            assert time.time() < deadline, f"{method} had no answer for {until} s"
        return result


def test_a_rejoining_island_heals_from_a_live_peer_one_state_held_at_a_time(tmp_path, capsys):
    """A restarted island takes its live peer's inner optimizer state (Adam's moments),
    with the counts at round x H; the live island posts it once, at its next round
    boundary, and trains on; the coordinator holds it only until it is taken. Without a
    trained live peer, or when every peer started the joiner's round already, the joiner
    starts fresh at once and says so in one line. Another optimizer is refused."""
    import jax
    import jax.numpy as jnp

    import distrain as dt
    from distrain._src.islands.healing import Posted, StateRelay
    from distrain._src.islands.joining import Joiner

    tx = optax.adam(optax.linear_schedule(1e-2, 1e-3, 100))
    initial = dt.TrainState.create(params={"a": jnp.zeros(3), "b": jnp.ones((2, 2))}, tx=tx)
    logs = []

    def joiner(state=initial):
        return Joiner(state, heal=True, sync_every=2, log=lambda e, **f: logs.append((e, f)))

    def trained(state, steps):  # moments that are not the initial zeros
        for k in range(steps):
            grads = jax.tree.map(lambda p, k=k: jnp.full_like(p, k + 1.0), state.params)
            state = state.apply_gradients(grads=grads)
        return state

    # Deaths here are restarts (joins): the JAX work between calls may outlast 0.6 s.
    coord = _coordinator(tmp_path, num_rows=40, death_timeout=60.0, heartbeat_interval=1.0)
    proxy, adam = _InProcess(coord), joiner()
    tokens = {i: coord.join(i, STRUCTURE, adam.structure, True)[0] for i in (0, 1)}
    for i, t in tokens.items():  # round 0: no peer has trained, both start fresh at once
        r, params, *_ = coord.wait_round(i, t, -1)
        adam.start(proxy, i, t, r, dict(zip("ab", params, strict=True)), until=5)
        assert logs[-1][1]["healed_from"] is None and logs[-1][1]["counts"] == [0, 0]
    assert "no live peer has trained a round" in logs[-2][1]["why"]
    assert capsys.readouterr().out == ""  # round 0: every island starts fresh, silently
    for i, t in tokens.items():
        coord.lease(i, t, 0)
    for i, t in tokens.items():
        coord.submit(i, t, 0, _grads(0.5))
    for i, t in tokens.items():
        assert coord.wait_round(i, t, 0).donate is False  # nobody waits for a state
        coord.lease(i, t, 1)
    live = trained(initial, 2)  # island 0's state after round 1's inner steps
    # Island 1 restarts mid-round 1: its lease goes back, it enrolls in round 2.
    rejoined, _ = coord.join(1, STRUCTURE, adam.structure, True)
    assert coord.status()["healing"] == [1]
    coord.submit(0, tokens[0], 1, _grads(0.5))
    assert coord.wait_round(0, tokens[0], 1).donate is True  # asked at its boundary
    posted = Joiner.donation(live)
    assert proxy("donate", 0, tokens[0], 2, posted) is True
    assert coord.status()["healing_bytes_held"] == sum(x.nbytes for x in posted) > 0
    r, params, _, _, donate = coord.wait_round(1, rejoined, -1)
    assert (r, donate) == (2, False)
    healed = joiner().start(proxy, 1, rejoined, r, dict(zip("ab", params, strict=True)), 5)
    assert int(healed.step) == 4 and logs[-1][1] == {
        "round": 2, "step": 4, "counts": [4, 4], "healed_from": 0
    }  # fmt: skip
    mu, nu = healed.opt_state[0].mu, healed.opt_state[0].nu
    for got, want in zip(jax.tree.leaves((mu, nu)),
                         jax.tree.leaves((live.opt_state[0].mu, live.opt_state[0].nu)),
                         strict=True):  # fmt: skip
        np.testing.assert_array_equal(got, want)
        assert np.any(np.asarray(want) != 0)
    assert coord.status()["healing"] == [] and coord.status()["healing_bytes_held"] == 0
    assert [e["donor"] for e in _events(tmp_path, "healed")] == [0]
    # Restarted again before anyone leased round 2: it enrolls in round 2, whose boundary
    # island 0 has passed: no peer can be asked in time, it starts fresh at once.
    again, _ = coord.join(1, STRUCTURE, adam.structure, True)
    r, params, *_ = coord.wait_round(1, again, -1)
    fresh = adam.start(proxy, 1, again, r, dict(zip("ab", params, strict=True)), until=5)
    assert logs[-2][1]["wait_s"] < 1.0 and logs[-1][1]["healed_from"] is None
    np.testing.assert_array_equal(fresh.opt_state[0].mu["a"], np.zeros(3))
    line = "island 1: no live peer to heal from (every live peer had started round 2 before it "
    assert capsys.readouterr().out.startswith(line)
    assert "every live peer had started round 2" in _events(tmp_path, "heal_fallback")[-1]["why"]
    # Another optimizer: refused when it asks to heal, in one line; nothing changes.
    sgd = joiner(dt.TrainState.create(params=initial.params, tx=optax.sgd(0.1, momentum=0.9)))
    message = r"island 1 cannot heal from island 0: their inner optimizer states differ\. Expected"
    with pytest.raises(ValueError, match=message) as refused:
        coord.join(1, STRUCTURE, sgd.structure, True)
    assert "\n" not in str(refused.value) and "heal_from_peer=False" in str(refused.value)
    coord.heartbeat(1, again)  # still the live incarnation
    with pytest.raises(ValueError, match=message):  # a state that reaches it anyway
        sgd._unflatten(posted, 1, 0)
    relay = StateRelay()
    relay.want(1, sgd.structure)
    assert relay.ask(0, joiners=[1])
    assert relay.post(Posted(0, 2, adam.structure, posted))
    with pytest.raises(ValueError, match=message):
        relay.take(1, 2)
    relay.forget(1)  # the joiner died before it took the state: nobody needs it
    assert relay.posted is None and relay.held_bytes() == 0
