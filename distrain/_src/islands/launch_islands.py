"""`distrain launch --islands N`: N fault-isolated process groups and a local Ray cluster.

Each island is a `distrain launch --nproc P` of its own (its own ``jax.distributed``
coordinator port, its own restarts), run on a thread of the launcher; a failed island
restarts alone while the others go on. The Ray head (``ray start --head --block``, on
127.0.0.1, token authentication, a private temporary directory) runs in a session of its
own, which is killed as a whole at the end.
"""

from __future__ import annotations

import argparse
import copy
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from distrain._src.cluster.base import ENV_ISLAND, ENV_ISLANDS
from distrain._src.cluster.processes import free_port
from distrain._src.cluster.supervisor import Supervisor

RAY_START_TIMEOUT_S = 120.0


def _ray_env() -> dict[str, str]:
    """A new cluster's environment, for its head and its islands: loopback only (Ray
    would otherwise advertise the machine's public address), and token authentication.

    The token is new, the cluster's own, and passed in the environment: ``ray start``
    does not create one, and ~/.ray/auth_token is absent on a fresh machine (the head
    then refused to start). A token the user set (``RAY_AUTH_TOKEN`` or
    ``RAY_AUTH_TOKEN_PATH``) wins.
    """
    env = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token"}
    if not ({"RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"} & os.environ.keys()):
        env["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    return env


def _ray_binary() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "ray")
    found = here if os.path.exists(here) else shutil.which("ray")
    if found is None:
        raise FileNotFoundError(
            "distrain launch --islands starts a local Ray cluster for the islands' "
            "coordinator and needs Ray: `pip install 'distrain[ray]'`."
        )
    return found


def start_ray(port: int, num_cpus: int, temp_dir: str, env: dict[str, str]) -> subprocess.Popen:
    """Starts a Ray head on 127.0.0.1:``port`` with its files in ``temp_dir`` and ``env``
    (``_ray_env``) added to this process's environment; returns once it accepts
    connections."""
    proc = subprocess.Popen(
        [
            _ray_binary(),
            "start",
            "--head",
            "--block",
            f"--port={port}",
            f"--num-cpus={num_cpus}",
            "--include-dashboard=false",
            "--disable-usage-stats",
            "--node-ip-address=127.0.0.1",
            # Its own temporary directory: in Ray's default one the head would register
            # as this machine's current cluster, which every other `ray.init()` here
            # then joins (found by the suite: a Ray Train test attached to it).
            f"--temp-dir={temp_dir}",
        ],
        env={**os.environ, **env},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + RAY_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
            raise RuntimeError(f"the local Ray head exited with {proc.returncode}:\n{out[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                pass
            break
        except OSError:
            time.sleep(0.2)
    else:
        stop_ray(proc)
        raise RuntimeError(
            f"the local Ray head did not listen on port {port} within {RAY_START_TIMEOUT_S:g} s."
        )
    # Its output is read and dropped from now on, so that a full pipe never blocks it.
    threading.Thread(target=_drain, args=(proc,), daemon=True).start()
    return proc


def _drain(proc: subprocess.Popen) -> None:
    if proc.stdout:
        for _ in proc.stdout:
            pass


def _session(sid: int) -> list[int]:
    """The processes of session ``sid`` (Linux ``/proc``; empty elsewhere)."""
    pids = []
    for name in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # after "pid (comm)": state, ppid, pgrp, session
            pids.append(int(name))
    return pids


def stop_ray(proc: subprocess.Popen) -> None:
    """Stops the head and every Ray process it started. Ray's workers put themselves in
    process groups of their own, but stay in the head's session (it was started with
    ``start_new_session``), so the session is what is killed."""
    members = _session(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=5.0)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    for pid in {*members, *_session(proc.pid)}:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=5.0)


def run_islands(args: argparse.Namespace, command: list[str]) -> int:
    """Runs ``args.islands`` islands of ``command``, each under a ``Supervisor`` of its own;
    returns the exit status."""
    n = args.islands
    lock = threading.Lock()
    port = free_port()
    islands = f"{n} islands" if n > 1 else "1 island"
    sys.stderr.write(f"[launch] starting a local Ray cluster on 127.0.0.1:{port} for {islands}\n")
    # The cluster's sockets and logs, private: Ray makes its temporary directory
    # world-writable (mode 0777), so it goes inside one of mode 0700 whose name no other
    # user can guess and create first.
    private = tempfile.mkdtemp(prefix="distrain-ray-")
    ray_env = _ray_env()
    try:
        ray = start_ray(
            port, num_cpus=max(2, n + 1), temp_dir=os.path.join(private, "ray"), env=ray_env
        )
    except BaseException:
        shutil.rmtree(private, ignore_errors=True)
        raise
    codes: dict[int, int] = {}
    launchers = []
    for k in range(n):
        island_args = copy.copy(args)
        island_args.nproc = args.nproc_per_island
        island_args.port = 0
        env = {
            **ray_env,
            "RAY_ADDRESS": f"127.0.0.1:{port}",
            ENV_ISLAND: str(k),
            ENV_ISLANDS: str(n),
        }
        launchers.append(Supervisor(island_args, command, name=f"island {k} ", env=env, lock=lock))

    def body(k: int) -> None:
        try:
            codes[k] = launchers[k].run()
        except BaseException:  # noqa: BLE001 - reported as a failure of this island
            codes[k] = 1
            raise

    threads = [threading.Thread(target=body, args=(k,), daemon=True) for k in range(n)]
    try:
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            time.sleep(0.1)
    except BaseException:
        # No island restarts from now on; each island's thread ends its attempt as a
        # stopped launcher does (SIGTERM, SIGKILL after --grace-period), all at once.
        for launcher in launchers:
            launcher.stop()
        try:
            deadline = time.monotonic() + args.grace_period + 10
            for t in threads:
                t.join(timeout=max(0.0, deadline - time.monotonic()))
        finally:  # even on a second Ctrl-C: nothing outlives the launcher
            for launcher in launchers:
                launcher.kill()
        raise
    finally:
        stop_ray(ray)
        shutil.rmtree(private, ignore_errors=True)
    failed = [(k, c) for k, c in sorted(codes.items()) if c != 0]
    if failed:
        sys.stderr.write(
            f"[launch] island(s) {', '.join(str(k) for k, _ in failed)} failed; exit status "
            f"{failed[0][1]}\n"
        )
        return failed[0][1]
    sys.stderr.write(f"[launch] {'all ' if n > 1 else ''}{islands} finished\n")
    return 0
