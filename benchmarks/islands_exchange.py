"""The islands' exchange: bytes through the busiest process per round, star and shards.

Fault-isolated islands (``dt.experimental.islands.train``) exchange pseudo-gradients and
parameters through Ray. Before issue 57 item 2 one actor received every island's whole
pseudo-gradient and sent every island the whole parameters: ``2 x islands x
param_bytes`` per round through one process. Now the parameters and the outer optimizer
state are split into ``exchange_shards`` holders (one per island by default) and every
island talks to each holder for its shard only.

This benchmark runs the real thing without training: a local Ray, the real coordinator
actor and shard holder actors, and islands as Ray actors (one process each) that join,
lease, submit synthetic float32 pseudo-gradients through the real proxy
(``remote.Coordinator``) and read the parameters back, for ``--rounds`` rounds. Arms:
``before`` (``exchange_shards=1``: the star, one holder) and ``after`` (one holder per
island), for each model size and island count.

Bytes are counted where they pass through Ray: each island's proxy counts the
pseudo-gradient segments it sends and the parameter segments it receives; each holder
counts the segments it receives (``put``) and sends (``params``). The coordinator
receives no tensor (its calls carry ids, rows and metrics: counted as 0). A process's
bytes per round: its bytes over the run, less the final read of the finished
parameters, divided by the rounds. The one-time initial values (the first island makes
the holders) are not counted.

Example::

    python -m benchmarks.islands_exchange --json benchmarks/results/islands_exchange.json
    python -m benchmarks.islands_exchange --sizes-mb 1 --islands 2 --rounds 2  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

COMMAND = "python -m benchmarks.islands_exchange --json benchmarks/results/islands_exchange.json"


def _shapes(param_bytes: int) -> list[tuple[int, ...]]:
    """Four float32 leaves of unequal sizes (an embedding-like one holds half)."""
    n = param_bytes // 4
    rows, b, c = n // 2 // 64, n // 4, n // 8
    return [(rows, 64), (b,), (c,), (n - rows * 64 - b - c,)]


class _Island:
    """One island's process: the real proxy, synthetic pseudo-gradients."""

    def run(
        self, island: int, config: Any, shapes: list[tuple[int, ...]], directory: str
    ) -> dict[str, Any]:
        import optax

        from distrain._src.islands import remote
        from distrain._src.islands.islands_config import structure_of

        leaves = [np.zeros(s, np.float32) for s in shapes]
        grads = [np.full(s, 1e-3 * (island + 1), np.float32) for s in shapes]
        treedef = "PyTreeDef([*, *, *, *])"
        outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
        args = (config, leaves, treedef, outer, directory)
        coord = remote.coordinator(remote.actor_name(directory), args, 600.0)
        structure = structure_of(leaves, treedef)
        token, _ = coord.retry(lambda: coord("join", island, structure))
        starts, after, counts = [], -1, (0, 0)
        while True:
            counts = (coord.bytes_sent, coord.bytes_received)  # before the last read too
            r, params, finished, _, _ = coord.poll("wait_round", island, token, after, until=600)
            starts.append(time.time())
            if finished:
                break
            del params
            positions, _ = coord.poll("lease", island, token, r, until=600)
            coord("submit", island, token, r, grads if len(positions) else None, {"loss": 0.0})
            after = r
        coord("leave", island, token)
        return {"starts": starts, "bytes_sent": counts[0], "bytes_received": counts[1]}


def _arm(
    ray: Any, arm: str, islands: int, param_bytes: int, rounds: int, root: str
) -> dict[str, Any]:
    from distrain._src.islands import param_shards, remote
    from distrain._src.islands.islands_config import IslandsConfig

    shards = 1 if arm == "before" else islands
    shapes = _shapes(param_bytes)
    config = IslandsConfig(
        islands=islands, sync_every=1, batch_size=1, num_rows=islands * rounds, seed=None,
        death_timeout=600.0, heartbeat_interval=1.0, round_timeout=600.0,
        exchange_shards=shards,
    )  # fmt: skip
    directory = os.path.join(root, f"{arm}-{islands}-{param_bytes}")
    actor = ray.remote(_Island).options(
        num_cpus=0, runtime_env={"env_vars": {"JAX_PLATFORMS": "cpu"}}
    )
    procs = [actor.remote() for _ in range(islands)]
    results = ray.get([p.run.remote(i, config, shapes, directory) for i, p in enumerate(procs)])
    cut = param_shards.plan(shapes, shards)
    holders = [
        ray.get_actor(remote.holder_name(directory, k, shards), namespace=remote.NAMESPACE)
        for k in range(shards)
    ]
    stats = ray.get([h.status.remote() for h in holders])
    per_process = {}
    for i, res in enumerate(results):
        per_process[f"island {i}"] = (res["bytes_sent"] + res["bytes_received"]) / rounds
    for k, st in enumerate(stats):
        shard_bytes = 4 * sum(s.stop - s.start for s in cut[k])
        final_reads = islands * shard_bytes  # each island's read of the finished model
        per_process[f"holder {k}"] = (
            st["bytes_received"] + st["bytes_sent"] - final_reads
        ) / rounds
        ray.kill(holders[k], no_restart=True)
    per_process["coordinator"] = 0.0
    with_coordinator = ray.get_actor(remote.actor_name(directory), namespace=remote.NAMESPACE)
    ray.kill(with_coordinator, no_restart=True)
    for p in procs:
        ray.kill(p)
    starts = results[0]["starts"]
    gaps = [b - a for a, b in zip(starts[1:-1], starts[2:], strict=False)]  # round 0 compiles
    busiest = max(per_process, key=lambda k: per_process[k])
    shutil.rmtree(directory, ignore_errors=True)
    return {
        "arm": arm,
        "islands": islands,
        "nproc_per_island": 1,
        "exchange_shards": shards,
        "param_bytes": param_bytes,
        "busiest_process_bytes_per_round": int(per_process[busiest]),
        "busiest_process": busiest,
        "busiest_over_param_bytes": round(per_process[busiest] / param_bytes, 3),
        "bytes_per_round_by_process": {k: int(v) for k, v in per_process.items()},
        "round_s": round(statistics.median(gaps), 3) if gaps else None,
        "rounds": rounds,
    }


