"""Fault-isolated islands (issue 38): the row ledger, the coordinator, and real runs.

The coordinator and the ledger are exercised in-process (they are plain classes; in a
run they live in a Ray actor). The runs start `distrain launch --islands 2` with a real
local Ray cluster, SIGKILL an island and the coordinator's actor process, and count the
committed rows by id.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import optax
import pytest

from distrain._src.goodput.report import report
from distrain._src.islands.coordinator import (
    IslandCoordinator,
    IslandsConfig,
    IslandsFailed,
    RejoinRequired,
    committed_rows,
)
from distrain._src.islands.island import random_access
from distrain._src.islands.rows import RowLedger

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "islands_train.py"
PARAMS = [np.zeros((3,), np.float32), np.ones((2, 2), np.float32)]
TREEDEF = "PyTreeDef({'a': *, 'b': *})"


def _config(**kw):
    base = dict(
        islands=2, sync_every=2, batch_size=2, num_rows=10, epochs=1, seed=None,
        death_timeout=0.6, heartbeat_interval=0.1, start_timeout=30.0,
    )  # fmt: skip
    return IslandsConfig(**{**base, **kw})


def _coordinator(tmp_path, tx=None, **kw):
    return IslandCoordinator(
        _config(**kw), PARAMS, TREEDEF, tx or optax.sgd(1.0), str(tmp_path / "run")
    )


def _structure(params=PARAMS, treedef=TREEDEF):
    from distrain._src.islands.coordinator import structure_of

    return structure_of(params, treedef)


def _round(coord, island, token, after, grad_value):
    """One island's round: wait, lease, submit a constant pseudo-gradient."""
    r, params, finished = coord.wait_round(island, token, after, timeout=10)
    if finished:
        return r, None, True
    positions, _ = coord.lease(island, token, r, timeout=10)
    grads = None if not len(positions) else [np.full_like(p, grad_value) for p in params]
    coord.submit(island, token, r, grads, {"loss": 0.0})
    return r, positions, False


# ----------------------------------------------------------------------- the ledger


def test_row_ledger_gives_every_position_once_through_deaths_and_a_restore():
    rng = np.random.default_rng(0)
    ledger = RowLedger(num_rows=37, epochs=3, seed=5)
    committed = []
    while not ledger.exhausted:
        alive = [i for i in range(3) if rng.random() > 0.3] or [0]
        for i in alive:
            ledger.lease(i, 8)
        dead = [i for i in alive if rng.random() < 0.3]
        for i in dead:
            ledger.give_back(i)
        live = [i for i in alive if i not in dead]
        for i in live:
            ledger.submitted(i)
        committed.append(ledger.commit(live))
        ledger = RowLedger.from_state(ledger.state_dict())  # a checkpoint every round
    positions = np.concatenate(committed)
    assert np.array_equal(np.sort(positions), np.arange(37 * 3))
    epochs, rows = ledger.rows(np.arange(37 * 3))
    for e in range(3):  # each epoch is a permutation of the rows, seeded per epoch
        assert sorted(rows[epochs == e]) == list(range(37))
    assert not np.array_equal(rows[epochs == 0], rows[epochs == 1])


def test_row_ledger_refuses_a_second_lease_and_saves_open_leases_as_returned():
    ledger = RowLedger(10, 1, None)
    ledger.lease(0, 4)
    with pytest.raises(RuntimeError, match="still holds a lease"):
        ledger.lease(0, 4)
    ledger.lease(1, 2)
    ledger.submitted(1)
    restored = RowLedger.from_state(ledger.state_dict())  # neither lease was committed
    assert restored.lease(0, 10).tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    with pytest.raises(ValueError, match="num_rows >= 1"):
        RowLedger(0, 1, None)


# ------------------------------------------------------------------ the coordinator


