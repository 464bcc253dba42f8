"""Fault-isolated islands (issue 38): the row ledger, the coordinator, and real runs.

The coordinator and the ledger are exercised in-process (they are plain classes; in a
run they live in a Ray actor). The runs start `distrain launch --islands 2` with a real
local Ray cluster, SIGKILL an island and the coordinator's actor process, and count the
committed rows by id.
"""

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import optax
import pytest

from distrain._src.goodput.report import report
from distrain._src.islands.island import random_access
from distrain._src.islands.island_coordinator import (
    IslandCoordinator,
    IslandsConfig,
    IslandsFailed,
    RejoinRequired,
    committed_rows,
)
from distrain._src.islands.rows import RowLedger
from tests.processes import stop_launcher

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
    from distrain._src.islands.island_coordinator import structure_of

    return structure_of(params, treedef)


def _round(coord, island, token, after, grad_value):
    """One island's round: wait, lease, submit a constant pseudo-gradient."""
    r, params, finished, _, _ = coord.wait_round(island, token, after, timeout=10)
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
    # 10 rows, leases of 4: round 0 gives 4 + 4 rows, round 1 gives 2 + 0. No heartbeats
    # here: a death timeout that a loaded machine's first outer update (a compilation)
    # cannot outlast.
    coord = _coordinator(tmp_path, death_timeout=60.0)
    t0, t1 = coord.join(0, _structure())[0], coord.join(1, _structure())[0]
    coord.wait_round(0, t0, -1)
    coord.wait_round(1, t1, -1)
    p0, _ = coord.lease(0, t0, 0)
    p1, _ = coord.lease(1, t1, 0)
    assert (len(p0), len(p1)) == (4, 4)
    coord.submit(0, t0, 0, [np.full_like(p, 1.0) for p in PARAMS])
    assert coord.status()["round"] == 0  # waits for island 1
    coord.submit(1, t1, 0, [np.full_like(p, 3.0) for p in PARAMS])
    r, params, finished, _, _ = coord.wait_round(0, t0, 0)
    assert (r, finished) == (1, False)
    np.testing.assert_allclose(params[0], PARAMS[0] - 2.0)  # sgd(1.0) of the mean 2.0
    q0, _ = coord.lease(0, t0, 1)
    q1, _ = coord.lease(1, t1, 1)
    assert (len(q0), len(q1)) == (2, 0)
    coord.submit(1, t1, 1, None)
    coord.submit(0, t0, 1, [np.full_like(p, 0.5) for p in PARAMS])
    _, params, finished, _, _ = coord.wait_round(1, t1, 1)
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
    # No heartbeats: a death timeout that a loaded machine's compilations cannot outlast.
    kw = dict(tx=optax.sgd(0.1, momentum=0.9), num_rows=20, death_timeout=60.0)
    coord = _coordinator(tmp_path, **kw)
    t0, t1 = coord.join(0, _structure())[0], coord.join(1, _structure())[0]
    for after in (-1, 0):
        _round(coord, 0, t0, after, 1.0)
        _round(coord, 1, t1, after, 1.0)
    # Round 2 is under way when the coordinator "dies": its lease is not committed.
    coord.wait_round(0, t0, 1)
    coord.lease(0, t0, 2)
    before, status = coord.params(), coord.status()
    coord.stop()
    again = _coordinator(tmp_path, **kw)
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
    _, params, finished, _, _ = again.wait_round(0, n0, 2)
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


