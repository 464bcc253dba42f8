"""A multi-process job that fails on purpose: for the fault-timing tests.

Joins the cluster from the DISTRAIN_* variables with dt.MultiWorkerMirroredStrategy,
then runs --steps all-reduce steps (each a cross-process collective), printing
"step <i> <unix time>" after each. Process --fault-process then fails after step
--at, on the first attempt only (DISTRAIN_RESTART_COUNT unset or 0):

--fault raise: raises RuntimeError (an uncaught Python error);
--fault kill:  SIGKILLs itself;
--fault exit:  sys.exit(5).

With --finish-early, the processes other than --fault-process stop after step --at
instead of going on (they wait in JAX's shutdown barrier for the faulty one).
Every process prints "fault <unix time>" just before failing and "done" at the end.
"""

import argparse
import os
import signal
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100000)
    parser.add_argument("--at", type=int, default=3)
    parser.add_argument("--fault", choices=("raise", "kill", "exit", "none"), default="none")
    parser.add_argument("--fault-process", type=int, default=1)
    parser.add_argument("--finish-early", action="store_true")
    parser.add_argument("--step-seconds", type=float, default=0.05)
    args = parser.parse_args()

    from distrain import MultiWorkerMirroredStrategy

    strategy = MultiWorkerMirroredStrategy()

    import jax
    import numpy as np

    pid = jax.process_index()
    first_attempt = os.environ.get("DISTRAIN_RESTART_COUNT", "0") == "0"
    faulty = pid == args.fault_process and first_attempt and args.fault != "none"

    def batches():
        while True:  # one row per replica: each process feeds its own rows
            yield {"x": np.ones((strategy.num_replicas_in_sync, 4), np.float32)}

    dataset = iter(strategy.experimental_distribute_dataset(batches()))
    for i in range(1, args.steps + 1):
        per_replica = strategy.run(lambda b: b["x"].sum(), args=(next(dataset),))
        # SUM across replicas: a collective between the processes every step.
        total = float(strategy.reduce("sum", per_replica))
        assert total == 4.0 * strategy.num_replicas_in_sync, total
        print(f"step {i} {time.time():.3f}", flush=True)
        if i == args.at and faulty:
            print(f"fault {time.time():.3f}", flush=True)
            if args.fault == "raise":
                raise RuntimeError(f"injected failure in process {pid} after step {i}")
            if args.fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            sys.exit(5)
        if i == args.at and args.finish_early and not faulty:
            break
        time.sleep(args.step_seconds)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