def test_a_round_applies_the_row_weighted_mean_through_the_outer_optimizer(tmp_path):
    # 10 rows, leases of 4: round 0 gives 4 + 4 rows, round 1 gives 2 + 0.
    coord = _coordinator(tmp_path)
    t0, t1 = coord.join(0, _structure())[0], coord.join(1, _structure())[0]
    coord.wait_round(0, t0, -1)
    coord.wait_round(1, t1, -1)
    p0, _ = coord.lease(0, t0, 0)
    p1, _ = coord.lease(1, t1, 0)
    assert (len(p0), len(p1)) == (4, 4)
    coord.submit(0, t0, 0, [np.full_like(p, 1.0) for p in PARAMS])
    assert coord.status()["round"] == 0  # waits for island 1
    coord.submit(1, t1, 0, [np.full_like(p, 3.0) for p in PARAMS])
    r, params, finished = coord.wait_round(0, t0, 0)
    assert (r, finished) == (1, False)
    np.testing.assert_allclose(params[0], PARAMS[0] - 2.0)  # sgd(1.0) of the mean 2.0
    q0, _ = coord.lease(0, t0, 1)
    q1, _ = coord.lease(1, t1, 1)
    assert (len(q0), len(q1)) == (2, 0)
    coord.submit(1, t1, 1, None)
    coord.submit(0, t0, 1, [np.full_like(p, 0.5) for p in PARAMS])
    _, params, finished = coord.wait_round(1, t1, 1)
    assert finished  # an island with no rows does not dilute the mean
    np.testing.assert_allclose(params[0], PARAMS[0] - 2.5)
    assert np.array_equal(np.sort(committed_rows(str(tmp_path / "run"))), np.arange(10))
    coord.stop()


def test_a_silent_island_is_dead_its_rows_go_to_the_survivor_and_none_is_lost(tmp_path):
    coord = _coordinator(tmp_path)
    t0, t1 = coord.join(0, _structure())[0], coord.join(1, _structure())[0]
    coord.wait_round(1, t1, -1)
    lost_lease = coord.lease(1, t1, 0)[0]
    # Island 1 leased rows and falls silent; island 0 keeps beating and training.
    stop = threading.Event()

    def beat():
        while not stop.wait(0.05):
            try:
                coord.heartbeat(0, t0)
            except RejoinRequired:
                return

    threading.Thread(target=beat, daemon=True).start()
    after, trained = -1, []
    while True:
        r, positions, finished = _round(coord, 0, t0, after, 1.0)
        if finished:
            break
        trained.append(positions)
        after = r
    stop.set()
    events = [json.loads(x) for x in open(tmp_path / "run" / "events.jsonl")]
    dead = [e for e in events if e["event"] == "dead"]
    assert dead and dead[0]["island"] == 1 and dead[0]["rows_returned"] == len(lost_lease) == 4
    assert "no heartbeat for 0.6 s" in dead[0]["why"]
    assert set(lost_lease) <= set(np.concatenate(trained))  # the survivor trained them
    assert np.array_equal(np.sort(committed_rows(str(tmp_path / "run"))), np.arange(10))
    with pytest.raises(RejoinRequired, match="declared dead"):
        coord.submit(1, t1, 0, [np.zeros_like(p) for p in PARAMS])
    coord.stop()


