"""Starting test processes together and always cleaning them up."""

from __future__ import annotations

import os
import signal
import subprocess
import time


def xla_flags(devices: int) -> str:
    """``XLA_FLAGS`` for a process a test starts: ``devices`` CPU devices and the suite's
    compile flags (``tests/conftest.py`` puts them in ``DISTRAIN_TEST_XLA_COMPILE_FLAGS``)."""
    extra = os.environ.get("DISTRAIN_TEST_XLA_COMPILE_FLAGS", "")
    return f"--xla_force_host_platform_device_count={devices} {extra}".strip()


def run_together(jobs, timeout: float) -> list[tuple[int, str, float]]:
    """Starts ``(argv, env)`` jobs at once and waits for all of them.

    Returns ``[(returncode, output, seconds since the start)]`` in job order. Each job
    runs in its own process group; whatever is still running when this returns (or a
    wait times out) is killed with its children.
    """
    procs, started = [], time.monotonic()
    try:
        for argv, env in jobs:
            procs.append(
                subprocess.Popen(
                    argv,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        results = []
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            results.append((p.returncode, out.decode(errors="replace"), time.monotonic() - started))
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def stop_launcher(proc: subprocess.Popen, grace: float = 60.0) -> None:
    """Stops a `distrain launch` still running (a test that failed or timed out): SIGTERM
    first, on which it stops its processes and its Ray head; a SIGKILL of its process
    group alone would leave the Ray head running, in a session of its own, loading the
    machine for every later test. SIGKILL after ``grace`` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
