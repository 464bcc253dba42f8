"""`distrain launch --evaluator`: the evaluator task, one process beside the workers.

The evaluator runs the same command as the workers with ``DISTRAIN_TASK_TYPE=evaluator``
and without the variables of the workers' ``jax.distributed`` world (coordinator,
process count and id), so ``distrain train`` runs a ``dt.SidecarEvaluator`` there
(``distrain/_src/train/sidecar_run.py``). It is not counted in ``--nproc`` and has its
own fate:

* it starts once, before the workers' first attempt, and keeps running across their
  restarts (a restarted job writes into the same checkpoint directory);
* when it fails (a non-zero status, a kill) it is restarted alone, up to
  ``--max-restarts`` times of its own; the workers never notice;
* when the workers finish, it ends by itself after evaluating the final checkpoint
  (the training's finish mark), and the launcher waits for that; when the workers
  fail for good or the launcher is stopped, it gets SIGTERM (it stops with one line),
  SIGKILL after ``--grace-period``.

Its output lines are prefixed ``[evaluator] ``.

Example:
  distrain launch --nproc 2 --evaluator -- distrain train --config run.yaml
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import threading
import time
from typing import Any

from distrain._src.cluster.base import (
    ENV_COORDINATOR_ADDRESS,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    ENV_TASK_TYPE,
)
from distrain._src.cluster.processes import exit_code, signal_group, status_text

ENV_EVALUATOR_RESTART_COUNT = "DISTRAIN_RESTART_COUNT"  # its own attempts, as the workers'


class Evaluator:
    """The evaluator process and its restarts (a thread watches it).

    Args:
      args: the launcher's arguments (``--max-restarts``, ``--grace-period``, devices).
      command: the program and its arguments, as the workers run it.
      child_env: the launcher's worker environment builder, ``(args, index, port,
        attempt) -> env``; the evaluator takes process 0's and removes the world's
        variables.
      pump: the launcher's output prefixer, ``(stream, prefix, out, lock)``.
      log: the launcher's ``[launch]`` line writer.
      out, lock: where prefixed lines go, and the lock shared with the workers' lines.
    """

    def __init__(
        self,
        args: argparse.Namespace,
        command: list[str],
        *,
        child_env: Any,
        pump: Any,
        log: Any,
        out: Any,
        lock: threading.Lock,
    ) -> None:
        self.args, self.command = args, command
        self._child_env, self._pump, self._log = child_env, pump, log
        self._out, self._lock = out, lock
        self.proc: subprocess.Popen | None = None
        self.status: int | None = None  # the final exit status, once it ended for good
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="evaluator", daemon=True)

    def _env(self, attempt: int) -> dict[str, str]:
        env = self._child_env(self.args, 0, 0, attempt)
        for name in (ENV_COORDINATOR_ADDRESS, ENV_NUM_PROCESSES, ENV_PROCESS_ID, "TF_CONFIG"):
            env.pop(name, None)  # it must not join (or wait for) the workers' world
        env[ENV_TASK_TYPE] = "evaluator"
        env[ENV_EVALUATOR_RESTART_COUNT] = str(attempt)
        return env

    def start(self) -> None:
        """Starts the evaluator (and its watcher thread)."""
        self._thread.start()

    def _run(self) -> None:
        failures = 0
        while not self._stopping.is_set():
            proc = subprocess.Popen(
                self.command,
                env=self._env(failures),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            self.proc = proc
            self._log(f"the evaluator is pid {proc.pid} (attempt {failures + 1})")
            pump = threading.Thread(
                target=self._pump, args=(proc.stdout, b"[evaluator] ", self._out, self._lock)
            )
            pump.daemon = True
            pump.start()
            code = proc.wait()
            pump.join(timeout=5)
            if code == 0 or self._stopping.is_set():
                self.status = code
                return
            what = status_text(code)
            if failures >= self.args.max_restarts:
                self._log(f"the evaluator {what}; out of restarts, the workers go on")
                self.status = code
                return
            failures += 1
            self._log(
                f"the evaluator {what}; restarting it ({failures} of {self.args.max_restarts}); "
                "the workers go on"
            )

    def wait(self) -> int:
        """Waits until it ends by itself (the workers finished: after the final
        checkpoint) and returns its status."""
        self._log("workers finished; waiting for the evaluator to evaluate the final checkpoint")
        self._thread.join()
        return exit_code(self.status or 0)

    def stop(self) -> int:
        """SIGTERM (it stops with one line), SIGKILL after ``--grace-period``; returns its
        status."""
        self._stopping.set()
        proc = self.proc
        if proc is not None and proc.poll() is None:
            signal_group(proc, signal.SIGTERM)
            deadline = time.monotonic() + self.args.grace_period
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            signal_group(proc, signal.SIGKILL)
        self._thread.join(timeout=self.args.grace_period + 5)
        if self.proc is not None and self.proc.poll() is None:  # started as it was stopped
            signal_group(self.proc, signal.SIGKILL)
            self.proc.wait()
        return exit_code(self.status or 0)
