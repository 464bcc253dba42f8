"""One process of a 2-process job used by tests/test_checkpoint_local.py.

Joins a JAX distributed job on loopback (gloo collectives, 4 CPU devices per process)
and uses ``CheckpointManager`` with a local tier (``--local``) beside the persistent
directory (``--dir``): a persistent save every 10 steps, a local one every 2.

``--save N`` trains N steps (the state after step k is ``w0 + k`` replicated,
``s0 + 2k`` sharded by rows over all 8 devices, a PRNG key and a host array ``k``),
waits for the writes and prints ``SAVED``. Then both restore, and process 1 is
SIGKILLed in the middle (after the tier's first collective): process 0 prints
``FAILED <seconds> <error>`` and SIGKILLs itself, leaving the files as a crash would.

``--scenarios`` restores, changes the local tier between restores as the test's
scenarios say (one process deletes or garbles files, then both meet at a barrier),
and prints ``RESTORED <scenario> <step> <source> <ok>`` for each, ``ok`` saying whether
the state, data position and metadata are exactly those saved at that step. Then, in
another local directory, process 1's write of step 4 fails (a file stands where the
step's directory goes) and both print ``FAILED <seconds> <error>`` from the next save.
Last, both restore with a 2 s wait bound and process 1 SIGSTOPs itself in the middle:
process 0 prints ``FAILED <seconds> <error>``, SIGKILLs process 1 and exits.

The SIGKILL and SIGSTOP land right after the tier's first collective of the restore:
the script wraps ``_process_exchange.gather`` to send them (the only place it reaches
inside).
"""

import argparse
import os
import shutil
import signal
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--local", required=True)
    p.add_argument("--save", type=int, default=0)
    p.add_argument("--scenarios", action="store_true")
    args = p.parse_args()

    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = (
        "--xla_force_host_platform_device_count=4 "
        + os.environ.get("DISTRAIN_TEST_XLA_COMPILE_FLAGS", "")  # tests/conftest.py
    )
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{args.port}", num_processes=2, process_id=args.process_id
    )
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from distrain._src.checkpoint import _process_exchange
    from distrain.checkpoint import CheckpointManager

    mesh = jax.make_mesh((8,), ("d",), devices=jax.devices())
    rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("d"))

    def state_at(k):
        def place(value, sharding):
            return jax.make_array_from_callback(value.shape, sharding, lambda idx: value[idx])

        return {
            "w": place(np.arange(15, dtype=np.float32).reshape(5, 3) + k, rep),
            "s": place(np.arange(96, dtype=np.float32).reshape(16, 6) + 2 * k, rows),
            "rng": jax.random.wrap_key_data(
                place(np.asarray(jax.random.key_data(jax.random.key(k))), rep)
            ),
            "host": np.full(2, k, np.int64),
        }

    def same(a, b):
        def values(t):
            arrays = [t["w"], t["s"], jax.random.key_data(t["rng"])]
            return [multihost_utils.process_allgather(x, tiled=True) for x in arrays] + [t["host"]]

        return all(np.array_equal(x, y) for x, y in zip(values(a), values(b), strict=True))

    def manager(local=args.local, persistent=args.dir):
        return CheckpointManager(
            persistent,
            save_interval_steps=10,
            local_directory=local,
            local_save_interval_steps=2,
        )

    me = jax.process_index()

    def stop_after_first_collective(sig):
        """Process 1 gets ``sig`` right after the local tier's next collective returns."""
        real = _process_exchange.gather

        def gather(*a, **kw):
            out = real(*a, **kw)
            os.kill(os.getpid(), sig)
            return out

        if me == 1:
            _process_exchange.gather = gather

    def failed(what):
        """Runs ``what``; prints ``FAILED <seconds> <error>`` (one line) if it raises."""
        began = time.monotonic()
        try:
            what()
        except Exception as e:  # noqa: BLE001 - the test reads the type and message
            text = f"{type(e).__name__}: {e}".replace("\n", " ")
            print(f"FAILED {time.monotonic() - began:.1f} {text}", flush=True)
            return True
        print("NOT FAILED", flush=True)
        return False

    if args.save:
        mgr = manager()
        for k in range(1, args.save + 1):
            mgr.save(k, state_at(k), data_state={"pos": k}, metadata={"k": k})
        mgr.wait_until_finished()
        print("SAVED", flush=True)
        multihost_utils.sync_global_devices("saved")
        stop_after_first_collective(signal.SIGKILL)
        failed(lambda: manager().restore(target=state_at(0)))
        os.kill(os.getpid(), signal.SIGKILL)

    local = os.path.join(args.local, f"process-{me}")

    def garble(path):
        with open(path, "r+b") as f:
            b = bytearray(f.read())
            b[len(b) // 2] ^= 0xFF
            f.seek(0)
            f.write(b)

    scenarios = {
        "as_saved": lambda: None,
        # Process 0's own copy of the newest step is lost: its peer (process 1) has it.
        "own_lost": lambda: me == 0 and shutil.rmtree(os.path.join(local, "14")),
        # ...and the peer's copy is garbled: the newest step both have is 12.
        "peer_garbled": lambda: (
            me == 1 and garble(os.path.join(local, "peer-of-0", "14", "arrays.bin"))
        ),
        # Process 0's whole local directory is gone (a lost node): step 12 from the peer.
        "node_lost": lambda: me == 0 and shutil.rmtree(local),
        # ...and the peer's copies too: the persistent checkpoint (step 10).
        "peer_deleted": lambda: me == 1 and shutil.rmtree(os.path.join(local, "peer-of-0")),
    }
    for name, change in scenarios.items():
        change()
        multihost_utils.sync_global_devices(f"scenario {name}")
        mgr = manager()
        r = mgr.restore(target=state_at(0))
        ok = (
            same(r.state, state_at(r.step))
            and r.data_state == {"pos": r.step}
            and r.metadata == {"k": r.step}
            and r.state["s"].sharding == state_at(0)["s"].sharding
        )
        print(f"RESTORED {name} {r.step} {mgr.restored_from} {ok}", flush=True)
        mgr.close()

    # Process 1's background write of step 4 fails: every process must raise at the next
    # save (before: process 1 alone raised, process 0 waited in the exchange).
    # (Other directories: nothing persistent, so that the restore below uses the tier.)
    other = (args.local + "-w", args.dir + "-w")
    broken = os.path.join(other[0], f"process-{me}")
    mgr = manager(*other)
    mgr.save_local(2, state_at(2))
    mgr.wait_until_finished()
    if me == 1:
        with open(os.path.join(broken, "4"), "w") as f:  # where step 4's directory goes
            f.write("not a directory")
    multihost_utils.sync_global_devices("broken")
    mgr.save_local(4, state_at(4))
    failed(lambda: mgr.save_local(6, state_at(6)))
    multihost_utils.sync_global_devices("write failed")

    # Process 1 freezes mid-restore: process 0 gives up after the wait bound.
    _process_exchange.WAIT_SECONDS = 2.0
    pid_file = os.path.join(other[0], "frozen.pid")
    if me == 1:
        with open(pid_file, "w") as f:
            f.write(str(os.getpid()))
    multihost_utils.sync_global_devices("frozen next")
    stop_after_first_collective(signal.SIGSTOP)  # process 0 then sends step 4 to process 1
    failed(lambda: manager(*other).restore(target=state_at(0)))
    with open(pid_file) as f:
        os.kill(int(f.read()), signal.SIGKILL)
    os._exit(0)  # JAX's shutdown barrier would wait for the killed process


if __name__ == "__main__":
    sys.exit(main())