def test_a_restarted_coordinator_resumes_its_checkpoint_and_old_tokens_rejoin(tmp_path):
    coord = _coordinator(tmp_path, tx=optax.sgd(0.1, momentum=0.9), num_rows=20)
    t0, t1 = coord.join(0, _structure())[0], coord.join(1, _structure())[0]
    for after in (-1, 0):
        _round(coord, 0, t0, after, 1.0)
        _round(coord, 1, t1, after, 1.0)
    # Round 2 is under way when the coordinator "dies": its lease is not committed.
    coord.wait_round(0, t0, 1)
    coord.lease(0, t0, 2)
    before, status = coord.params(), coord.status()
    coord.stop()
    again = _coordinator(tmp_path, tx=optax.sgd(0.1, momentum=0.9), num_rows=20)
    assert again.status()["round"] == 2 == status["round"]
    assert again.status()["committed_rows"] == 16
    for a, b in zip(again.params(), before, strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(RejoinRequired, match="restarted from its checkpoint"):
        again.lease(0, t0, 2)
    # The momentum was restored too: the next update equals the uninterrupted one's.
    (n0, steps0), (n1, steps1) = again.join(0, _structure()), again.join(1, _structure())
    assert (steps0, steps1) == (4, 4)  # two applied rounds of 2 inner steps each
    _round(again, 0, n0, -1, 1.0)
    _round(again, 1, n1, -1, 1.0)
    _, params, finished = again.wait_round(0, n0, 2)
    assert finished and np.array_equal(
        np.sort(committed_rows(str(tmp_path / "run"))), np.arange(20)
    )
    # sgd(0.1, momentum 0.9) on a constant 1.0: steps of 0.1, 0.19, 0.271.
    np.testing.assert_allclose(params[0], PARAMS[0] - (0.1 + 0.19 + 0.271), rtol=1e-6)
    again.stop()


def test_below_min_islands_the_round_waits_then_every_call_fails(tmp_path):
    coord = _coordinator(tmp_path, min_islands=2, min_islands_timeout=1.0, death_timeout=0.3)
    t0, t1 = coord.join(0, _structure())[0], coord.join(1, _structure())[0]
    coord.wait_round(0, t0, -1)
    coord.lease(0, t0, 0)
    coord.lease(1, t1, 0)
    deadline = time.time() + 10
    with pytest.raises(IslandsFailed, match="fewer than min_islands=2"):
        while time.time() < deadline:
            coord.heartbeat(0, t0)
            time.sleep(0.05)
    coord.stop()


def test_wrong_input_is_refused_and_nothing_is_applied(tmp_path):
    with pytest.raises(ValueError, match="min_islands=3 is more than the islands started"):
        _config(min_islands=3)
    with pytest.raises(ValueError, match="heartbeat_interval < death_timeout"):
        _config(death_timeout=0.1, heartbeat_interval=0.5)
    coord = _coordinator(tmp_path)
    other = [np.zeros((4,), np.float32), np.ones((2, 2), np.float32)]
    with pytest.raises(ValueError, match=r"another parameter structure[\s\S]*float32\[4\]"):
        coord.join(1, _structure(other))
    with pytest.raises(ValueError, match="island 2 is not one of the 2 islands"):
        coord.join(2, _structure())[0]
    t0 = coord.join(0, _structure())[0]
    coord.join(1, _structure())[0]
    coord.wait_round(0, t0, -1)
    coord.lease(0, t0, 0)
    with pytest.raises(ValueError, match="pseudo-gradient has shapes"):
        coord.submit(0, t0, 0, [np.zeros((4,), np.float32), PARAMS[1]])
    assert coord.status()["committed_rows"] == 0
    np.testing.assert_array_equal(coord.params()[0], PARAMS[0])
    coord.stop()
    with pytest.raises(ValueError, match="holds a checkpoint of another model"):
        _round_trip_other_model(tmp_path)


def _round_trip_other_model(tmp_path):
    coord = _coordinator(tmp_path / "b")
    t0, t1 = coord.join(0, _structure())[0], coord.join(1, _structure())[0]
    _round(coord, 0, t0, -1, 1.0)
    _round(coord, 1, t1, -1, 1.0)
    coord.stop()
    other = [np.zeros((4,), np.float32), np.ones((2, 2), np.float32)]
    IslandCoordinator(_config(), other, TREEDEF, optax.sgd(1.0), str(tmp_path / "b" / "run"))


def test_datasets_without_random_access_are_refused():
    def gen():
        yield {"x": np.zeros(3)}

    for bad in (gen(), iter([1, 2]), "text"):
        with pytest.raises(TypeError, match="need a random-access dataset"):
            random_access(bad)
    with pytest.raises(ValueError, match="different lengths"):
        random_access({"x": np.zeros((3, 2)), "y": np.zeros(4)})
    n, take = random_access({"x": np.arange(6).reshape(3, 2)})
    assert n == 3 and take(np.array([2, 0]))["x"].tolist() == [[4, 5], [0, 1]]

    class Source:  # grain's RandomAccessDataSource protocol
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return {"x": np.full(2, i)}

    n, take = random_access(Source())
    assert n == 4 and take(np.array([3, 1]))["x"].tolist() == [[3, 3], [1, 1]]


def test_a_joining_island_starts_from_the_global_params_and_a_fresh_optimizer():
    import jax
    import jax.numpy as jnp

    import distrain as dt
    from distrain._src.islands.island import joined_state

    initial = dt.TrainState.create(params={"w": jnp.zeros(2)}, tx=optax.adam(0.1))
    state = joined_state(initial, {"w": np.full(2, 5.0, np.float32)}, step=40)
    assert int(state.step) == 40 and state.params["w"].tolist() == [5.0, 5.0]
    for got, want in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(initial.opt_state),
                         strict=True):  # fmt: skip
        np.testing.assert_array_equal(got, want)


