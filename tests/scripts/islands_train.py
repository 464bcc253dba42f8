"""One island of a fault-isolated islands run (started by `distrain launch --islands N`).

A linear regression on 1,024 rows whose inputs carry their row id, so the rows each
island trained can be checked. Arguments: DIRECTORY [--epochs E] [--sync-every H]
[--batch B] [--death-timeout S] [--step-sleep S] [--min-islands M] [--mode async]
[--max-staleness K] [--round-timeout S] [--kill-holder-after R].

With --kill-holder-after R, island 0 kills shard holder 0's actor (Ray restarts it)
right after it submitted round R, while island 1 still trains it (`KillHolder`): the
holder loses island 0's pseudo-gradient and the round is trained again.
"""

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import distrain as dt
from distrain._src.islands.island_loop import RoundHooks

p = argparse.ArgumentParser()
p.add_argument("directory")
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--sync-every", type=int, default=4)
p.add_argument("--batch", type=int, default=16)
p.add_argument("--rows", type=int, default=256)
p.add_argument("--death-timeout", type=float, default=4.0)
p.add_argument("--step-sleep", type=float, default=0.0)
p.add_argument("--min-islands", type=int, default=1)
p.add_argument("--features", type=int, default=4)
p.add_argument("--mode", default="sync")
p.add_argument("--max-staleness", type=int, default=None)
p.add_argument("--round-timeout", type=float, default=None)
p.add_argument("--kill-holder-after", type=int, default=None)
args = p.parse_args()

rng = np.random.default_rng(0)
w_true = rng.standard_normal((args.features, 1)).astype(np.float32)
x = rng.standard_normal((args.rows, args.features)).astype(np.float32)
data = {"x": x, "y": x @ w_true, "id": np.arange(args.rows, dtype=np.int32)}
island = int(os.environ["DISTRAIN_ISLAND"])
seen = os.path.join(args.directory, f"island-{island}", "steps.jsonl")


def train_step(state, batch):
    def loss_fn(params):
        pred = batch["x"] @ params["w"]
        return dt.compute_average_loss(jnp.sum((pred - batch["y"]) ** 2, axis=-1))

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


def slow_step(state, batch):
    if args.step_sleep:
        time.sleep(args.step_sleep)
    return train_step(state, batch)


class KillHolder(RoundHooks):
    """Island 0 kills shard holder 0's actor (Ray restarts it) right after it submitted
    round ``after``; island 1 goes on past that round's first step only once the restarted
    holder answers. So the holder lost island 0's pseudo-gradient, and has island 1's."""

    def __init__(self, after):
        self.after, self.flag = after, os.path.join(args.directory, "holder-killed")

    def holder(self):
        import ray

        from distrain._src.islands.remote import NAMESPACE, holder_name

        name = holder_name(os.path.abspath(args.directory), 0, 2)  # one holder per island
        return ray, ray.get_actor(name, namespace=NAMESPACE)

    def step(self, r, index, state):
        if island != 1 or (r, index) != (self.after, 0) or os.path.exists(self.flag + "-seen"):
            return
        deadline = time.time() + 120
        while not os.path.exists(self.flag) and time.time() < deadline:
            time.sleep(0.05)
        while time.time() < deadline:  # the restarted holder serves the committed round
            try:
                ray, holder = self.holder()
                if ray.get(holder.params.remote(r), timeout=5) is not None:
                    break
            except Exception:  # noqa: BLE001 - restarting
                time.sleep(0.2)
        open(self.flag + "-seen", "w").close()

    def end(self, r, entry):
        if island == 0 and r == self.after and not os.path.exists(self.flag):
            ray, holder = self.holder()
            ray.kill(holder, no_restart=False)
            open(self.flag, "w").close()


params = {"w": jnp.zeros((args.features, 1), jnp.float32)}
state = dt.TrainState.create(params=params, tx=optax.sgd(0.05))
options = dict(
    batch_size=args.batch,
    sync_every=args.sync_every,
    directory=args.directory,
    death_timeout=args.death_timeout,
    heartbeat_interval=0.5,
    min_islands=args.min_islands,
    start_timeout=60.0,
    min_islands_timeout=60.0,
    mode=args.mode,
    max_staleness=args.max_staleness,
    round_timeout=args.round_timeout,
)
step = slow_step if args.step_sleep else train_step
if args.kill_holder_after is None:
    result = dt.experimental.islands.train(step, state, data, epochs=args.epochs, **options)
else:
    hooks = KillHolder(args.kill_holder_after)
    islands = dt.experimental.islands.FaultIsolation(**options)
    result = islands.run(step, state, data, epochs=args.epochs, hooks=hooks)
with open(os.path.join(args.directory, f"island-{island}", "result.json"), "w") as f:
    json.dump(
        {
            "rounds": result.rounds,
            "w": np.asarray(result.params["w"]).ravel().tolist(),
            "w_true": w_true.ravel().tolist(),
        },
        f,
    )
print(f"island {island} done after {result.rounds} rounds", flush=True)
