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
`--max-restarts` times; the program resumes from its latest checkpoint. With
`--spares` (the default for a Python program of the launcher's environment) a
restarted process runs in a warm spare that has already imported the libraries
(``spares``), not in a new interpreter.

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
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from distrain._src.checkpoint.preemption import PREEMPTION_EXIT_CODE
from distrain._src.cluster.processes import (
    ENV_RESTART_COUNT,
    CannotStart,
    check_program,
    child_env,
    free_port,
    prefix_lines,
    visible_gpus,
)
from distrain._src.cluster.supervisor import Supervisor

__all__ = ["ENV_RESTART_COUNT", "add_arguments", "free_port", "main", "run"]


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
  A restart hands each rank to its warm spare when there is one (--spares):
  the same program, environment, output prefix and exit status, without a new
  interpreter's imports.

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
    _add_restart_arguments(parser)
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


def _add_restart_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of what happens after a failure, a preemption or a hang."""
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
        "--spares",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep a warm spare beside each process: a Python that has imported jax, flax, "
        "optax, orbax, grain and distrain and waits; a restart hands each rank to its spare "
        "instead of starting a new interpreter (docs/fault_tolerance.md). Default: on when "
        "the program is a Python program of this launcher's environment (`python SCRIPT`, "
        "`-m MODULE`, `-c CODE`, a console script such as `distrain`), else off",
    )


class _Terminated(Exception):
    pass


def _argument_error(args: argparse.Namespace, command: Sequence[str]) -> str | None:
    """The first combination of arguments `distrain launch` refuses, as its error line;
    None when they fit together (argparse has checked each alone).

    Example:
        >>> parser = argparse.ArgumentParser()
        >>> add_arguments(parser)
        >>> _argument_error(parser.parse_args(["--nproc", "2", "--", "python", "x.py"]),
        ...                 ["python", "x.py"]) is None
        True
    """
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
            return message
    if args.gpus_per_proc is not None:
        try:
            visible_gpus(os.environ, args.nproc * args.gpus_per_proc)
        except ValueError as e:
            return str(e)
    return None


def run(args: argparse.Namespace) -> int:
    """Runs `distrain launch` with parsed arguments (see `add_arguments`); returns the exit code.

    The arguments are checked together (:func:`_argument_error`), the program found,
    then either the islands start (:func:`_run_islands`) or one job's processes run under
    the :class:`Supervisor` (:func:`_supervise`), with SIGTERM turned into an exception
    that both stop on.
    """
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    message = _argument_error(args, command)
    if message is not None:
        sys.stderr.write(f"distrain launch: error: {message}\n")
        return 2
    try:
        program = check_program(command[0])
    except CannotStart as e:
        sys.stderr.write(f"distrain launch: error: {e}\n")
        return e.status
    launcher = Supervisor(args, [program, *command[1:]])
    if program != command[0]:
        launcher.log(
            f"{command[0]!r} is not on PATH; running {program} (next to this launcher's Python)"
        )
    previous = None
    if threading.current_thread() is threading.main_thread():

        def on_term(signum: int, frame: object) -> None:
            raise _Terminated(signum)

        previous = signal.signal(signal.SIGTERM, on_term)
    try:
        if args.islands is not None:
            return _run_islands(args, [program, *command[1:]])
        return _supervise(args, launcher)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _run_islands(args: argparse.Namespace, command: list[str]) -> int:
    """`--islands N`: N fault-isolated jobs and their coordinator (``launch_islands``)."""
    from distrain._src.islands.launch_islands import run_islands

    try:
        return run_islands(args, command)
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


def _supervise(args: argparse.Namespace, launcher: Supervisor) -> int:
    """One job's processes under ``launcher`` (and the evaluator beside them, if asked):
    the exit status of the last attempt, 143 when stopped after every process saved,
    else 130 when stopped."""
    evaluator = _start_evaluator(args, launcher) if args.evaluator else None
    try:
        code = launcher.run()
        if evaluator is not None:  # it ends after the final checkpoint, or is stopped
            evaluated = evaluator.wait() if code == 0 else evaluator.stop()
            code = code or evaluated
        return code
    except CannotStart as e:  # the processes already started were stopped by attempt()
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


def _start_evaluator(args: argparse.Namespace, launcher: Supervisor) -> Any:
    """Starts the evaluator task beside the workers (``launch_evaluator``)."""
    from distrain._src.cluster.launch_evaluator import Evaluator

    evaluator = Evaluator(
        args,
        launcher.command,
        child_env=child_env,
        pump=prefix_lines,
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