def test_train_checks_its_arguments_before_it_connects(tmp_path, monkeypatch):
    import jax.numpy as jnp

    import distrain as dt

    state = dt.TrainState.create(params={"w": jnp.zeros(2)}, tx=optax.sgd(0.1))
    data = {"x": np.zeros((10, 2), np.float32)}
    train = dt.experimental.islands.train
    monkeypatch.delenv("DISTRAIN_ISLAND", raising=False)
    with pytest.raises(ValueError, match="needs this island's id"):
        train(None, state, data, batch_size=2, sync_every=2, directory=str(tmp_path))
    with pytest.raises(ValueError, match="must both split over the island's 8 replicas"):
        train(None, state, data, batch_size=4, sync_every=2, directory=str(tmp_path),
              island=0, islands=1)  # fmt: skip
    monkeypatch.setenv("DISTRAIN_NUM_PROCESSES", "2")
    with pytest.raises(ValueError, match="one process per island in this release"):
        train(None, state, data, batch_size=8, sync_every=2, directory=str(tmp_path),
              island=0, islands=2, epochs=4)  # fmt: skip
    monkeypatch.delenv("DISTRAIN_NUM_PROCESSES")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(RuntimeError, match="need one Ray cluster"):
        train(None, state, data, batch_size=8, sync_every=2, directory=str(tmp_path),
              island=0, islands=2, epochs=4)  # fmt: skip


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--islands", "2", "--gpus-per-proc", "1"], "does not split GPUs between islands"),
        (["--nproc", "2", "--nproc-per-island", "2"], "--nproc-per-island goes with --islands"),
        (["--islands", "2", "--port", "1234"], "each island has its own"),
    ],
)
def test_launcher_island_options_are_checked(argv, message, capsys):
    from distrain._src.cluster.launch import main

    # In-process: the options are checked before anything starts.
    assert main([*argv, "--", sys.executable, "-c", "0"]) == 2
    assert message in capsys.readouterr().err


def test_each_cluster_has_its_own_token_unless_the_user_set_one(monkeypatch):
    from distrain._src.islands.launch import _ray_env

    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    first, second = _ray_env(), _ray_env()
    assert first["RAY_AUTH_MODE"] == "token" and len(first["RAY_AUTH_TOKEN"]) == 64
    assert first["RAY_AUTH_TOKEN"] != second["RAY_AUTH_TOKEN"]
    for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        with monkeypatch.context() as m:
            m.setenv(name, "the user's")
            assert "RAY_AUTH_TOKEN" not in _ray_env()


# --------------------------------------------------------------------- real runs


def _lines(path):
    try:
        return [json.loads(x) for x in open(path) if x.strip()]
    except FileNotFoundError:
        return []


def _run_with_kills(run, plan, extra=(), rows=2048, epochs=2):
    """Runs 2 islands of SCRIPT under `distrain launch --islands 2`; SIGKILLs
    ``plan``'s targets in turn ("island": island 1's process, "coordinator": the
    coordinator actor's), each after the target's third round since it (re)started.
    Returns the launcher's exit status, its output, and the plan left undone."""
    cmd = [
        sys.executable, "-m", "distrain.cli", "launch", "--islands", "2", "--max-restarts", "3",
        "--", sys.executable, str(SCRIPT), str(run), "--rows", str(rows), "--epochs", str(epochs),
        "--step-sleep", "0.03", "--death-timeout", "4", *extra,
    ]  # fmt: skip
    # A home without ~/.ray/auth_token, as on a fresh machine: the cluster's token is
    # the launcher's own (the head refused to start when it relied on that file).
    home = run.parent / "home"
    home.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HOME": str(home)}
    env.pop("RAY_AUTH_TOKEN", None)
    env.pop("RAY_AUTH_TOKEN_PATH", None)
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    out: list[str] = []
    threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True).start()
    plan, killed = list(plan), set()
    try:
        deadline = time.time() + 240
        while plan and proc.poll() is None and time.time() < deadline:
            path = run / ("island-1/timeline.jsonl" if plan[0] == "island" else "events.jsonl")
            events = _lines(path)
            starts = [e for e in events if e["event"] == "start"]
            if starts and starts[-1]["pid"] not in killed:
                since = [e for e in events if e["event"] == "round" and e["t"] > starts[-1]["t"]]
                if len(since) >= 3:
                    time.sleep(0.1)
                    os.kill(starts[-1]["pid"], signal.SIGKILL)
                    killed.add(starts[-1]["pid"])
                    plan.pop(0)
            time.sleep(0.05)
        code = proc.wait(timeout=max(1, deadline - time.time()))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return code, "".join(out), plan


