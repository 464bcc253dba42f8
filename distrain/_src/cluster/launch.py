"""`distrain launch`: run N processes of one program on this machine, restart them on failure.

Like `torchrun` for one machine:

    distrain launch --nproc 2 --devices-per-proc 2 --max-restarts 3 -- python train.py

starts `python train.py` twice with the variables `dt.MultiWorkerMirroredStrategy()`
reads (DISTRAIN_COORDINATOR_ADDRESS=127.0.0.1:<free port>, DISTRAIN_NUM_PROCESSES,
DISTRAIN_PROCESS_ID, DISTRAIN_LOCAL_DEVICES, and XLA_FLAGS for K virtual CPU
devices), prefixes every output line with "[i] ", and waits. On a GPU machine
`--gpus-per-proc G` gives process i its own GPUs i*G .. i*G+G-1 through
CUDA_VISIBLE_DEVICES (without it every process sees every GPU).

When a process exits with a non-zero status (or is killed), the launcher kills
the others at once (SIGKILL to each process group: without the failed process
they cannot save anyway) and starts all N again on a fresh port, up to
`--max-restarts` times; the program resumes from its latest checkpoint.

A process that exits with `dt.checkpoint.PREEMPTION_EXIT_CODE` (143: it saved
after SIGTERM, run again to continue) was preempted, not failed: the others get
`--grace-period` seconds to exit by themselves (they save the same step), and if
every process exited with 143 or 0 all N start again without using a restart, up
to `--max-preemptions` times (then the launcher exits 143). Only a SIGTERM that
reached the processes and not the launcher does this: when the launcher itself is
stopped (SIGTERM, Ctrl-C) it sends SIGTERM to each process group, SIGKILL after
`--grace-period`, restarts nothing, and exits 143 if every process saved and
exited 143, else 130.

DISTRAIN_RESTART_COUNT tells the program which attempt it is (0, 1, ...). The
launcher's exit status is the last attempt's: 0, the failing process's status,
or 128+signal for a process killed by a signal. A program that cannot be started
is one error line and no restart: status 127 (not found) or 126 (not
executable), as in a shell. A program that is not on PATH but is next to the
launcher's own Python (`.venv/bin/distrain launch -- distrain train ...` without
the environment activated) runs from there, with one line saying so.

The coordinator address is 127.0.0.1:<port>, and process 0's coordinator service
listens on 127.0.0.1 only (see docs/security.md).

The launcher drives one machine. On several machines run the program on each
machine with the variables set by hand (or TF_CONFIG, or under Slurm), and let
the cluster's scheduler restart the job: see docs/multi_worker.md.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO, Any

from distrain._src import verbosity
from distrain._src.checkpoint.preemption import PREEMPTION_EXIT_CODE
from distrain._src.cluster.base import (
    ENV_COORDINATOR_ADDRESS,
    ENV_LOCAL_DEVICES,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
)
from distrain._src.cluster.communication import ENV_TIMEOUT_SECONDS
from distrain._src.goodput import heartbeat

ENV_RESTART_COUNT = "DISTRAIN_RESTART_COUNT"
_DEVICE_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S*")
_LINE_END = re.compile(rb"(\r\n|\n|\r)")
# gloo (JAX's CPU collectives across processes) prints this from C++ to stdout for every
# communicator a process joins, and nothing turns it off (distrain._src.verbosity): the
# launcher drops it when the counts agree, unless DISTRAIN_VERBOSE. A short count, and
# gloo's "is NOT connected to" line after it, pass.
_GLOO_CONNECTED = re.compile(
    rb"\[Gloo\] Rank \d+ is connected to (\d+) peer ranks\. "
    rb"Expected number of connected peer ranks is : (\d+)"
)


def _is_noise(line: bytes) -> bool:
    m = _GLOO_CONNECTED.fullmatch(line.strip())
    return m is not None and m[1] == m[2] and not verbosity.verbose()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _checked(
    convert: Callable[[str], Any], ok: Callable[[Any], bool], expected: str
) -> Callable[[str], Any]:
    """An argparse ``type``: ``convert(text)``, rejected unless ``ok`` (says ``expected``)."""

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, received {text!r}")
        return value

    return parse


_positive_int = _checked(int, lambda v: v >= 1, "an integer >= 1")
_non_negative_int = _checked(int, lambda v: v >= 0, "an integer >= 0")
_positive_float = _checked(float, lambda v: v > 0, "seconds > 0")
_non_negative_float = _checked(float, lambda v: v >= 0, "seconds >= 0")
_port = _checked(int, lambda v: 0 <= v <= 65535, "a port in 0..65535")


EPILOG = """\
exit status and restarts:
  A process exiting non-zero (or killed) is a failure: the others are killed at
  once and all N start again, up to --max-restarts times.
  A process exiting 143 (dt.checkpoint.PREEMPTION_EXIT_CODE: it saved after SIGTERM)
  is a preemption: the others get --grace-period seconds to exit by themselves,
  and if all exited 143 or 0, all N start again without using a restart, up to
  --max-preemptions times (then the launcher exits 143).
  SIGTERM or Ctrl-C to the launcher stops the processes (SIGTERM, SIGKILL after
  --grace-period) and restarts nothing: exit 143 if every process saved and
  exited 143, else 130.
  Otherwise the status is the last attempt's: 0, the failing process's status,
  or 128+signal; 127 (not found) or 126 when the program cannot be started.

