"""A distrain job as the training function of Ray Train's JaxTrainer, for tests/test_ray_train.py.

`train(config)` is the whole job: `dt.MultiWorkerMirroredStrategy()` (its cluster from
the Ray Train worker group, or from DISTRAIN_* under `distrain launch`), then
`Trainer.fit` on the model and data of mw_train.py with `BackupAndRestore`. The state
carries `extra["seen"]`: how many times each example entered a committed step, summed
over replicas, so a run that lost or repeated a step cannot hide it.

    python mw_ray.py worker --out DIR                # one process of `distrain launch`
    python mw_ray.py fit|kill|elastic --out DIR      # driver: a local Ray cluster, 2 CPUs

kill:    worker 1 SIGKILLs itself after step 3 of the first attempt; FailureConfig restarts.
elastic: ScalingConfig(num_workers=(1, 2)) on two Ray nodes of one CPU. After step 3 the
         driver removes the second node (its worker dies): Ray restarts on 1 worker. After
         step 6 of that attempt it adds a node: Ray grows the group back to 2 workers.
         DIR/events.jsonl has the times of both.

Each attempt appends {"nproc", "pid", "restored", "start"} to DIR/attempts.jsonl; each
worker writes DIR/result_<pid>.npz at the end.
"""

import argparse
import json
import os
import signal
import sys
import threading
import time

import numpy as np

import distrain as dt

HERE = os.path.dirname(os.path.abspath(__file__))
BATCH = 16


def global_batches(steps: int) -> list[dict]:
    import mw_train

    ids = [(i * BATCH + np.arange(BATCH)).astype(np.int32) for i in range(steps)]
    return [dict(mw_train.global_batch(i, BATCH), id=ids[i]) for i in range(steps)]


def train(config: dict) -> None:
    strategy = dt.MultiWorkerMirroredStrategy()  # first: before any other JAX call

    import jax
    import jax.numpy as jnp
    import mw_train

    out, steps = config["out"], config["steps"]
    pid, nproc = jax.process_index(), jax.process_count()
    step_fn = mw_train.make_train_step(BATCH)

    def train_step(state, batch):
        new, loss = step_fn(state, {"x": batch["x"], "y": batch["y"]})
        local = jax.nn.one_hot(batch["id"], steps * BATCH, dtype=jnp.int32).sum(0)
        seen = state.extra["seen"] + dt.get_replica_context().all_reduce("sum", local)
        return new.replace(extra={"seen": seen}), {"loss": loss}

    state = mw_train.initial_state()
    state = state.replace(extra={"seen": np.zeros(steps * BATCH, np.int32)})
    backup = dt.callbacks.BackupAndRestore(config["backup"], save_freq=1, async_save=False)
    with strategy.scope():
        trainer = dt.Trainer(strategy, train_step, log_every=1)
        final, _ = trainer.fit(
            state,
            global_batches(steps),
            epochs=config["epochs"],
            callbacks=[Faults(config, backup, pid, nproc), backup],
        )
    seen = np.asarray(jax.device_get(final.extra["seen"]))
    params = {k: np.asarray(v) for k, v in final.params.items()}
    np.savez(os.path.join(out, f"result_{pid}.npz"), seen=seen, nproc=nproc, **params)


class Faults(dt.callbacks.Callback):
    """Logs the attempt at its first step, then fires the faults of config["faults"] once."""

    def __init__(self, config: dict, backup: dt.callbacks.BackupAndRestore, pid: int, nproc: int):
        self.config, self.backup, self.pid, self.nproc = config, backup, pid, nproc
        self.logged = False

    def on_train_batch_end(self, info):
        if not self.logged:  # BackupAndRestore has restored by now
            self.logged = True
            record = {"nproc": self.nproc, "pid": self.pid, "restored": self.backup.restored_step}
            record.update(first=info.step - info.num_steps, time=time.time())
            with open(os.path.join(self.config["out"], "attempts.jsonl"), "a") as f:
                f.write(json.dumps(record) + "\n")
        for i, fault in enumerate(self.config["faults"]):
            if (fault["at"], fault["nproc"], fault["pid"]) != (info.step, self.nproc, self.pid):
                continue
            marker = os.path.join(self.config["out"], f"fault_{i}")
            if not os.path.exists(marker):  # once, on the attempt it names
                open(marker, "w").close()
                _fire(fault["do"])
        if self.pid == 0:  # progress, for the driver that removes and adds nodes
            open(os.path.join(self.config["out"], f"step_{self.nproc}_{info.step}"), "w").close()
        if self.config.get("slow_on") == self.nproc and info.step >= self.config["add_at"]:
            # Ray sees a new node at its autoscaling coordinator's next tick (every 20 s):
            # the run must still be going then to grow.
            time.sleep(3.0)


