"""A small multi-process training run used by tests/test_multi_worker.py and test_launch.py.

Trains a 8-16-4 MLP for --steps steps with dt.MultiWorkerMirroredStrategy (cluster from
the DISTRAIN_* variables, or one process when none are set) on deterministic data
(batch i is a function of i), then writes the per-step global mean losses and the final
parameters to --out/result_<process id>.npz.

--input global: experimental_distribute_dataset of global batches (each process copies
                only its rows); --input local: distribute_datasets_from_function, where
                each process generates only its own rows.
--ckpt DIR:     save the state after every step and resume from the latest one, with orbax
                directly (--ckpt-impl orbax) or dt.checkpoint.CheckpointManager
                (--ckpt-impl distrain).
--kill-at S:    on the first attempt (DISTRAIN_RESTART_COUNT=0), process --kill-process
                SIGKILLs itself just before step S's checkpoint is written.
--die-at S:     process --kill-process SIGKILLs itself after step S on every attempt.
--term-at S:    on the first attempt, process --kill-process sends itself SIGTERM after
                step S; with --ckpt-impl distrain a dt.checkpoint.PreemptionHandler
                makes every process save that step and exit with 143.
"""

import argparse
import os
import signal
import sys

import jax
import numpy as np
import optax

import distrain as dt


def global_batch(i: int, batch: int) -> dict:
    """Global batch number i: a pure function of i, so a resumed run sees the same data."""
    rng = np.random.default_rng(1000 + i)
    return {
        "x": rng.normal(size=(batch, 8)).astype(np.float32),
        "y": rng.integers(0, 4, size=(batch,)).astype(np.int32),
    }


def initial_state() -> dt.TrainState:
    rng = np.random.default_rng(0)
    params = {
        "w1": (rng.normal(size=(8, 16)) * 0.3).astype(np.float32),
        "b1": np.zeros(16, np.float32),
        "w2": (rng.normal(size=(16, 4)) * 0.3).astype(np.float32),
        "b2": np.zeros(4, np.float32),
    }
    return dt.TrainState.create(params=params, tx=optax.adam(1e-2))


def make_train_step(batch: int):
    def loss_fn(p, b):
        h = jax.nn.relu(b["x"] @ p["w1"] + p["b1"])
        logits = h @ p["w2"] + p["b2"]
        per_example = optax.softmax_cross_entropy_with_integer_labels(logits, b["y"])
        return dt.compute_average_loss(per_example, global_batch_size=batch)

    def train_step(state, b):
        loss, grads = jax.value_and_grad(loss_fn)(state.params, b)
        return state.apply_gradients(grads=grads), loss

    return train_step


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--input", choices=("global", "local"), default="global")
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--ckpt-impl", choices=("orbax", "distrain"), default="orbax")
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--kill-process", type=int, default=1)
    parser.add_argument("--die-at", type=int, default=None)
    parser.add_argument("--term-at", type=int, default=None)
    args = parser.parse_args()

    from distrain import MultiWorkerMirroredStrategy

    # First: joining the cluster must precede any other JAX call.
    strategy = MultiWorkerMirroredStrategy()

    pid, nproc = jax.process_index(), jax.process_count()
    batch = args.batch

    train_step = make_train_step(batch)

    with strategy.scope():
        state = strategy.put_replicated(initial_state())

    start = 0
    manager = None
    if args.ckpt and args.ckpt_impl == "distrain":
        from distrain.checkpoint import CheckpointManager

        manager = CheckpointManager(args.ckpt, async_save=False)
        restored = manager.restore(target=state)
        if restored is not None:
            state, start = restored.state, restored.step
            print(f"resumed from step {start}", flush=True)
    elif args.ckpt:
        import orbax.checkpoint as ocp

        manager = ocp.CheckpointManager(
            os.path.abspath(args.ckpt),
            options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False),
        )
        latest = manager.latest_step()
        if latest is not None:
            target = {"step": state.step, "params": state.params, "opt_state": state.opt_state}
            abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
            restored = manager.restore(latest, args=ocp.args.StandardRestore(abstract))
            state = state.replace(**restored)
            start = latest
            print(f"resumed from step {latest}", flush=True)

    def source(first: int):
        for i in range(first, args.steps):
            yield global_batch(i, batch)

    if args.input == "global":
        dataset = strategy.experimental_distribute_dataset(source(start))
    else:

        def dataset_fn(ctx):
            rows = batch // ctx.num_input_pipelines
            lo = ctx.input_pipeline_id * rows
            for b in source(start):
                # This process generates (here: keeps) only its own rows.
                yield {k: v[lo : lo + rows] for k, v in b.items()}

        dataset = strategy.distribute_datasets_from_function(dataset_fn)

    preemption = None
    if args.term_at is not None:
        preemption = dt.checkpoint.PreemptionHandler(sync_every_steps=1)

    losses = []
    for i, dist_batch in zip(range(start, args.steps), dataset, strict=False):
        state, loss = strategy.run(train_step, args=(state, dist_batch))
        losses.append(float(strategy.reduce("sum", loss)))
        if args.die_at is not None and i + 1 == args.die_at and pid == args.kill_process:
            os.kill(os.getpid(), signal.SIGKILL)
        if (
            args.kill_at is not None
            and i + 1 == args.kill_at
            and pid == args.kill_process
            and os.environ.get("DISTRAIN_RESTART_COUNT", "0") == "0"
        ):
            print(f"killing myself at step {args.kill_at}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if (
            args.term_at is not None
            and i + 1 == args.term_at
            and pid == args.kill_process
            and os.environ.get("DISTRAIN_RESTART_COUNT", "0") == "0"
        ):
            print(f"sending myself SIGTERM at step {args.term_at}", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
        if manager is not None and args.ckpt_impl == "distrain":
            manager.save(i + 1, state)
            if preemption is not None and preemption.should_stop(i + 1):
                print(f"preempted: saved step {i + 1}", flush=True)
                manager.close()
                preemption.exit()
        elif manager is not None:
            target = {"step": state.step, "params": state.params, "opt_state": state.opt_state}
            manager.save(i + 1, args=ocp.args.StandardSave(target))
            manager.wait_until_finished()
        if strategy.is_chief:
            print(f"step {i + 1} loss {losses[-1]:.6f}", flush=True)

    os.makedirs(args.out, exist_ok=True)
    flat = {k: np.asarray(v) for k, v in state.params.items()}
    np.savez(
        os.path.join(args.out, f"result_{pid}.npz"),
        losses=np.asarray(losses, np.float64),
        start=start,
        step=int(state.step),
        nproc=nproc,
        replicas=strategy.num_replicas_in_sync,
        **flat,
    )
    if manager is not None:
        manager.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