program:
  Found on PATH, else next to this launcher's Python (e.g. .venv/bin/distrain
  when the environment is not activated).

network:
  Process 0's coordinator service listens on 127.0.0.1 only; nothing is
  authenticated (docs/security.md).

islands (--islands N):
  Each island is its own group of --nproc-per-island processes with its own
  jax.distributed job, restarted alone after a failure. The launcher starts a
  local Ray cluster on 127.0.0.1 (token authentication) for the islands'
  coordinator and stops it at the end; the islands see RAY_ADDRESS,
  DISTRAIN_ISLAND and DISTRAIN_ISLANDS. Exit status: 0 when every island
  finished, else the first failing island's.

example:
  distrain launch --nproc 2 --devices-per-proc 2 --max-restarts 3 -- python train.py
  distrain launch --islands 4 --max-restarts 5 -- python train_islands.py
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the `distrain launch` options to `parser` (for the `distrain` CLI)."""
    size = parser.add_mutually_exclusive_group(required=True)
    size.add_argument("--nproc", type=_positive_int, help="processes to start")
    size.add_argument(
        "--islands",
        type=_positive_int,
        metavar="N",
        help="start N fault-isolated islands of --nproc-per-island processes each, and a "
        "local Ray cluster for their coordinator (dt.experimental.islands; needs Ray): a "
        "failed island restarts alone (up to --max-restarts times each) while the others "
        "go on",
    )
    parser.add_argument(
        "--nproc-per-island",
        type=_positive_int,
        default=1,
        metavar="P",
        help="with --islands: processes per island (default 1)",
    )
    parser.add_argument(
        "--devices-per-proc",
        type=_positive_int,
        default=None,
        metavar="K",
        help="virtual CPU devices per process (sets XLA_FLAGS and DISTRAIN_LOCAL_DEVICES)",
    )
    parser.add_argument(
        "--gpus-per-proc",
        type=_positive_int,
        default=None,
        metavar="G",
        help="GPUs per process: process i gets GPUs i*G .. i*G+G-1 of this machine (of "
        "CUDA_VISIBLE_DEVICES if set) through CUDA_VISIBLE_DEVICES, and DISTRAIN_LOCAL_DEVICES=G",
    )
    parser.add_argument(
        "--max-restarts",
        type=_non_negative_int,
        default=0,
        metavar="R",
        help="restart all processes up to R times after a failure (default 0); a "
        "preemption does not count (see --max-preemptions)",
    )
    parser.add_argument(
        "--max-preemptions",
        type=_non_negative_int,
        default=10,
        metavar="P",
        help=f"restart all processes up to P times after a preemption: the processes exited "
        f"with {PREEMPTION_EXIT_CODE} (dt.checkpoint.PREEMPTION_EXIT_CODE, 'saved after "
        "SIGTERM') while the launcher itself was not stopped (default 10; 0: exit 143 at "
        "the first)",
    )
    parser.add_argument(
        "--port",
        type=_port,
        default=0,
        help="coordinator port, listened on at 127.0.0.1 only (default: a free port, a new one "
        "per attempt)",
    )
    parser.add_argument(
        "--timeout",
        type=_positive_float,
        default=None,
        metavar="S",
        help="sets DISTRAIN_TIMEOUT_SECONDS: every process must join within S s, and a process "
        "that sends no heartbeat for S s counts as dead, which ends the others "
        "(default: 300 s to join, 20 s heartbeat)",
    )
    parser.add_argument(
        "--grace-period",
        type=_positive_float,
        default=5.0,
        metavar="S",
        help="when the launcher is stopped (SIGTERM, Ctrl-C): seconds between SIGTERM and "
        "SIGKILL to the processes; after a process's preemption exit (143): seconds the "
        "others get to exit by themselves (default 5; after a failure they are killed at once)",
    )
    parser.add_argument(
        "--hang-timeout",
        type=_non_negative_float,
        default=600.0,
        metavar="S",
        help="a process that finishes no step for S s while it is not compiling, saving or "
        "evaluating is hung: it is reported and the job restarts as after a crash (uses one "
        "of --max-restarts). Watched from the first finished step of `Trainer.fit` (or "
        "dt.goodput's Ledger.progress) on; 0 turns it off (default 600)",
    )
    parser.add_argument(
        "--evaluator",
        action="store_true",
        help="also start the evaluator task: one more process of the program, outside the "
        "workers' jax.distributed world and not counted in --nproc, with "
        "DISTRAIN_TASK_TYPE=evaluator (`distrain train` then follows the checkpoints with "
        "dt.SidecarEvaluator); restarted alone after a failure (up to --max-restarts), it "
        "ends after the workers' final checkpoint",
    )
    parser.add_argument(
        "command", nargs=argparse.REMAINDER, help="-- then the program and its arguments"
    )


def _child_env(args: argparse.Namespace, index: int, port: int, attempt: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            ENV_COORDINATOR_ADDRESS: f"127.0.0.1:{port}",
            ENV_NUM_PROCESSES: str(args.nproc),
            ENV_PROCESS_ID: str(index),
            ENV_RESTART_COUNT: str(attempt),
            "PYTHONUNBUFFERED": "1",  # lines reach the prefixer as they are printed
        }
    )
    if args.devices_per_proc is not None:
        flags = _DEVICE_FLAG.sub("", env.get("XLA_FLAGS", "")).strip()
        device_flag = f"--xla_force_host_platform_device_count={args.devices_per_proc}"
        env["XLA_FLAGS"] = f"{flags} {device_flag}".strip()
        env[ENV_LOCAL_DEVICES] = str(args.devices_per_proc)
    if args.gpus_per_proc is not None:
        gpus = _visible_gpus(os.environ, args.nproc * args.gpus_per_proc)
        mine = gpus[index * args.gpus_per_proc : (index + 1) * args.gpus_per_proc]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(mine)
        env[ENV_LOCAL_DEVICES] = str(args.gpus_per_proc)
        # The process sees its GPUs as ordinals 0..G-1: an inherited list of device ids
        # (meant for the whole machine) would name GPUs it cannot see.
        for name in ("DISTRAIN_LOCAL_DEVICE_IDS", "JAX_LOCAL_DEVICE_IDS"):
            env.pop(name, None)
    if args.timeout is not None:
        env[ENV_TIMEOUT_SECONDS] = f"{args.timeout:g}"
    return env


def _visible_gpus(environ: dict[str, str] | os._Environ, needed: int) -> list[str]:
    """The GPU ids to share out: the launcher's CUDA_VISIBLE_DEVICES, else 0 .. needed-1.

    Raises:
        ValueError: CUDA_VISIBLE_DEVICES lists fewer GPUs than the processes need.
    """
    text = environ.get("CUDA_VISIBLE_DEVICES")
    if text is None:
        return [str(i) for i in range(needed)]
    gpus = [g.strip() for g in text.split(",") if g.strip()]
    if len(gpus) < needed:
        raise ValueError(
            f"--nproc x --gpus-per-proc needs {needed} GPUs, but CUDA_VISIBLE_DEVICES lists "
            f"{len(gpus)} ({text!r}). Start fewer processes, give each fewer GPUs, or make "
            "more GPUs visible."
        )
    return gpus


def _pump(stream: IO[bytes], prefix: bytes, out: IO[bytes], lock: threading.Lock) -> None:
    """Copies `stream` to `out`, prefixing every line, as lines arrive.

    Carriage returns end a line too, so progress bars (tqdm redraws with "\r") keep
    their prefix and show live; a segment is written whole, never interleaved.
    """
    pending = b""
    while True:
        chunk = stream.read1(65536) if hasattr(stream, "read1") else stream.read(65536)
        if not chunk:
            break
        pending += chunk
        segments = _LINE_END.split(pending)
        # split() with a capturing group alternates text and terminator; the last
        # element is the unterminated rest.
        pending = segments.pop()
        if segments:
            text = b"".join(
                (prefix + segments[i] if segments[i] else b"") + segments[i + 1]
                for i in range(0, len(segments), 2)
                if not _is_noise(segments[i])
            )
            with lock:
                out.write(text)
                out.flush()
    if pending:
        with lock:
            out.write(prefix + pending + b"\n")
            out.flush()
    stream.close()


def _status_text(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _kill(procs: list[subprocess.Popen]) -> None:
    """SIGKILLs every process group still running and reaps the processes."""
    for p in procs:
        if p.poll() is None:
            _signal_group(p, signal.SIGKILL)
    for p in procs:
        p.wait()


def _stop(procs: list[subprocess.Popen], grace: float) -> None:
    """SIGTERM every process group still running, SIGKILL what is left after `grace` s."""
    # Only groups whose leader is still running: a reaped leader's id may be reused.
    running = [p for p in procs if p.poll() is None]
    for p in running:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in running:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in running:
        # The whole group: the process may have started children of its own.
        _signal_group(p, signal.SIGKILL)
        p.wait()


class _CannotStart(Exception):
    """The program cannot be started at all: restarting it cannot help."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def _own_bin_dir() -> str:
    """The directory of the launcher's own interpreter (a virtual environment's bin/).

    Not resolved through symbolic links: a venv's ``bin/python`` links to the base
    interpreter, whose directory does not hold the venv's scripts.
    """
    return os.path.dirname(os.path.abspath(sys.executable))