def _fire(action: str) -> None:
    if action == "kill":
        print("killing myself", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


PLANS = {
    "fit": dict(workers=2, epochs=2, steps=4, faults=[]),
    "kill": dict(workers=2, epochs=2, steps=4, faults=[dict(at=3, nproc=2, pid=1, do="kill")]),
    "elastic": dict(
        workers=(1, 2),
        epochs=1,
        steps=16,
        faults=[],
        slow_on=1,
        remove_at=3,  # the driver removes the second node after step 3 of the 2-worker attempt
        add_at=6,  # and adds one after step 6 of the 1-worker attempt
    ),
}


def drive(mode: str, out: str) -> int:
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.v2.jax import JaxTrainer

    plan = PLANS[mode]
    config = dict(plan, out=out, backup=os.path.join(out, "backup"))
    env = {
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "DISTRAIN_LOCAL_DEVICES": "2",
        "DISTRAIN_TIMEOUT_SECONDS": "30",
        "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]),
    }
    t0 = time.time()
    cluster = None
    if mode == "elastic":
        # Two Ray nodes of one CPU on this machine: losing a node is what shrinks a run
        # (Ray's elastic policy counts the nodes' resources, not what actors hold).
        from ray.cluster_utils import Cluster

        # Right after a node is lost Ray may still count it and wait for its worker this
        # long before it tries again with what is left (Ray's default: 60 s).
        os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = "10"
        cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=1))
        second = cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, runtime_env={"env_vars": env})
    else:
        # "local": a new instance, never the machine's current cluster (ray.init() with no
        # address joins one that another test started: found by the suite under xdist).
        ray.init(
            address="local", num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env}
        )
    print(f"ray.init {time.time() - t0:.1f} s", flush=True)
    trainer = JaxTrainer(
        train,
        train_loop_config=config,
        scaling_config=ScalingConfig(
            num_workers=plan["workers"],
            resources_per_worker={"CPU": 1},
            elastic_resize_monitor_interval_s=1.0,
        ),
        run_config=RunConfig(
            storage_path=os.path.join(out, "ray"),
            name=mode,
            failure_config=FailureConfig(max_failures=2),
        ),
    )
    t1 = time.time()
    if cluster is None:
        result = trainer.fit()
    else:
        # Ray adds nodes from the main thread only (it sets a signal handler): fit elsewhere.
        results: list = []
        fit = threading.Thread(target=lambda: results.append(trainer.fit()), daemon=True)
        fit.start()
        _resize(cluster, second, config, fit)
        fit.join()
        result = results[0]
    print(f"fit {time.time() - t1:.1f} s error={result.error!r}", flush=True)
    ray.shutdown()
    if cluster is not None:
        cluster.shutdown()
    _report(out)
    return 0 if result.error is None else 1


def _report(out: str) -> None:
    """Prints the seconds from each fault to the first step of the attempt after it."""
    with open(os.path.join(out, "attempts.jsonl")) as f:
        starts = sorted(json.loads(line)["time"] for line in f)
    faults = []
    if os.path.exists(os.path.join(out, "fault_0")):
        faults.append(("worker killed", os.path.getmtime(os.path.join(out, "fault_0"))))
    if os.path.exists(os.path.join(out, "events.jsonl")):
        with open(os.path.join(out, "events.jsonl")) as f:
            names = {"remove": "node removed", "add": "node added"}
            faults += [(names[e["event"]], e["time"]) for e in map(json.loads, f)]
    for what, when in faults:
        after = [t for t in starts if t > when]
        if after:
            print(f"{what} -> first step of the next attempt: {after[0] - when:.1f} s", flush=True)


def _resize(cluster, node, config: dict, fit: threading.Thread) -> None:
    """Removes `node` after step remove_at (2 workers), adds a node after step add_at (1)."""
    out = config["out"]

    def wait_for(name: str) -> None:
        while not os.path.exists(os.path.join(out, name)):
            if not fit.is_alive():
                raise RuntimeError(f"the run ended before {name}")
            time.sleep(0.05)

    def event(what: str) -> None:
        with open(os.path.join(out, "events.jsonl"), "a") as f:
            f.write(json.dumps({"event": what, "time": time.time()}) + "\n")

    wait_for(f"step_2_{config['remove_at']}")
    event("remove")
    cluster.remove_node(node)  # its worker dies with it: a real SIGKILL
    wait_for(f"step_1_{config['add_at']}")
    event("add")
    cluster.add_node(num_cpus=1)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("worker", *PLANS))
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.mode == "worker":
        sys.path.insert(0, HERE)
        plan = PLANS["fit"]
        train(dict(plan, out=args.out, backup=os.path.join(args.out, "backup")))
        return 0
    return drive(args.mode, args.out)


if __name__ == "__main__":
    sys.exit(main())
