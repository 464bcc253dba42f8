"""What the local tier's exchange holds beyond the state: two real processes, peak memory.

Starts two processes on 127.0.0.1 (``jax.distributed``, gloo, one CPU device each).
Each puts a state of ``--state-mib`` MiB on its device, copies it to the host as a
local save does, sends it to the other with the tier's exchange (``CHUNK_BYTES`` per
collective) and reads its peak resident memory over the exchange (Linux: ``VmHWM``,
reset through ``/proc/self/clear_refs`` just before). Beyond what it held before (the
state and its host copy) and the peer's copy it receives (which the save writes), the
rest is what the exchange stages: ``local_exchange_extra_bytes``, the larger of the two
processes' figures at the largest state. On CPU a device's memory is the host's, so
the figure counts the device staging too. Each process checks the bytes it received.

Usage:
  python -m benchmarks.local_exchange                     # prints the figures
  python -m benchmarks.local_exchange --update benchmarks/results/goodput.json

``benchmarks/goodput.py`` calls :func:`measure` and writes the same fields.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20


def _memory(field: str) -> int:
    """A ``/proc/self/status`` figure, in bytes (``VmRSS``, ``VmHWM``)."""
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1)) * 1024  # type: ignore[union-attr]


def _state_bytes(process: int, mib: int):
    import numpy as np

    return np.random.default_rng([process, mib]).integers(0, 256, mib * MIB, dtype=np.uint8)


def _worker(args: argparse.Namespace) -> None:
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{args.port}", num_processes=2, process_id=args.worker)
    from jax.experimental import multihost_utils

    from distrain._src.checkpoint import _local_copy, _process_exchange

    me, pairs = jax.process_index(), [(0, 1), (1, 0)]
    chunk = args.chunk_bytes or _process_exchange.CHUNK_BYTES
    for i, mib in enumerate(int(m) for m in args.state_mib.split(",")):
        state = {"w": jax.device_put(_state_bytes(me, mib), jax.local_devices()[0])}
        manifest, chunks = _local_copy.pack(0, state, None, None)  # the host copy a save makes
        parts = [_local_copy.head_bytes(manifest), *chunks]
        if i == 0:  # compiles the exchange (the sizes below reuse it: whole chunks)
            _process_exchange.exchange(parts, pairs, "the warm-up", chunk_bytes=chunk)
        gc.collect()
        before = _memory("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        got = _process_exchange.exchange(parts, pairs, "the measured exchange", chunk_bytes=chunk)
        peak = _memory("VmHWM")
        assert got is not None
        _, arrays = _local_copy.from_blob(got)
        ok = bytes(arrays) == _state_bytes(1 - me, mib).tobytes()
        row = {"process": me, "state_mib": mib, "extra": peak - before - got.nbytes, "ok": ok}
        print("EXCHANGE " + json.dumps(row), flush=True)
        del state, manifest, chunks, parts, got, arrays
    multihost_utils.sync_global_devices("measured")  # process 0 hosts the coordinator
    os._exit(0)  # both are done: no need for JAX's shutdown barrier


def measure(
    state_mib: tuple[int, ...] = (128, 512), chunk_bytes: int | None = None, timeout: float = 300
) -> dict:
    """Runs the two processes; ``local_exchange_chunk_bytes`` and
    ``local_exchange_extra_bytes`` (the largest state's, the larger process's), and the
    extra bytes per state size."""
    from distrain._src.checkpoint import _process_exchange
    from distrain._src.cluster.launch import free_port

    port, sizes = free_port(), ",".join(str(m) for m in state_mib)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "benchmarks.local_exchange",
                "--worker",
                str(i),
                "--port",
                str(port),
                "--state-mib",
                sizes,
                "--chunk-bytes",
                str(chunk_bytes or 0),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for i in range(2)
    ]
    rows, outs = [], []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outs.append(out)
            rows += [json.loads(x[9:]) for x in out.splitlines() if x.startswith("EXCHANGE ")]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if len(rows) != 2 * len(state_mib) or not all(r["ok"] for r in rows):
        raise SystemExit("the exchange measurement failed:\n" + "\n".join(o[-3000:] for o in outs))
    by_size = {m: max(r["extra"] for r in rows if r["state_mib"] == m) for m in state_mib}
    return {
        "local_exchange_chunk_bytes": chunk_bytes or _process_exchange.CHUNK_BYTES,
        "local_exchange_extra_bytes": by_size[max(state_mib)],
        "local_exchange_extra_bytes_by_state_mib": {str(m): b for m, b in by_size.items()},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--state-mib", default="128,512", help="state sizes per process, MiB")
    p.add_argument("--chunk-bytes", type=int, default=0, help="0: the tier's CHUNK_BYTES")
    p.add_argument("--update", help="a JSON file to add the figures to (keeping its fields)")
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        _worker(args)
    sizes = tuple(int(m) for m in args.state_mib.split(","))
    figures = measure(sizes, args.chunk_bytes or None)
    print(json.dumps(figures, indent=1))
    if args.update:
        path = Path(args.update)
        path.write_text(json.dumps({**json.loads(path.read_text()), **figures}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