def _resolve_program(program: str) -> str | None:
    """Where `program` is: as given when PATH (or its own path) finds it, else the file of
    that name next to the launcher's interpreter; None when neither is executable.

    `distrain launch -- distrain train ...` run as ``.venv/bin/distrain`` without the
    environment activated: ``distrain`` (or ``python``) is not on PATH but sits next to
    the launcher's Python, and is the program the user means.
    """
    if shutil.which(program) is not None:
        return program
    has_dir = os.sep in program or (os.altsep is not None and os.altsep in program)
    if has_dir or not sys.executable:
        return None
    candidate = os.path.join(_own_bin_dir(), program)
    if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
        return candidate
    return None


def _check_program(program: str) -> str:
    """The path to run for `program` (see `_resolve_program`).

    Raises:
        _CannotStart: exit status 127 (not found) or 126 (not executable), as a shell.
    """
    found = _resolve_program(program)
    if found is not None:
        return found
    has_dir = os.sep in program or (os.altsep is not None and os.altsep in program)
    if has_dir and os.path.isfile(program):
        raise _CannotStart(
            f"cannot start {program!r}: not executable. Expected an executable file; run it "
            f"through its interpreter (e.g. `-- python {program}`) or `chmod +x` it.",
            126,
        )
    if has_dir:
        raise _CannotStart(
            f"cannot start {program!r}: no such file. Expected the program to run after "
            "'--', e.g. `distrain launch --nproc 2 -- python train.py`; check the path.",
            127,
        )
    bin_dir = _own_bin_dir() if sys.executable else None
    looked = f"on PATH or in {bin_dir} (next to this launcher's Python)" if bin_dir else "on PATH"
    raise _CannotStart(
        f"cannot start {program!r}: not found {looked}. Expected the program to run after "
        "'--', e.g. `distrain launch --nproc 2 -- python train.py`; check its spelling, give "
        "its full path, or activate the environment that provides it (e.g. "
        "`source .venv/bin/activate`).",
        127,
    )


