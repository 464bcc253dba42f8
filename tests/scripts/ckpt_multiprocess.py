"""One process of a 2-process job used by tests/test_checkpoint_multiprocess.py.

Joins a JAX distributed job on loopback (gloo collectives, 4 CPU devices per process),
updates a state sharded over all 8 devices once per step, and runs until preempted:
``PreemptionHandler(sync_every_steps=2)`` is asked every step; when any process got
SIGTERM, all of them save the same step with ``CheckpointManager`` and exit with
``PREEMPTION_EXIT_CODE``. The state after step k is ``w0 + k`` (replicated),
``s0 + 2k`` (sharded by rows) and the key ``jax.random.key(3)``, so the test can check
what was saved.

It starts from the newest checkpoint in --dir if there is one (all processes restore
it together) and, if not preempted, saves step --max-steps and exits with 0.

Markers on stdout: ``START <k>``, ``STEP <k>``, ``PREEMPTED <k> signalled=<bool>``, ``DONE``.
"""

import argparse
import os
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--num-processes", type=int, default=2)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--max-steps", type=int, default=2000)
    args = p.parse_args()

    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = (
        "--xla_force_host_platform_device_count=4 "
        + os.environ.get("DISTRAIN_TEST_XLA_COMPILE_FLAGS", "")  # tests/conftest.py
    )
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{args.port}",
        num_processes=args.num_processes,
        process_id=args.process_id,
    )
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from distrain.checkpoint import CheckpointManager, PreemptionHandler

    mesh = jax.make_mesh((len(jax.devices()),), ("d",), devices=jax.devices())
    rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("d"))

    def global_array(value, sharding):
        return jax.make_array_from_callback(value.shape, sharding, lambda idx: value[idx])

    state = {
        "w": global_array(np.arange(15, dtype=np.float32).reshape(5, 3), rep),
        "s": global_array(np.arange(96, dtype=np.float32).reshape(16, 6), rows),
        "rng": jax.random.wrap_key_data(
            global_array(np.asarray(jax.random.key_data(jax.random.key(3))), rep)
        ),
    }
    update = jax.jit(lambda st: {"w": st["w"] + 1, "s": st["s"] + 2, "rng": st["rng"]})

    with (
        PreemptionHandler(sync_every_steps=2) as preemption,
        CheckpointManager(args.dir, save_interval_steps=1000) as mgr,
    ):
        restored = mgr.restore(target=state)  # all processes read the checkpoint together
        start = 0 if restored is None else restored.step
        if restored is not None:
            state = restored.state
        print(f"START {start}", flush=True)
        for step in range(start + 1, args.max_steps + 1):
            state = update(state)
            jax.block_until_ready(state)
            print(f"STEP {step}", flush=True)
            time.sleep(0.02)
            if preemption.should_stop(step):
                mgr.save(step, state, metadata={"process_count": jax.process_count()}, force=True)
                mgr.wait_until_finished()
                print(f"PREEMPTED {step} signalled={preemption.signal_received}", flush=True)
                preemption.exit()
        mgr.save(args.max_steps, state, metadata={"process_count": jax.process_count()}, force=True)
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