@pytest.mark.one_end("newest")  # ~40 s with a real Ray cluster: see tests/conftest.py
def test_islands_survive_sigkills_of_an_island_and_the_coordinator(tmp_path):
    """Two islands; island 1 is SIGKILLed twice mid-run, the coordinator's actor process
    once. The launcher restarts the island, Ray the coordinator (from its checkpoint);
    every row of both epochs enters exactly one applied round, the survivors never
    restart, and each island's goodput ledger charges the downtime to its own island."""
    run = tmp_path / "run"
    code, log, left = _run_with_kills(run, ["island", "coordinator", "island"])
    assert code == 0 and not left, log[-4000:]
    positions = np.sort(committed_rows(str(run)))
    assert np.array_equal(positions, np.arange(2048 * 2)), "rows lost or duplicated"
    events = _lines(run / "events.jsonl")
    assert [e["restored_round"] is not None for e in events if e["event"] == "start"] == [
        False,
        True,
    ]
    assert any(e["event"] == "dead" and e["island"] == 1 for e in events)
    starts = {i: [e for e in _lines(run / f"island-{i}/timeline.jsonl") if e["event"] == "start"]
              for i in (0, 1)}  # fmt: skip
    assert (len(starts[0]), len(starts[1])) == (1, 3)  # the survivor never restarted
    results = [json.loads((run / f"island-{i}/result.json").read_text()) for i in (0, 1)]
    assert results[0]["w"] == results[1]["w"]  # both end with the same global model
    np.testing.assert_allclose(results[0]["w"], results[0]["w_true"], atol=0.05)
    g0, g1 = report(run / "island-0"), report(run / "island-1")
    assert g0.buckets_s["downtime"] == 0 and g1.buckets_s["downtime"] > 0
    assert g0.buckets_s["sync"] > 0 and len(g1.attempts) == 3


@pytest.mark.one_end("newest")  # ~30 s with a real Ray cluster: see tests/conftest.py
def test_async_islands_survive_a_sigkill_with_every_row_once(tmp_path):
    run = tmp_path / "run"
    code, log, left = _run_with_kills(run, ["island"], extra=["--mode", "async"], epochs=1)
    assert code == 0 and not left, log[-4000:]
    assert np.array_equal(np.sort(committed_rows(str(run))), np.arange(2048))
    rounds = [e for e in _lines(run / "events.jsonl") if e["event"] == "round"]
    assert all(len(e["islands"]) == 1 for e in rounds)  # one arrival per update
    staleness = [m["staleness"] for e in rounds for m in e["metrics"].values()]
    assert max(staleness) >= 1  # the islands did not wait for each other
    result = json.loads((run / "island-0/result.json").read_text())
    np.testing.assert_allclose(result["w"], result["w_true"], atol=0.05)


# ------------------------------------------------------------------ asynchronous mode


def test_delayed_nesterov_is_nesterov_on_the_mean_of_each_delay():
    import jax.numpy as jnp

    from distrain._src.islands.outer import delayed_nesterov

    rng = np.random.default_rng(0)
    grads = [{"a": jnp.asarray(rng.standard_normal(3), jnp.float32)} for _ in range(8)]

    def run(tx, gs):
        params = {"a": jnp.ones(3)}
        state = tx.init(params)
        for g in gs:
            updates, state = tx.update(g, state, params)
            params = optax.apply_updates(params, updates)
        return np.asarray(params["a"])

    nesterov = optax.sgd(0.7, 0.9, nesterov=True)
    np.testing.assert_allclose(run(delayed_nesterov(0.7, 0.9, 1), grads), run(nesterov, grads),
                               rtol=1e-6)  # fmt: skip
    means = [{"a": sum(g["a"] for g in grads[i : i + 4]) / 4} for i in (0, 4)]
    np.testing.assert_allclose(run(delayed_nesterov(0.7, 0.9, 4), grads), run(nesterov, means),
                               rtol=1e-5)  # fmt: skip
    with pytest.raises(ValueError, match="delay >= 1"):
        delayed_nesterov(0.7, 0.9, 0)