def test_the_coordinator_starts_only_where_it_reads_the_islands_run_id(tmp_path):
    """Issue 50, defect 6, in-process: Ray may start or restart the coordinator on a node
    that does not see the run directory; there it found no checkpoint and silently
    started the run over. It now refuses in one line unless it reads the id the islands
    wrote, and it tells the last island to leave that the run is over."""
    from distrain._src.islands import remote

    run = tmp_path / "run"
    rid = remote.run_id(str(run))
    assert remote.run_id(str(run)) == rid and len(rid) == 32  # the first island's id stays
    args = (_config(), PARAMS, TREEDEF, optax.sgd(1.0))
    with pytest.raises(
        remote.DirectoryNotShared,
        match=r"does not see the run directory the islands write: the islands wrote run id "
        rf"{rid} in run-id, and it finds no run-id file in \S*elsewhere\. Expected a "
        "directory that every node",
    ) as refused:
        remote.RemoteCoordinator(*args, str(tmp_path / "elsewhere"), rid)
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "elsewhere").exists()  # nothing started over there
    coord = remote.RemoteCoordinator(*args, str(run), rid)
    assert coord.check_directory(rid) is None
    t0, t1 = coord.join(0, _structure())[0], coord.join(1, _structure())[0]
    assert coord.leave(0, t0) is False and coord.leave(1, t1) is True  # the last one out
    coord.stop()
    # An island that reads another id (another node's directory at the same path) ...
    assert "it finds run id " + rid in coord.check_directory("f" * 32)
    # ... and one that started afresh in a wiped directory while this coordinator lived.
    (run / "run-id").unlink()
    stale = coord.check_directory(remote.run_id(str(run)))
    assert "the coordinator of an earlier run" in stale and "ray.kill(ray.get_actor(" in stale


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


def test_a_joining_island_continues_the_learning_rate_schedule_with_fresh_moments():
    """Issue 50, defect 1: an island joining at step 1500 of AdamW with warm-up and
    cosine decay updated with the schedule's learning rate at step 0 (0.0, where its
    peers use 2.45e-4): optax keeps a schedule's step in the optimizer state. Every count
    goes on at the joining step; the moments are the initial ones."""
    import jax
    import jax.numpy as jnp

    import distrain as dt
    from distrain._src.islands.joining import joined_state

    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 100, 2000, 1e-4)
    params = {"w": np.full(2, 5.0, np.float32)}
    grads = {"w": np.array([1.0, -2.0], np.float32)}

    def joined(tx):
        initial = dt.TrainState.create(params={"w": jnp.zeros(2)}, tx=tx)
        return initial, joined_state(initial, params, step=1500)

    # inject_hyperparams records the learning rate each update used.
    tx = optax.inject_hyperparams(optax.adamw)(learning_rate=schedule)
    _, state = joined(tx)
    assert int(state.step) == 1500 and state.params["w"].tolist() == [5.0, 5.0]
    _, after = tx.update(grads, state.opt_state, state.params)
    assert float(after.hyperparams["learning_rate"]) == pytest.approx(2.4522e-4, rel=1e-4)
    assert float(after.hyperparams["learning_rate"]) == pytest.approx(float(schedule(1500)))

    # The recipe's plain AdamW: the first update is the one of a state whose counts
    # (Adam's and the schedule's) were set by hand, with the initial moments.
    tx = optax.adamw(schedule)
    initial, state = joined(tx)
    adam, decay, lr = initial.opt_state
    count = jnp.asarray(1500, jnp.int32)
    by_hand = (adam._replace(count=count), decay, lr._replace(count=count))
    got, _ = tx.update(grads, state.opt_state, params)
    want, _ = tx.update(grads, by_hand, params)
    np.testing.assert_array_equal(got["w"], want["w"])
    assert np.all(np.abs(got["w"]) > 1e-5)  # lr 0 (the reset warm-up) moves nothing
    for got_m, want_m in zip(jax.tree.leaves(state.opt_state[0][1:]),
                             jax.tree.leaves(initial.opt_state[0][1:]), strict=True):  # fmt: skip
        np.testing.assert_array_equal(got_m, want_m)  # mu, nu: fresh

    # Nested: a masked Adam keeps its count inside MaskedState.
    _, state = joined(optax.chain(optax.masked(optax.adam(schedule), {"w": True})))
    counts = [int(x) for p, x in jax.tree_util.tree_leaves_with_path(state.opt_state)
              if jax.tree_util.keystr(p).endswith(".count")]  # fmt: skip
    assert counts == [1500, 1500]
    with pytest.raises(ValueError, match=r"optax.MultiSteps counts updates of k steps"):
        joined(optax.MultiSteps(optax.adam(schedule), 2))


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
    monkeypatch.setenv("DISTRAIN_NUM_PROCESSES", "2")  # a 2-process island; JAX runs one
    with pytest.raises(ValueError, match=r"the island has 2 processes \(--nproc-per-island\), "
                       r"but its strategy spans the devices of process\(es\) \[0\]"):  # fmt: skip
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
    from distrain._src.islands.launch_islands import _ray_env

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
    coordinator actor's), each after the target's third round since it (re)started;
    "stop" SIGSTOPs island 1's process there instead (see `_hang`).
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
            island_1 = plan[0] in ("island", "stop")
            path = run / ("island-1/timeline.jsonl" if island_1 else "events.jsonl")
            events = _lines(path)
            starts = [e for e in events if e["event"] == "start"]
            if starts and starts[-1]["pid"] not in killed:
                since = [e for e in events if e["event"] == "round" and e["t"] > starts[-1]["t"]]
                if len(since) >= 3:
                    time.sleep(0.1)
                    if plan[0] == "stop":
                        _hang(run, starts[-1]["pid"])
                    else:
                        os.kill(starts[-1]["pid"], signal.SIGKILL)
                    killed.add(starts[-1]["pid"])
                    plan.pop(0)
            time.sleep(0.05)
        code = proc.wait(timeout=max(1, deadline - time.time()))
    finally:
        stop_launcher(proc)
    return code, "".join(out), plan