class _Launcher:
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
        hang = getattr(args, "hang_timeout", 0)
        self.watch = heartbeat.Watch(args.nproc, hang) if hang else None
        self.hang: heartbeat.Stall | None = None  # the stall that ended the last attempt

    def stop(self) -> None:
        """From another thread: restart nothing more, and end the running attempt as a
        stopped launcher does (SIGTERM, SIGKILL after ``--grace-period``; the attempt's
        thread does it, and reports no failure)."""
        self.stopped = True

    def kill(self) -> None:
        """From another thread, after :meth:`stop`: SIGKILL whatever still runs (an
        attempt whose thread did not end in time)."""
        self.stopped = True
        _kill(list(self.procs))

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
        preempted = False
        after_hang = {heartbeat.ENV_AFTER_HANG: self.hang.to_env()} if self.hang else {}
        self.hang = None
        if self.watch is not None:
            self.watch.reset()
        try:
            for i in range(self.args.nproc):
                beat = self.watch.env(i) if self.watch is not None else {}
                try:
                    proc = subprocess.Popen(
                        self.command,
                        env={
                            **_child_env(self.args, i, port, attempt),
                            **self.env,
                            **beat,
                            **after_hang,
                        },
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,  # its own process group, stopped as a unit
                    )
                except OSError as e:  # e.g. an exec format error the check could not see
                    raise _CannotStart(
                        f"cannot start {self.command[0]!r}: {e.strerror or e}. Expected a "
                        "program that runs on this machine.",
                        127 if isinstance(e, FileNotFoundError) else 126,
                    ) from None
                procs.append(proc)
                pump = threading.Thread(
                    target=_pump,
                    args=(proc.stdout, f"[{self.name}{i}] ".encode(), self.out, self.lock),
                    daemon=True,
                )
                pump.start()
                pumps.append(pump)
            # The ids to signal by hand (`kill -9 PID`: the fault tolerance, tried out).
            self.log(", ".join(f"process {i} is pid {p.pid}" for i, p in enumerate(procs)))
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
                self.log(f"process {failure[0]} {_status_text(failure[1])}{others}")
                # At once, no grace period: the others cannot save a checkpoint without
                # the failed process (a save is collective), and JAX's preemption
                # service swallows SIGTERM in them anyway.
                _kill(procs)
        finally:
            _stop(procs, self.args.grace_period)
            for pump in pumps:
                pump.join(timeout=5)
        if self.stopped:
            return 130, False  # the launcher itself was stopped: its caller says so
        if failure is None:
            self.log("finished" if self.name else "all processes finished")
            return 0, False
        return _exit_code(failure[1]), preempted

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
            stall = None if self.watch is None else self.watch.check([c is None for c in codes])
            if stall is not None:
                self.hang = stall
                self.log(
                    f"process {stall.process} (pid {stall.pid}) made no progress for "
                    f"{stall.seconds:.1f} s (--hang-timeout {self.args.hang_timeout:g}; last "
                    f"finished step {stall.step}, not compiling, saving or evaluating): hung; "
                    f"stopping {self._scope}"
                )
                _kill(procs)
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
            _kill(procs)
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
            self.log(f"process {i} {_status_text(code)} (a failure, not a preemption)")
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
            if self.watch is not None:
                self.watch.close()

    def _attempts(self) -> int:
        failures = preemptions = 0
        attempt = 0
        while True:
            limit = attempt + 1 + self.args.max_restarts - failures
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