def test_async_applies_on_arrival_discards_stale_work_and_loses_no_row(tmp_path):
    coord = _coordinator(tmp_path, mode="async", max_staleness=0, num_rows=12)
    t0, t1 = coord.join(0, _structure())[0], coord.join(1, _structure())[0]
    # Both pull version 0; island 0's arrival is applied at once (no barrier) ...
    r0, _, _ = coord.wait_round(0, t0, -1)
    r1, _, _ = coord.wait_round(1, t1, -1)
    a, _ = coord.lease(0, t0, r0)
    b, _ = coord.lease(1, t1, r1)
    assert coord.submit(0, t0, r0, [np.full_like(p, 1.0) for p in PARAMS]) is True
    assert coord.status()["round"] == 1
    # ... which makes island 1's work one update stale: discarded, its rows returned.
    assert coord.submit(1, t1, r1, [np.full_like(p, 1.0) for p in PARAMS]) is False
    events = [json.loads(x) for x in open(tmp_path / "run" / "events.jsonl")]
    assert [e["rows_returned"] for e in events if e["event"] == "stale"] == [len(b)] == [4]
    np.testing.assert_allclose(coord.params()[0], PARAMS[0] - 1.0)
    after = {0: r0, 1: r1}
    while not coord.status()["finished"]:
        for i, t in ((0, t0), (1, t1)):  # in turn: never stale
            r, _, finished = coord.wait_round(i, t, after[i])
            if finished:
                break
            positions, _ = coord.lease(i, t, r, timeout=0.1) or (None, None)
            if positions is None:
                continue
            grads = [np.full_like(p, 1.0) for p in PARAMS] if len(positions) else None
            assert coord.submit(i, t, r, grads) is True
            after[i] = r
    assert np.array_equal(np.sort(committed_rows(str(tmp_path / "run"))), np.arange(12))
    np.testing.assert_allclose(coord.params()[0], PARAMS[0] - 3.0)  # 12 rows = 3 leases
    coord.stop()
    with pytest.raises(ValueError, match="max_staleness bounds the asynchronous mode"):
        _config(max_staleness=2)
    with pytest.raises(ValueError, match="mode must be 'sync' or 'async'"):
        _config(mode="elastic")


def test_without_ray_both_sides_name_the_extra(monkeypatch):
    from distrain._src.islands import launch

    python = sys.executable
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(FileNotFoundError, match=r"needs Ray: `pip install 'distrain\[ray\]'`"):
        launch._ray_binary()
    code = "import sys; sys.modules['ray'] = None\nfrom distrain._src.islands import remote\n"
    code += "remote.import_ray()"
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert proc.returncode != 0
    assert "need Ray (the islands and their coordinator talk through it)" in proc.stderr
    assert "pip install 'distrain[ray]'" in proc.stderr


@pytest.mark.one_end("newest")  # ~20 s with a real Ray cluster: see tests/conftest.py
def test_sigterm_to_the_launcher_stops_every_island_and_the_ray_head(tmp_path):
    run = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "distrain.cli", "launch", "--islands", "2", "--max-restarts", "3",
        "--", sys.executable, str(SCRIPT), str(run), "--rows", "100000", "--step-sleep", "0.05",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        deadline = time.time() + 120
        while time.time() < deadline and len(
            [e for i in (0, 1) for e in _lines(run / f"island-{i}/timeline.jsonl")
             if e["event"] == "round"]
        ) < 2:  # fmt: skip
            time.sleep(0.2)
        pids = [_lines(run / f"island-{i}/timeline.jsonl")[0]["pid"] for i in (0, 1)]
        coordinator = _lines(run / "events.jsonl")[0]["pid"]
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130 and "interrupted; all islands stopped" in out, out[-3000:]

    def running(pid):  # a zombie waiting for init to reap it counts as gone
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    named = {"island 0": pids[0], "island 1": pids[1], "coordinator": coordinator}
    deadline = time.time() + 10
    while (alive := [n for n, pid in named.items() if running(pid)]) and time.time() < deadline:
        time.sleep(0.2)
    assert not alive, f"{alive} outlived the launcher"  # nor any Ray worker