def _hang(run, pid):
    """SIGSTOPs island 1's process ``pid`` until the coordinator declared it hung (at most
    30 s), then SIGCONTs it. Not later: once island 0 has used up the rows alone, the last
    island out ends the coordinator, and island 1 would be told that instead (CI)."""
    stopped = time.time()
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = stopped + 30
        while time.time() < deadline:
            events = [e for e in _lines(run / "events.jsonl") if e["t"] > stopped]
            if any(e["event"] == "dead" and e["island"] == 1 and e["hung"] for e in events):
                break
            time.sleep(0.05)
    finally:
        os.kill(pid, signal.SIGCONT)


@pytest.mark.one_end("newest")  # ~40 s with a real Ray cluster: see tests/conftest.py
def test_islands_survive_sigkills_of_an_island_and_the_coordinator(tmp_path):
    """Two islands; island 1 is SIGKILLed twice mid-run, the coordinator's actor process
    once. The launcher restarts the island, Ray the coordinator (from its checkpoint);
    every row of both epochs enters exactly one applied round, the survivors never
    restart, and each island's goodput ledger charges the downtime to its own island."""
    run = tmp_path / "run"
    code, log, left = _run_with_kills(run, ["island", "coordinator", "island"])
    assert code == 0 and not left, log[-4000:]
    # Issue 51: only the killed island restarts, and the launcher says so.
    assert "[launch] island 1 process 0 was killed by SIGKILL; the other islands go on" in log
    assert "other processes" not in log
    positions = np.sort(committed_rows(str(run)))
    assert np.array_equal(positions, np.arange(2048 * 2)), "rows lost or duplicated"
    events = _lines(run / "events.jsonl")
    restored = [e["restored_round"] for e in events if e["event"] == "start"]
    assert restored[0] is None and restored[1] is not None  # Ray restarted the killed one
    # One more only if island 1's last restart came after the run ended (the last island
    # out ended the coordinator): a fresh one, from the final checkpoint.
    final = 1 + max(e["round"] for e in events if e["event"] == "round")
    assert len(restored) <= 3 and all(r == final for r in restored[2:]), restored
    assert any(e["event"] == "dead" and e["island"] == 1 for e in events)
    starts = {i: [e for e in _lines(run / f"island-{i}/timeline.jsonl") if e["event"] == "start"]
              for i in (0, 1)}  # fmt: skip
    assert (len(starts[0]), len(starts[1])) == (1, 3)  # the survivor never restarted
    # Issue 57: a restart heals from the live island (heal_from_peer, the default), or,
    # when it rejoins a restarted coordinator (whose islands all rejoin too), starts fresh
    # for want of a trained peer. (Which one depends on when the kills land; the
    # benchmark's heal arms record every rejoin healed from island 0.)
    timeline = _lines(run / "island-1/timeline.jsonl")
    # Or, a race the coordinator names: island 0 pulled the round before island 1 asked.
    fresh = (
        "no live peer has trained a round since it (or the coordinator) started",
        "every live peer had started round",
    )
    heals = [e for e in timeline if e["event"] == "heal" and e["round"] > 0]
    whys = [(e["round"], e["donor"], e.get("why")) for e in heals]
    assert heals and all(e["donor"] == 0 or e["why"].startswith(fresh) for e in heals), whys
    healed = {e["round"] for e in events if e["event"] == "healed"}
    assert healed == {e["round"] for e in heals if e["donor"] == 0}
    results = [json.loads((run / f"island-{i}/result.json").read_text()) for i in (0, 1)]
    assert results[0]["w"] == results[1]["w"]  # both end with the same global model
    np.testing.assert_allclose(results[0]["w"], results[0]["w_true"], atol=0.05)
    g0, g1 = report(run / "island-0"), report(run / "island-1")
    assert g0.buckets_s["downtime"] == 0 and g1.buckets_s["downtime"] > 0
    assert g0.buckets_s["sync"] > 0 and len(g1.attempts) == 3


