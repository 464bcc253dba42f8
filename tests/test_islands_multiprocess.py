"""Islands of several processes (issue 57, item 1): each island is a `jax.distributed`
world of its own; its process 0 alone talks to the coordinator and broadcasts to the
others (`islands/island_link.py`).

Run as a program, this module is one process of an island (``island``: a training run
under `distrain launch --islands 2 --nproc-per-island 2`; ``link``: the link's errors
under `distrain launch --nproc 2`, against an in-process coordinator).
"""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve()


def _lines(path):
    try:
        return [json.loads(x) for x in open(path) if x.strip()]
    except FileNotFoundError:
        return []


def _env(run):
    home = run.parent / "home"  # no ~/.ray/auth_token: the launcher's own token
    home.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HOME": str(home)}
    for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "XLA_FLAGS"):
        env.pop(name, None)
    return env


def _island_pids(out, island):
    """The pids of ``island``'s latest attempt, from the launcher's lines."""
    found = re.findall(rf"\[launch\] island {island} (process 0 is pid \d+.*)", "".join(out))
    return [int(p) for p in re.findall(r"is pid (\d+)", found[-1])] if found else []


@pytest.mark.one_end("newest")  # ~60 s: 4 JAX processes and a Ray cluster (conftest.py)
def test_an_island_of_two_processes_survives_sigkills_of_either_process(tmp_path):
    """2 islands of 2 processes. Island 1's process 1 is SIGKILLed once training is under
    way, then (after its restart trained) its process 0, the one that talks to the
    coordinator. Each time the launcher restarts island 1 alone; island 0 never stops
    (its rounds go on while island 1 is down); every row is committed exactly once; both
    islands end with the same parameters, on every process."""
    from distrain._src.islands.island_coordinator import committed_rows
    from tests.processes import stop_launcher  # here: this file is also the island program

    run = tmp_path / "run"
    rows = 3072
    cmd = [
        sys.executable, "-m", "distrain.cli", "launch", "--islands", "2",
        "--nproc-per-island", "2", "--devices-per-proc", "2", "--max-restarts", "3", "--",
        sys.executable, str(HERE), "island", str(run), "--rows", str(rows),
    ]  # fmt: skip
    pipe = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    proc = subprocess.Popen(cmd, env=_env(run), start_new_session=True, **pipe)
    out: list[str] = []
    threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True).start()
    plan, kills = [1, 0], []  # island 1's process 1, then its process 0
    try:
        deadline = time.time() + 300
        while plan and proc.poll() is None and time.time() < deadline:
            timeline = _lines(run / "island-1/timeline.jsonl")
            starts = [e for e in timeline if e["event"] == "start"]
            pids = _island_pids(out, 1)
            if starts and len(pids) == 2 and starts[-1]["pid"] == pids[0]:
                since = [e for e in timeline if e["event"] == "round" and e["t"] > starts[-1]["t"]]
                if len(since) >= 3 and pids[0] not in [k[1] for k in kills]:
                    os.kill(pids[plan[0]], signal.SIGKILL)
                    kills.append((time.time(), pids[0]))
                    plan.pop(0)
            time.sleep(0.05)
        code = proc.wait(timeout=max(1, deadline - time.time()))
    finally:
        stop_launcher(proc)
    log = "".join(out)
    assert code == 0 and not plan, log[-4000:]
    for k in (1, 0):
        assert (
            f"[launch] island 1 process {k} was killed by SIGKILL; stopping island 1's "
            "other processes" in log
        ), log[-4000:]
    assert log.count("[launch] island 0 process 0 is pid") == 1  # island 0 started once
    assert np.array_equal(np.sort(committed_rows(str(run))), np.arange(rows)), "rows lost"
    t0 = _lines(run / "island-0/timeline.jsonl")
    t1 = _lines(run / "island-1/timeline.jsonl")
    assert [e["event"] for e in t0].count("start") == 1  # island 0 never restarted
    starts = [e["t"] for e in t1 if e["event"] == "start"]
    assert len(starts) == 3 and all(e["processes"] == 2 for e in t1 if e["event"] == "start")
    for (killed, _), back in zip(kills, starts[1:], strict=True):
        rejoined = min(e["t"] for e in t1 if e["event"] == "round" and e["t"] > back)
        alone = [e for e in t0 if e["event"] == "round" and killed < e["t"] < rejoined]
        assert len(alone) >= 2, (killed, rejoined)  # island 0 went on while 1 was down
    results = [
        json.loads((run / f"island-{i}/result-{p}.json").read_text())
        for i in (0, 1) for p in (0, 1)
    ]  # fmt: skip
    assert all(r["w"] == results[0]["w"] for r in results)  # every island, every process
    np.testing.assert_allclose(results[0]["w"], results[0]["w_true"], atol=0.1)