class _Terminated(Exception):
    pass


def run(args: argparse.Namespace) -> int:
    """Runs `distrain launch` with parsed arguments (see `add_arguments`); returns the exit code."""
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    islands = args.islands is not None
    for bad, message in (
        (
            not command,
            "expected the program to run after '--', e.g. `distrain launch --nproc 2 -- "
            "python train.py`. Received no command.",
        ),
        (
            args.gpus_per_proc is not None and args.devices_per_proc is not None,
            "--devices-per-proc (virtual CPU devices) and --gpus-per-proc (GPUs) exclude "
            "each other; received both. Use --gpus-per-proc on GPU machines, "
            "--devices-per-proc on CPUs.",
        ),
        (
            not islands and args.nproc_per_island != 1,
            "--nproc-per-island goes with --islands N; received it with --nproc. Use "
            "--nproc P for one job of P processes.",
        ),
        (
            islands and args.gpus_per_proc is not None,
            "--islands does not split GPUs between islands yet; received --gpus-per-proc. "
            "Start one `distrain launch --islands` per GPU set with CUDA_VISIBLE_DEVICES, or "
            "use --devices-per-proc on CPUs.",
        ),
        (
            islands and args.evaluator,
            "--evaluator starts one evaluator beside one job's workers; received it with "
            "--islands. Start the evaluator as its own command: `distrain evaluate --config "
            "FILE --follow`.",
        ),
        (
            islands and bool(args.port),
            "--port names one coordinator port; each island has its own (free ports are "
            "chosen). Remove --port with --islands.",
        ),
    ):
        if bad:
            sys.stderr.write(f"distrain launch: error: {message}\n")
            return 2
    if args.gpus_per_proc is not None:
        try:
            _visible_gpus(os.environ, args.nproc * args.gpus_per_proc)
        except ValueError as e:
            sys.stderr.write(f"distrain launch: error: {e}\n")
            return 2
    try:
        program = _check_program(command[0])
    except _CannotStart as e:
        sys.stderr.write(f"distrain launch: error: {e}\n")
        return e.status
    launcher = _Launcher(args, [program, *command[1:]])
    if program != command[0]:
        launcher.log(
            f"{command[0]!r} is not on PATH; running {program} (next to this launcher's Python)"
        )
    previous = None
    if threading.current_thread() is threading.main_thread():

        def on_term(signum: int, frame: object) -> None:
            raise _Terminated(signum)

        previous = signal.signal(signal.SIGTERM, on_term)
    if islands:
        from distrain._src.islands.launch import run_islands

        try:
            return run_islands(args, [program, *command[1:]], _Launcher, free_port)
        except (FileNotFoundError, RuntimeError) as e:  # no Ray; its head did not start
            sys.stderr.write(f"distrain launch: error: {e}\n")
            return 2
        except (KeyboardInterrupt, _Terminated):
            # run_islands killed every island's processes and stopped the Ray head.
            sys.stderr.write(
                "[launch] interrupted; all islands stopped. Run the same command to continue "
                "from the islands' last round (their coordinator saves each one)\n"
            )
            return 130
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
    evaluator = _start_evaluator(args, launcher) if args.evaluator else None
    try:
        code = launcher.run()
        if evaluator is not None:  # it ends after the final checkpoint, or is stopped
            evaluated = evaluator.wait() if code == 0 else evaluator.stop()
            code = code or evaluated
        return code
    except _CannotStart as e:  # the processes already started were stopped by attempt()
        sys.stderr.write(f"distrain launch: error: {e}\n")
        return e.status
    except (KeyboardInterrupt, _Terminated):
        if evaluator is not None:
            evaluator.stop()
        # The processes were stopped by attempt()'s finally (SIGTERM, then SIGKILL after
        # the grace period). No restart, preempted or not: the launcher was told to stop.
        procs = launcher.procs
        if procs and all(p.returncode == PREEMPTION_EXIT_CODE for p in procs):
            launcher.log(
                f"interrupted; every process saved after SIGTERM and exited with status "
                f"{PREEMPTION_EXIT_CODE}: run the same command to continue"
            )
            return PREEMPTION_EXIT_CODE
        launcher.log("interrupted; all processes stopped")
        return 130
    finally:
        if evaluator is not None:
            evaluator.stop()  # returns at once when it has ended
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _start_evaluator(args: argparse.Namespace, launcher: _Launcher) -> Any:
    """Starts the evaluator task beside the workers (``launch_evaluator``)."""
    from distrain._src.cluster.launch_evaluator import Evaluator

    evaluator = Evaluator(
        args,
        launcher.command,
        child_env=_child_env,
        pump=_pump,
        log=launcher.log,
        out=launcher.out,
        lock=launcher.lock,
    )
    evaluator.start()
    return evaluator


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `distrain launch` / `python -m distrain._src.cluster.launch`.

    Example:
        >>> main(["--nproc", "2", "--", sys.executable, "-c", "print('hi')"])  # doctest: +SKIP
        0
    """
    parser = argparse.ArgumentParser(
        prog="distrain launch",
        description="Run N processes of a program on this machine, restarting them on failure.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