@pytest.mark.one_end("newest")  # ~30 s with a real Ray cluster: see tests/conftest.py
def test_a_round_a_killed_shard_holder_lost_is_trained_again_with_every_row_once(tmp_path):
    """Island 0 kills shard holder 0's actor right after it submitted round 2, while
    island 1 still trains it (SCRIPT --kill-holder-after). Ray restarts the holder from
    the committed round; it lacks island 0's pseudo-gradient, so round 2 is not applied
    and both islands train it again: the run ends, no island restarts or rejoins, every
    row once."""
    run = tmp_path / "run"
    code, log, _ = _run_with_kills(run, [], extra=("--kill-holder-after", "2"), rows=512)
    assert code == 0, log[-4000:]
    for i in (0, 1):  # no island's process restarted
        assert [e["event"] for e in _lines(run / f"island-{i}/timeline.jsonl")].count("start") == 1
    assert np.array_equal(np.sort(committed_rows(str(run))), np.arange(512 * 2))
    events = _lines(run / "events.jsonl")
    retried = [e for e in events if e["event"] == "round_retried"]
    assert [e["round"] for e in retried] == [2], events
    assert "(PseudoGradientLost: shard 0 of 2 has no pseudo-gradient of island 0 for round 2" \
        in retried[0]["error"]  # fmt: skip
    assert (retried[0]["islands"], retried[0]["rows_returned"]) == ([0, 1], 128)
    assert not any(e["event"] in ("failed", "save_failed", "dead") for e in events)
    applied = [e["round"] for e in events if e["event"] == "round"]
    assert applied == list(range(len(applied))) and len(applied) >= 8
    for i in (0, 1):  # round 2, submitted, then trained again from the same parameters
        timeline = _lines(run / f"island-{i}/timeline.jsonl")
        assert [e["round"] for e in timeline if e["event"] == "retry"] == [2]
        assert [e["round"] for e in timeline if e["event"] == "round"][:4] == [0, 1, 2, 2]
    results = [json.loads((run / f"island-{i}/result.json").read_text()) for i in (0, 1)]
    assert results[0]["w"] == results[1]["w"]


@pytest.mark.one_end("newest")  # ~25 s with a real Ray cluster: see tests/conftest.py
def test_a_sigstopped_island_is_hung_at_the_round_deadline_and_the_other_goes_on(tmp_path):
    """Issue 50, defect 4: a hung island stalled every round forever. Island 1 is
    SIGSTOPped after its third round; with death_timeout=60 s only the round deadline
    (round_timeout=3 s) ends the wait for it. Island 0 goes on alone; island 1, continued,
    is told to rejoin and finishes in the same process; every row is committed once, and
    island 0's goodput ledger charges its wait to the hang bucket."""
    run = tmp_path / "run"
    extra = ["--death-timeout", "60", "--round-timeout", "3"]
    code, log, left = _run_with_kills(run, ["stop"], extra=extra, rows=1024, epochs=1)
    assert code == 0 and not left, log[-4000:]
    assert np.array_equal(np.sort(committed_rows(str(run))), np.arange(1024))
    events = _lines(run / "events.jsonl")
    dead = [e for e in events if e["event"] == "dead"]
    assert [(e["island"], e["hung"]) for e in dead] == [(1, True)], dead
    assert "the round deadline" in dead[0]["why"]
    alone = [e for e in events if e["event"] == "round" and e["t"] > dead[0]["t"]]
    assert alone and alone[0]["islands"] == [0]  # the survivor went on without it
    assert 1.0 < alone[0]["hang_s"] <= 3.5
    timeline = _lines(run / "island-1/timeline.jsonl")
    assert [e["event"] for e in timeline].count("start") == 1  # continued, not restarted
    rejoins = [e["why"] for e in timeline if e["event"] == "rejoin"]
    assert rejoins and "round deadline" in rejoins[0], timeline
    g0 = report(run / "island-0")
    assert g0.buckets_s["hang"] == pytest.approx(alone[0]["hang_s"], abs=0.05)


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


