"""Can a surviving process keep its interpreter when a peer dies? What JAX allows.

Three real processes on 127.0.0.1, one virtual CPU device each, this environment's jax:
process 0 (the survivor, which also hosts the coordination service) and process 1 (the
victim) form a 2-process ``jax.distributed`` world and all-gather once; the victim then
SIGKILLs itself. The survivor waits past the heartbeat timeout, shuts its client and
service down, clears the backends, and forms a new world on a new port with a spare
process that had imported jax beforehand and waited; both all-gather again. Run once
with jax's default (the survivor is expected to abort when the peer dies) and once with
``jax_enable_recoverability`` on.

Writes, per arm: whether the survivor outlived the peer, whether the new world formed and
gathered the right values, and the seconds of each piece (the shutdown and clear, the new
world's initialize + first all-gather on the survivor). docs/fault_tolerance.md, "Restart
without a new process", quotes the results of both ends of the jax range.

Usage:
  python -m benchmarks.rejoin_in_process   # writes results/rejoin_in_process_<jax>.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
HEARTBEAT_S = 3  # the victim's death is noticed after this (both ends accept it)

# One process of the experiment; its role in argv[1]. Prints JSON lines for the parent.
_CHILD = r"""
import json, os, signal, sys, time
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
import jax
import numpy as np
from jax.experimental import multihost_utils
import jax.extend

role, first, second = sys.argv[1:4]
recoverable, beat = sys.argv[4] == "1", int(sys.argv[5])
jax.config.update("jax_enable_recoverability", recoverable)

def say(**fields):
    print(json.dumps({"role": role, **fields}), flush=True)

def world(port, pid):
    t = time.perf_counter()
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid,
                               heartbeat_timeout_seconds=beat)
    got = multihost_utils.process_allgather(np.array([pid + 1.0])).ravel().tolist()
    return got, time.perf_counter() - t

if role == "survivor":
    got, _ = world(first, 0)
    say(event="first_world", gathered=got)
    time.sleep(beat + 3)  # past the heartbeat timeout after the victim's death
    say(event="outlived_peer")
    t = time.perf_counter()
    jax.distributed.shutdown()
    jax.extend.backend.clear_backends()
    jax.clear_caches()
    say(event="shutdown", seconds=time.perf_counter() - t)
    got, seconds = world(second, 0)
    say(event="second_world", gathered=got, seconds=seconds)
elif role == "victim":
    world(first, 1)
    os.kill(os.getpid(), signal.SIGKILL)
else:  # the spare: imported, waiting for the new world
    got, seconds = world(second, 1)
    say(event="second_world", gathered=got, seconds=seconds)
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def arm(recoverable: bool, timeout: float = 90.0) -> dict:
    """One run of the three processes; what the survivor and the spare reported."""
    first, second = str(_port()), str(_port())
    argv = [first, second, "1" if recoverable else "0", str(HEARTBEAT_S)]
    procs = {
        role: subprocess.Popen(
            [sys.executable, "-c", _CHILD, role, *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for role in ("survivor", "victim", "spare")
    }
    events: dict[str, dict] = {}
    for role, proc in procs.items():
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        for line in out.splitlines():
            if line.startswith("{"):
                record = json.loads(line)
                events[f"{role}:{record['event']}"] = record
    second_world = events.get("survivor:second_world")
    return {
        "jax_enable_recoverability": recoverable,
        "survivor_exit_status": procs["survivor"].returncode,
        "survivor_outlived_peer": "survivor:outlived_peer" in events,
        "new_world_formed": bool(second_world)
        and second_world["gathered"] == [1.0, 2.0]
        and events.get("spare:second_world", {}).get("gathered") == [1.0, 2.0],
        "shutdown_and_clear_s": events.get("survivor:shutdown", {}).get("seconds"),
        "new_world_initialize_and_allgather_s": (second_world or {}).get("seconds"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="output file (default: results/...)")
    args = parser.parse_args(argv)
    import jax

    rows = [arm(False), arm(True)]
    result = {
        "command": "python -m benchmarks.rejoin_in_process",
        "jax": jax.__version__,
        "python": platform.python_version(),
        "heartbeat_timeout_s": HEARTBEAT_S,
        "loadavg": os.getloadavg(),
        "rows": rows,
    }
    path = args.json or os.path.join(HERE, "results", f"rejoin_in_process_{jax.__version__}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(json.dumps(result, indent=1))
    print(f"wrote {os.path.relpath(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