@pytest.mark.one_end("lowest")  # ~15 s: 2 JAX processes (conftest.py)
def test_coordinator_errors_reach_every_process_of_the_island(tmp_path):
    """A 2-process island against an in-process coordinator: a join that the coordinator
    refuses (healing from an island with another optimizer: `check_same_optimizer`)
    raises the same ValueError on both processes, a stale token the same
    RejoinRequired; a successful join gives both the same steps."""
    cmd = [
        sys.executable, "-m", "distrain.cli", "launch", "--nproc", "2", "--devices-per-proc",
        "1", "--", sys.executable, str(HERE), "link", str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=_env(tmp_path / "run"), capture_output=True, text=True,
                          timeout=240)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = [json.loads((tmp_path / f"link-{p}.json").read_text()) for p in (0, 1)]
    assert got[0] == got[1], got
    message = "island 1 cannot heal from island 0: their inner optimizer states differ"
    assert got[0]["heal"][0] == "ValueError" and message in got[0]["heal"][1]
    assert got[0]["stale"][0] == "RejoinRequired" and "join again" in got[0]["stale"][1]
    assert got[0]["joined"] == 0


# --------------------------------------------------------------- the programs


def _island_program(argv):
    """One process of one island: a linear regression whose rows carry their id."""
    import argparse

    import distrain as dt

    strategy = dt.MultiWorkerMirroredStrategy()  # first: joins the island's world

    import jax
    import jax.numpy as jnp
    import optax

    p = argparse.ArgumentParser()
    p.add_argument("directory")
    p.add_argument("--rows", type=int, default=2048)
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    w_true = rng.standard_normal((4, 1)).astype(np.float32)
    x = rng.standard_normal((args.rows, 4)).astype(np.float32)
    data = {"x": x, "y": x @ w_true}

    def train_step(state, batch):
        def loss_fn(params):
            pred = batch["x"] @ params["w"]
            return dt.compute_average_loss(jnp.sum((pred - batch["y"]) ** 2, axis=-1))

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    state = dt.TrainState.create(params={"w": jnp.zeros((4, 1))}, tx=optax.sgd(0.05))
    result = dt.experimental.islands.train(
        train_step, state, data, batch_size=8, sync_every=2, directory=args.directory,
        strategy=strategy, death_timeout=4.0, heartbeat_interval=0.5, start_timeout=120.0,
        min_islands_timeout=120.0, on_round=lambda r, params: time.sleep(0.1),
    )  # fmt: skip
    island = int(os.environ["DISTRAIN_ISLAND"])
    path = os.path.join(args.directory, f"island-{island}", f"result-{jax.process_index()}.json")
    with open(path, "w") as f:
        w = np.asarray(result.params["w"]).ravel().tolist()
        json.dump({"rounds": result.rounds, "w": w, "w_true": w_true.ravel().tolist()}, f)


def _link_program(argv):
    """The link's errors on both processes of a 2-process island (island 1)."""
    import distrain as dt

    dt.MultiWorkerMirroredStrategy()  # first: joins the world

    import jax
    import jax.numpy as jnp
    import optax

    from distrain._src.islands.island_coordinator import IslandCoordinator, IslandsConfig
    from distrain._src.islands.island_link import Link
    from distrain._src.islands.islands_config import structure_of
    from distrain._src.islands.joining import Joiner

    directory = argv[0]
    params = [np.zeros((3,), np.float32)]
    structure = structure_of(params, "PyTreeDef([*])")

    def joiner(tx):
        state = dt.TrainState.create(params=[jnp.zeros(3)], tx=tx)
        return Joiner(state, heal=True, sync_every=2, log=lambda *a, **k: None)

    sgd, adam = joiner(optax.sgd(0.1, momentum=0.9)), joiner(optax.adam(0.1))
    coord = None
    if jax.process_index() == 0:  # the coordinator is process 0's only (here in-process)
        config = IslandsConfig(islands=2, sync_every=2, batch_size=2, num_rows=8, epochs=1,
                               seed=None, death_timeout=60.0, heartbeat_interval=1.0)  # fmt: skip
        local = IslandCoordinator(config, params, "PyTreeDef([*])", optax.sgd(1.0),
                                  os.path.join(directory, "run"))  # fmt: skip
        local.join(0, structure, sgd.structure, True)  # island 0: SGD with momentum
        coord = _InProcess(local)
    link = Link(coord, 1, params, adam.leaves, 4, jax.process_count(), jax.process_index())
    seen = {}
    for name, call in (
        ("heal", lambda: link.join(structure, adam.structure, True)),
        ("stale", lambda: (setattr(link, "token", "stale"), link.wait_round(-1, 10.0))),
    ):
        try:
            call()
        except Exception as e:  # noqa: BLE001 - what each process raised, compared
            seen[name] = [type(e).__name__, str(e)]
    seen["joined"] = link.join(structure, sgd.structure, False)
    path = os.path.join(directory, f"link-{jax.process_index()}.json")
    with open(path, "w") as f:
        json.dump(seen, f)


class _InProcess:
    """``remote.Coordinator``'s calls on an in-process coordinator."""

    def __init__(self, coord):
        self.coord = coord

    def __call__(self, method, *args):
        return getattr(self.coord, method)(*args)

    def retry(self, fn):
        return fn()


if __name__ == "__main__":
    {"island": _island_program, "link": _link_program}[sys.argv[1]](sys.argv[2:])