@pytest.mark.one_end("newest")  # a local Ray and two actors: see tests/conftest.py
def test_a_run_directory_the_actor_resolves_elsewhere_is_refused_in_one_line(
    local_ray, tmp_path, monkeypatch
):
    """Issue 50, defect 6, with real actors: a relative directory, which the actor
    resolves in its own working directory, stands for a node that does not see the
    islands' directory. The actor does not start (it started the run over there). Also
    the proxy's other ways out: a coordinator ended under it, one that fails to start."""
    from distrain._src.islands import remote

    monkeypatch.chdir(tmp_path)  # the island's working directory; the actor keeps Ray's
    name = remote.actor_name("run")
    args = (_config(), PARAMS, TREEDEF, optax.sgd(1.0), "run")
    with pytest.raises(
        ValueError,
        match=r"^the islands' coordinator \(node 127\.0\.0\.1\) "
        r"does not see the run directory .* finds no run-id file in /",
    ) as e:
        remote.coordinator(name, args, timeout=60)
    assert "\n" not in str(e.value) and str(tmp_path) not in str(e.value)
    assert (tmp_path / "run" / "run-id").is_file()  # what the island wrote
    with pytest.raises(ValueError, match="Failed to look up actor"):
        local_ray.get_actor(name, namespace=remote.NAMESPACE)

    # An island whose coordinator was ended (by the last island of the run, as this one
    # joined) finds a new one instead of calling the dead actor forever.
    args = (*args[:-1], str(tmp_path / "run"))
    coord = remote.coordinator(remote.actor_name(args[-1]), args, timeout=60)
    ended = coord.handle
    coord.kill()
    deadline = time.time() + 30
    while time.time() < deadline:  # until Ray forgot its name: it is dead
        try:
            local_ray.get_actor(remote.actor_name(args[-1]), namespace=remote.NAMESPACE)
        except ValueError:
            break
        time.sleep(0.05)
    with pytest.raises(RejoinRequired, match="the coordinator restarted"):
        coord("status")
    assert coord.retry(lambda: coord("status"))["round"] == 0 and coord.handle is not ended
    coord.kill()

    # A coordinator that fails to start for another reason says why, whole.
    b = _coordinator(tmp_path / "b")  # a checkpoint of PARAMS after one round
    t0, t1 = b.join(0, _structure())[0], b.join(1, _structure())[0]
    _round(b, 0, t0, -1, 1.0)
    _round(b, 1, t1, -1, 1.0)
    b.stop()
    other = [np.zeros((4,), np.float32), PARAMS[1]]
    args = (_config(), other, TREEDEF, optax.sgd(1.0), str(tmp_path / "b" / "run"))
    with pytest.raises(RuntimeError, match=r"(?s)coordinator failed to start: .*holds a "
                       "checkpoint of another model"):  # fmt: skip
        remote.coordinator(remote.actor_name(args[-1]), args, timeout=60)