def _fits(arm: str, islands: int, param_bytes: int) -> str | None:
    """Why a row would not fit this machine's memory, or None. Estimated peak: each
    island holds the parameters, its pseudo-gradient and Ray's copies (x4); the holders
    together hold every island's pending shards, the parameters, the momentum, the
    staged copies and the mean's temporaries (islands + 6), Ray's object store a copy
    of every put."""
    need = param_bytes * (4 * islands + islands + 6 + islands)
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    if need > 0.8 * have:
        return (
            f"an estimated {need / 2**30:.1f} GiB at peak, more than 80% of the "
            f"{have / 2**30:.1f} GiB available on this machine"
        )
    return None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--islands", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--budget-s", type=float, help="rows not started within it are written as skipped"
    )
    args = parser.parse_args(argv)
    import ray

    root = tempfile.mkdtemp(prefix="islands-exchange-")
    from distrain._src.ps.ray_backend import connect

    for attempt in range(6):  # a local Ray, as `distrain launch` and the tests start it
        try:
            connect(None)
            break
        except Exception:  # Ray's head gives up after 30 s on a loaded machine: again
            ray.shutdown()
            if attempt == 5:
                raise
    rows: list[dict[str, Any]] = []
    started = time.time()
    try:
        for mb in args.sizes_mb:
            for islands in args.islands:
                for arm in ("before", "after"):
                    param_bytes = int(mb * 1e6) // 4 * 4
                    why = _fits(arm, islands, param_bytes)
                    spent = time.time() - started
                    if why is None and args.budget_s is not None and spent > args.budget_s:
                        why = (
                            f"not run: the --budget-s {args.budget_s:g} s of this run was spent "
                            f"(load average {os.getloadavg()[0]:.0f} on this machine)"
                        )
                    if why is not None:
                        row = {"arm": arm, "islands": islands, "nproc_per_island": 1,
                               "param_bytes": param_bytes, "skipped": why}  # fmt: skip
                    else:
                        t0 = time.time()
                        row = _arm(ray, arm, islands, param_bytes, args.rounds, root)
                        row["wall_s"] = round(time.time() - t0, 1)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
                    _write(args, argv, rows)
    finally:
        ray.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    return _write(args, argv, rows)


def _write(
    args: argparse.Namespace, argv: list[str] | None, rows: list[dict[str, Any]]
) -> dict[str, Any]:
    """The result, written to ``--json`` (after every row: a run cut short keeps its rows)."""
    import jax

    for row in rows:
        if row.get("arm") == "after" and "skipped" not in row:
            row["target_met"] = row["busiest_process_bytes_per_round"] <= 4 * row["param_bytes"]
    result = {
        "command": COMMAND
        if argv is None
        else "python -m benchmarks.islands_exchange " + " ".join(argv),
        "jax_version": jax.__version__,
        "python": sys.version.split()[0],
        "loadavg": os.getloadavg(),
        "counted": (
            "bytes of float32 tensors passed through Ray, per process: each island's proxy "
            "counts the pseudo-gradient segments it puts to the holders and the parameter "
            "segments it reads from them; each holder counts the segments it receives and "
            "sends; the coordinator receives no tensor (ids, rows, metrics only: 0). Per "
            "round: the process's bytes over the run, less the final read of the finished "
            "parameters, divided by the rounds. The initial values sent once when the "
            "first island makes the holders are not counted."
        ),
        "target": (
            "after arm: busiest_process_bytes_per_round <= 4 x param_bytes / nproc_per_island"
        ),
        "rows": rows,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return result


if __name__ == "__main__":
    main()
