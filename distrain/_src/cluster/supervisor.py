"""Supervision of one job's processes: start them, wait, restart them after a failure, a
preemption or a hang (`distrain launch`; an island of `distrain launch --islands` has one
supervisor of its own). A restarted process runs in its rank's warm spare when one is
ready (``spares``), else starts cold."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import threading
import time

from distrain._src.checkpoint.preemption import PREEMPTION_EXIT_CODE
from distrain._src.cluster.processes import (
    CannotStart,
    child_env,
    exit_code,
    free_port,
    kill_all,
    prefix_lines,
    status_text,
    stop_all,
)
from distrain._src.cluster.spares import Pool, spare_form
from distrain._src.goodput import heartbeat

#: Spares start ``SPARES_SETTLE_S`` after every process of the attempt finished a step
#: past the first its heartbeat showed (its start-up, restore and first compilation are
#: over), or ``SPARES_AFTER_S`` after the attempt started when no heartbeat says so: not
#: while the workers start up, which their imports (about 3 s of CPU each) would slow down
#: on a machine with few cores.
SPARES_SETTLE_S = 5.0
SPARES_AFTER_S = 60.0


class Supervisor:
    def __init__(
        self,
        args: argparse.Namespace,
        command: list[str],
        *,
        name: str = "",
        env: dict[str, str] | None = None,
        lock: threading.Lock | None = None,
    ):
        self.args = args
        self.command = command
        self.name = name  # "island 2 ": a prefix for its logs and its processes' lines
        self.env = env or {}
        self.procs: list[subprocess.Popen] = []  # the latest attempt's
        self.stopped = False  # set from another thread: restart nothing
        self.out = getattr(sys.stdout, "buffer", None) or sys.stdout
        self.lock = lock or threading.Lock()
        # No watch of its own for `--islands`: each island's supervisor has one.
        hang = getattr(args, "hang_timeout", 0) if args.nproc else 0
        self.watch = heartbeat.Watch(args.nproc, hang) if hang else None
        self.hang: heartbeat.Stall | None = None  # the stall that ended the last attempt
        self.pool = self._pool()
        self._spares_due = 0.0  # when the pool may (re)fill next: inf until the attempt ran
        self._can_restart = True  # a restart (or preemption) is left: spares may be used

    def _pool(self) -> Pool | None:
        """The warm spares (``--spares``; not for islands yet), or None."""
        wanted = getattr(self.args, "spares", None)
        if wanted is False or not self.args.nproc or getattr(self.args, "islands", None):
            return None
        form = spare_form(self.command)
        if form is None:
            if wanted:  # asked for explicitly: say why there are none
                self.log(
                    "--spares: no warm spares for this command, every restart starts cold "
                    "(expected a Python program of this launcher's environment: `python "
                    "SCRIPT`, `python -m MODULE`, `python -c CODE` or a console script such "
                    f"as `distrain`; received {self.command[0]!r})"
                )
            return None
        return Pool(self.command, form, self.args.nproc, env_for=self._spare_env, log=self.log)

    def _env(self, i: int, port: int, attempt: int, extra: dict[str, str]) -> dict[str, str]:
        """Process ``i``'s environment in an attempt."""
        beat = self.watch.env(i) if self.watch is not None else {}
        return {**child_env(self.args, i, port, attempt), **self.env, **beat, **extra}

    def _spare_env(self, i: int) -> dict[str, str]:
        return self._env(i, 0, 0, {})  # the pool drops what changes per attempt

    def stop(self) -> None:
        """From another thread: restart nothing more, and end the running attempt as a
        stopped launcher does (SIGTERM, SIGKILL after ``--grace-period``; the attempt's
        thread does it, and reports no failure)."""
        self.stopped = True

    def kill(self) -> None:
        """From another thread, after :meth:`stop`: SIGKILL whatever still runs (an
        attempt whose thread did not end in time)."""
        self.stopped = True
        kill_all(list(self.procs))

    @property
    def _scope(self) -> str:
        """What one failure stops and restarts: every process, or the island's own."""
        return "its processes" if self.name else "all processes"

    def log(self, message: str) -> None:
        with self.lock:
            sys.stderr.write(f"[launch] {self.name}{message}\n")
            sys.stderr.flush()

    def attempt(self, attempt: int, limit: int) -> tuple[int, bool]:
        """Runs the N processes once.

        Returns:
            (exit code, preempted): 0, or the first failure's exit code; `preempted` when
            the attempt ended in a preemption (see `_after_preemption`).
        """
        port = self.args.port or free_port()
        n = self.args.nproc
        self.log(
            f"starting {n} process{'es' * (n > 1)} (attempt {attempt + 1} of {limit}), "
            f"coordinator 127.0.0.1:{port}"
        )
        procs: list[subprocess.Popen] = []
        self.procs = procs
        pumps: list[threading.Thread] = []
        warm: list[str] = []  # the processes that run in warm spares
        preempted = False
        after_hang = {heartbeat.ENV_AFTER_HANG: self.hang.to_env()} if self.hang else {}
        self.hang = None
        if self.watch is not None:
            self.watch.reset()
        try:
            for i in range(self.args.nproc):
                proc, spare = self._start(i, self._env(i, port, attempt, after_hang))
                procs.append(proc)
                warm += [str(i)] if spare else []
                pump = threading.Thread(
                    target=prefix_lines,
                    args=(proc.stdout, f"[{self.name}{i}] ".encode(), self.out, self.lock),
                    daemon=True,
                )
                pump.start()
                pumps.append(pump)
            # The ids to signal by hand (`kill -9 PID`: the fault tolerance, tried out).
            self.log(", ".join(f"process {i} is pid {p.pid}" for i, p in enumerate(procs)))
            if warm:
                self.log(f"process(es) {', '.join(warm)} run in warm spares")
            self._spares_due = float("inf")  # after this attempt's first steps (_wait)
            self._started = self._next_look = time.monotonic()
            self._first_steps: dict[int, int] = {}
            failure = self._wait(procs)
            if self.stopped:
                pass  # stop(): the finally below ends the processes; no failure to report
            elif failure is not None and failure[1] == PREEMPTION_EXIT_CODE:
                failure, preempted = self._after_preemption(procs, failure[0])
            elif failure is not None and self.hang is not None:
                pass  # _wait reported the hang and killed every process
            elif failure is not None:
                if self.args.nproc == 1:  # an island's one process: the others go on
                    others = "; the other islands go on" if self.name else ""
                elif self.name:
                    others = f"; stopping {self.name.strip()}'s other processes"
                else:
                    others = "; stopping the other processes"
                self.log(f"process {failure[0]} {status_text(failure[1])}{others}")
                # At once, no grace period: the others cannot save a checkpoint without
                # the failed process (a save is collective), and JAX's preemption
                # service swallows SIGTERM in them anyway.
                kill_all(procs)
        finally:
            stop_all(procs, self.args.grace_period)
            for pump in pumps:
                pump.join(timeout=5)
        if self.stopped:
            return 130, False  # the launcher itself was stopped: its caller says so
        if failure is None:
            self.log("finished" if self.name else "all processes finished")
            return 0, False
        return exit_code(failure[1]), preempted

    def _start(self, i: int, env: dict[str, str]) -> tuple[subprocess.Popen, bool]:
        """Process ``i``: its warm spare handed the rank (True), or a new process."""
        if self.pool is not None:
            proc = self.pool.take(i, env)
            if proc is not None:
                return proc, True
        try:
            proc = subprocess.Popen(
                self.command,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, stopped as a unit
            )
        except OSError as e:  # e.g. an exec format error the check could not see
            raise CannotStart(
                f"cannot start {self.command[0]!r}: {e.strerror or e}. Expected a "
                "program that runs on this machine.",
                127 if isinstance(e, FileNotFoundError) else 126,
            ) from None
        return proc, False

    def _tend_spares(self, procs: list[subprocess.Popen]) -> None:
        """(Re)fills the pool once the attempt's processes are past their start-up."""
        if self.pool is None or not self._can_restart:
            return
        now = time.monotonic()
        if self._spares_due == float("inf"):
            if now < self._next_look:
                return
            self._next_look = now + 0.5
            if self._trained() or now - self._started >= SPARES_AFTER_S:
                self._spares_due = now + SPARES_SETTLE_S
        if now >= self._spares_due and any(p.poll() is None for p in procs):
            self._spares_due = now + 0.5
            self.pool.fill()

    def _trained(self) -> bool:
        """Whether every process finished a step past the first its heartbeat showed."""
        if self.watch is None:
            return False
        advanced = True
        for i, path in enumerate(self.watch.paths):
            record = heartbeat.read(path)
            if record is None:
                return False
            first = self._first_steps.setdefault(i, int(record["step"]))
            advanced = advanced and int(record["step"]) > first
        return advanced

    def _wait(self, procs: list[subprocess.Popen]) -> tuple[int, int] | None:
        """Waits until every process exited 0 (returns None) or one failed (its index, code)."""
        while not self.stopped:
            codes = [p.poll() for p in procs]
            failed = [(i, code) for i, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                # A process killed by a signal first: its peers fail fast because of it
                # and may already have exited by the time both are seen here. A
                # preemption exit (143) last: any other failure makes the attempt one.
                return min(failed, key=lambda f: (f[1] == PREEMPTION_EXIT_CODE, f[1] > 0, f[0]))
            if all(code == 0 for code in codes):
                return None
            self._tend_spares(procs)
            stall = None if self.watch is None else self.watch.check([c is None for c in codes])
            if stall is not None:
                self.hang = stall
                self.log(
                    f"process {stall.process} (pid {stall.pid}) made no progress for "
                    f"{stall.seconds:.1f} s (--hang-timeout {self.args.hang_timeout:g}; last "
                    f"finished step {stall.step}, not compiling, saving or evaluating): hung; "
                    f"stopping {self._scope}"
                )
                kill_all(procs)
                return stall.process, -signal.SIGKILL
            time.sleep(0.05)
        return None

    def _after_preemption(
        self, procs: list[subprocess.Popen], index: int
    ) -> tuple[tuple[int, int], bool]:
        """Process `index` exited 143: it saved after SIGTERM. Lets the others finish.

        With several processes, a preempted job saves one step on all of them and each
        exits 143 once its part is written: the others are not killed at once (that
        could cut the save short) but get `--grace-period` seconds to exit by themselves.

        Returns:
            (the (index, status) to report, preempted): preempted when every process
            exited with 0 or 143 by itself; otherwise the attempt counts as a failure
            (a process exited with another status, or did not exit in time and was
            killed: 137).
        """
        grace = self.args.grace_period
        if any(p.poll() is None for p in procs):
            self.log(
                f"process {index} was preempted (exit status {PREEMPTION_EXIT_CODE}: it saved "
                f"after SIGTERM); waiting up to {grace:g} s for the other processes to exit"
            )
        deadline = time.monotonic() + grace
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        stuck = [i for i, p in enumerate(procs) if p.poll() is None]
        if stuck:
            kill_all(procs)
            self.log(
                f"process {stuck[0]} did not exit within {grace:g} s of process {index}'s "
                "preemption exit; killed it (a failure: raise --grace-period if saving takes "
                "longer)"
            )
            return (stuck[0], -signal.SIGKILL), False
        codes = [(i, p.returncode) for i, p in enumerate(procs)]
        failed = [(i, c) for i, c in codes if c not in (0, PREEMPTION_EXIT_CODE)]
        if failed:
            i, code = min(failed, key=lambda f: (f[1] > 0, f[0]))
            self.log(f"process {i} {status_text(code)} (a failure, not a preemption)")
            return (i, code), False
        preempted = [i for i, c in codes if c == PREEMPTION_EXIT_CODE]
        self.log(
            f"preempted: process(es) {', '.join(map(str, preempted))} saved after SIGTERM and "
            f"exited with status {PREEMPTION_EXIT_CODE}"
        )
        return (index, PREEMPTION_EXIT_CODE), True

    def run(self) -> int:
        """Runs attempts until one succeeds or the restarts run out; returns the exit code.

        A failure uses one of `--max-restarts`; a preemption (see `_after_preemption`)
        one of `--max-preemptions` instead. When the launcher itself is stopped it
        raises (`_Terminated`, `KeyboardInterrupt`) and nothing restarts.
        """
        try:
            return self._attempts()
        finally:
            if self.pool is not None:
                self.pool.close()
            if self.watch is not None:
                self.watch.close()

    def _attempts(self) -> int:
        failures = preemptions = 0
        attempt = 0
        while True:
            limit = attempt + 1 + self.args.max_restarts - failures
            self._can_restart = (
                failures < self.args.max_restarts or preemptions < self.args.max_preemptions
            )
            code, preempted = self.attempt(attempt, limit)
            if code == 0 or self.stopped:
                return code
            if preempted and preemptions < self.args.max_preemptions:
                preemptions += 1
                self.log(
                    f"restarting {self._scope} after the preemption ({preemptions} of "
                    f"{self.args.max_preemptions} --max-preemptions; --max-restarts used: "
                    f"{failures} of {self.args.max_restarts})"
                )
            elif preempted:
                self.log(
                    f"giving up after {preemptions} restart(s) after preemptions "
                    f"(--max-preemptions {self.args.max_preemptions}); exit status {code}: the "
                    "processes saved, run the same command to continue"
                )
                return code
            elif failures < self.args.max_restarts:
                failures += 1
                self.log(f"restarting {self._scope} ({failures} of {self.args.max_restarts})")
            else:
                self.log(f"giving up after {attempt + 1} attempt(s); exit status {code}")
                return code
            attempt += 1