@pytest.mark.one_end("newest")  # a local Ray and two actors: see tests/conftest.py
def test_a_rerun_in_the_same_directory_gets_a_fresh_coordinator(local_ray, tmp_path):
    """Issue 50, defect 6: the detached actor outlived its run, and a rerun in the same
    (wiped) directory attached to it: the old run's configuration won, and the rerun got
    the old final parameters back without training. The last island out now ends it."""
    import jax
    import jax.numpy as jnp

    import distrain as dt
    from distrain._src.islands import remote

    def step(state, batch):
        def loss(p):
            return dt.compute_average_loss(jnp.sum((batch["x"] - p["w"]) ** 2, axis=-1))

        return state.apply_gradients(grads=jax.grad(loss)(state.params)), {}

    state = dt.TrainState.create(params={"w": jnp.zeros(2)}, tx=optax.sgd(0.1))
    data = {"x": np.ones((16, 2), np.float32)}  # 2 steps of 8 rows (8 replicas)
    run = tmp_path / "run"

    def train(sync_every):
        return dt.experimental.islands.train(
            step, state, data, batch_size=8, sync_every=sync_every, directory=str(run),
            island=0, islands=1, seed=None,
        ).rounds  # fmt: skip

    assert train(sync_every=2) == 1
    with pytest.raises(ValueError, match="Failed to look up actor"):
        local_ray.get_actor(remote.actor_name(str(run)), namespace=remote.NAMESPACE)
    shutil.rmtree(run)
    assert train(sync_every=1) == 2  # its own sync_every: before, 0 (the old actor's end)


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
    r0, _, _, _, _ = coord.wait_round(0, t0, -1)
    r1, _, _, _, _ = coord.wait_round(1, t1, -1)
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
            r, _, finished, _, _ = coord.wait_round(i, t, after[i])
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
    from distrain._src.islands import launch_islands as launch

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


@pytest.mark.one_end("newest")  # ~30 s with a real Ray cluster: see tests/conftest.py
def test_sigterm_to_the_launcher_stops_every_island_and_the_ray_head(tmp_path):
    """SIGTERM to the launcher (what Ctrl-C does too) stops every island and the Ray head;
    the islands exit on the launcher's SIGTERM, within the grace period (issue 51: they
    were SIGKILLed, and the launcher blamed that SIGKILL on them). The same command run
    again says where it continues, and trains every row once."""
    run = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "distrain.cli", "launch", "--islands", "2", "--max-restarts", "3",
        "--grace-period", "60", "--", sys.executable, str(SCRIPT), str(run), "--rows", "4096",
        "--epochs", "1",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([*cmd, "--step-sleep", "0.05"], env=env,
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
        temp_dir = _ray_temp_dir(proc.pid)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=40)  # < --grace-period: no island was SIGKILLed
    finally:
        stop_launcher(proc)
    assert proc.returncode == 130 and "interrupted; all islands stopped" in out, out[-3000:]
    assert f"island 0 process 0 is pid {pids[0]}" in out  # to `kill -9` one by hand
    for noise in ("killed by", "SIGTERM received", "Connecting to existing Ray cluster"):
        assert noise not in out, out[-3000:]

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
    # The head's files (its sockets, its logs) were in a private directory: mode 0700,
    # a name nobody could create first (not distrain-ray-PORT), removed at the end.
    assert temp_dir["mode"] == 0o700 and temp_dir["uid"] == os.getuid(), temp_dir
    assert re.fullmatch(r"distrain-ray-\w{8}", os.path.basename(temp_dir["path"])), temp_dir
    assert not os.path.exists(temp_dir["path"])
    # The same command again continues from the coordinator's last round, and says so.
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    rounds = re.findall(rf"island \d: continuing the run in {run} at round (\d+)", again.stdout)
    assert len(rounds) == 2 and min(map(int, rounds)) > 0, again.stdout[-3000:]
    assert np.array_equal(np.sort(committed_rows(str(run))), np.arange(4096))


def _ray_temp_dir(launcher: int) -> dict:
    """The directory that holds the --temp-dir of the `ray start --head` that
    ``launcher`` started (Ray makes its own world-writable), with its mode and owner."""
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().decode().split("\0")
        except OSError:
            continue
        found = [a.split("=", 1)[1] for a in argv if a.startswith("--temp-dir=")]
        if ppid == launcher and found:
            path = os.path.dirname(found[0])
            st = os.stat(path)
            return {"path": path, "mode": stat.S_IMODE(st.st_mode), "uid": st.st_uid}
    raise AssertionError(f"no `ray start --temp-dir=...` process among {launcher}'s children")
