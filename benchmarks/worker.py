"""A benchmark worker process: one framework on a fixed number of CPU devices.

The device count (``XLA_FLAGS``, TensorFlow's logical devices) and the Keras backend
must be set before the framework starts, so each (framework, devices) pair lives in
its own process. The runner keeps all of a device count's workers alive at once and
asks them for one repeat at a time, which is what lets it interleave repeats of
different frameworks in one run.

Protocol: one JSON command per line on stdin; one reply per command on stdout,
prefixed with ``@@`` (everything else the libraries print goes to stderr):

* ``{"op": "setup", "workload": "mlp", "config": "distrain_run", "steps": 200}``
  -> ``{"ok": true, "setup_s": ...}`` or ``{"ok": false, "error": "..."}``;
* ``{"op": "time", "workload": ..., "config": ..., "steps": 200}`` -> a sample;
* ``{"op": "close", "workload": "mlp"}`` -> ``{"ok": true}`` (frees that workload);
* ``{"op": "quit"}``.

Example::

    python -m benchmarks.worker --kind jax --devices 8 <<< '{"op": "quit"}'
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from typing import Any

KINDS = ("jax", "keras_jax", "tf")
PREFIX = "@@"


def _configure_environment(kind: str, devices: int, xla_flags: str = "") -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    flags = " ".join(f for f in flags.split() if "xla_force_host_platform_device_count" not in f)
    flags = f"{flags} {xla_flags} --xla_force_host_platform_device_count={devices}"
    os.environ["XLA_FLAGS"] = " ".join(flags.split())
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if kind == "keras_jax":
        os.environ["KERAS_BACKEND"] = "jax"
    elif kind == "tf":
        os.environ["KERAS_BACKEND"] = "tensorflow"


def _make(kind: str, devices: int, workload_name: str, config: str, steps: int) -> Any:
    from benchmarks.workloads import WORKLOADS

    workload = WORKLOADS[workload_name]
    if kind == "jax":
        from benchmarks.loops import make_bench

        return make_bench(config, workload)
    from benchmarks.peers import KerasFit

    backend = "jax" if kind == "keras_jax" else "tensorflow"
    return KerasFit(workload, backend, devices, workload.steps(steps))


def serve(kind: str, devices: int, reply_stream: Any) -> None:
    """Answers commands from stdin until ``quit`` or end of input."""
    if kind == "tf":
        from benchmarks.peers import configure_tensorflow

        configure_tensorflow(devices)
    else:
        import jax

        found = len(jax.devices())
        if found != devices:
            raise RuntimeError(f"Expected {devices} JAX devices, found {found}.")
    benches: dict[tuple[str, str], Any] = {}

    def reply(obj: dict[str, Any]) -> None:
        reply_stream.write(PREFIX + json.dumps(obj) + "\n")
        reply_stream.flush()

    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        op = cmd.get("op")
        if op == "quit":
            break
        if op == "close":  # the runner is done with a workload: free its benches
            for key in [k for k in benches if k[0] == cmd["workload"]]:
                benches.pop(key).close()
            reply({"ok": True})
            continue
        key = (cmd["workload"], cmd["config"])
        try:
            if op == "setup":
                t0 = time.perf_counter()
                bench = _make(kind, devices, cmd["workload"], cmd["config"], cmd["steps"])
                bench.setup()
                benches[key] = bench
                reply({"ok": True, "setup_s": time.perf_counter() - t0})
            elif op == "time":
                from benchmarks.workloads import WORKLOADS

                steps = WORKLOADS[cmd["workload"]].steps(cmd["steps"])
                reply({"ok": True, **benches[key].time(steps)})
            else:
                reply({"ok": False, "error": f"unknown op {op!r}"})
        except Exception as e:  # noqa: BLE001 - reported to the runner, which decides
            traceback.print_exc(file=sys.stderr)
            reply({"ok": False, "error": f"{type(e).__name__}: {e}"})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=KINDS, required=True)
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--xla-flags", default="", help="added to XLA_FLAGS")
    args = parser.parse_args(argv)
    _configure_environment(args.kind, args.devices, args.xla_flags)
    # Replies go to the real stdout; library chatter (Keras, TF, absl) to stderr.
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    sys.stdout = sys.stderr
    serve(args.kind, args.devices, replies)
    replies.flush()
    sys.stderr.flush()
    # A Keras peer's fit thread is parked in a callback; exit without joining it.
    os._exit(0)


if __name__ == "__main__":
    main()
