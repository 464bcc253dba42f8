"""Warm spares: processes `distrain launch` keeps beside its workers, one per rank, that
have already imported jax, flax, optax, orbax, grain and distrain, and take a rank over
when the job restarts, so that a restart does not pay for a new interpreter and its
imports (``--spares``, on by default for a Python program of the launcher's environment).

A spare starts with the environment its rank's worker gets, less the variables that
change from one attempt to the next (:data:`PER_ATTEMPT`), and waits on a pipe
(``spare_main``). At a restart the launcher hands rank ``i`` to spare ``i`` (:meth:`Pool.take`):
the worker's whole environment and command line; the spare becomes the worker in its own
process (same pid, same process group, same output pipe). What the spare cannot be handed
starts cold, as without spares, with one line saying why: no spare yet, a spare that died
while waiting (it is replaced), or an environment that differs in any other variable (a
jax or XLA variable read at import would differ).

Which programs a spare can run (:func:`spare_form`): ``python SCRIPT``, ``python -m
MODULE``, ``python -c CODE`` and console scripts (``distrain train ...``), where the
Python is the launcher's own environment's (the same ``bin/`` directory): that is the
interpreter the spare runs in, with the libraries it imported.

Example:
  >>> form = spare_form(["python", "train.py"])      # "script", or None: cold starts only
  >>> pool = Pool(["python", "train.py"], form, 2, env_for=env_of_rank, log=print)
  >>> pool.fill()                                     # after the attempt's first steps
  >>> proc = pool.take(1, worker_env)                 # a running Popen, or None: start cold
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from typing import IO, cast

from distrain._src.cluster import spare_main
from distrain._src.cluster.base import ENV_COORDINATOR_ADDRESS
from distrain._src.cluster.processes import ENV_RESTART_COUNT, kill_all, status_text
from distrain._src.goodput import heartbeat

#: The variables a spare learns only when it is handed its rank (they change per attempt).
PER_ATTEMPT = (
    ENV_COORDINATOR_ADDRESS,
    ENV_RESTART_COUNT,
    heartbeat.ENV_AFTER_HANG,
    heartbeat.ENV_FILE,
    heartbeat.ENV_PERIOD,
)
#: What a spare imports while it waits: what a distrain program imports first, and the
#: slowest part of a cold start (jax's backends and jax.distributed are left to the worker).
PRELOAD = (
    "jax",
    "jax.numpy",
    "flax",
    "optax",
    "orbax.checkpoint",
    "grain",
    "distrain",
    "distrain.cli",
    "distrain._src.train.run",
)
_PYTHON = re.compile(r"python(\d+(\.\d+)?)?")


def _this_python(path: str) -> bool:
    """Whether ``path`` is a Python of the launcher's environment (its ``bin/``): the
    interpreter a spare runs in. Links are not resolved: a venv's python links to a base
    interpreter that lacks the venv's packages."""
    found = shutil.which(path)
    if found is None or not sys.executable:
        return False
    here = os.path.dirname(os.path.abspath(sys.executable))
    return os.path.dirname(os.path.abspath(found)) == here and bool(
        _PYTHON.fullmatch(os.path.basename(found))
    )


def spare_form(command: list[str]) -> str | None:
    """How a spare runs ``command`` (``"script"``, ``"module"``, ``"code"``), or None when
    it cannot: not this environment's Python, or an interpreter option (``-u``, ``-X``...).

    Example:
      >>> spare_form([sys.executable, "-m", "pkg.train", "--steps", "5"])
      'module'
    """
    if not command:
        return None
    if _this_python(command[0]):
        rest = command[1:]
        if len(rest) >= 2 and rest[0] in ("-m", "-c"):
            return "module" if rest[0] == "-m" else "code"
        if rest and not rest[0].startswith("-"):
            return "script"
        return None
    found = shutil.which(command[0])
    try:  # a console script (`distrain`): a Python file whose #! names this Python
        with open(found or "", "rb") as f:
            first = f.readline(512)
    except OSError:
        return None
    if first.startswith(b"#!"):
        interpreter = first[2:].strip().decode(errors="replace")
        if " " not in interpreter and _this_python(interpreter):
            return "script"
    return None


def _argv(command: list[str], form: str) -> list[str]:
    """What the spare runs: the script and its arguments, the module and its, the code."""
    if form == "script":
        program = shutil.which(command[0]) or command[0]
        return [command[1], *command[2:]] if _this_python(program) else [program, *command[1:]]
    return command[2:]


@dataclasses.dataclass
class Spare:
    """A waiting spare: its process, the environment it started with, and the pipe on
    which it says it finished importing (``ready``)."""

    proc: subprocess.Popen
    env: dict[str, str]
    ready_fd: int
    started: float
    ready: float | None = None  # seconds its imports took, once it said so

    def poll_ready(self) -> bool:
        """Whether it has finished importing (reads its pipe without blocking)."""
        if self.ready is None and self.ready_fd >= 0:
            try:
                said = os.read(self.ready_fd, 1)
            except BlockingIOError:
                return False
            self.close_fd()
            if said:  # b"": it died before it was ready
                self.ready = time.monotonic() - self.started
        return self.ready is not None

    def close_fd(self) -> None:
        if self.ready_fd >= 0:
            os.close(self.ready_fd)
            self.ready_fd = -1


class Pool:
    """One warm spare per rank of a job (see the module's docstring).

    Args:
      command: the workers' command line.
      form: :func:`spare_form` of it (not None).
      nproc: the number of ranks.
      env_for: rank -> its worker's environment (the per-attempt variables are dropped).
      log: writes one launcher line.
      preload: the modules a spare imports while it waits.
    """

    def __init__(
        self,
        command: list[str],
        form: str,
        nproc: int,
        *,
        env_for: Callable[[int], dict[str, str]],
        log: Callable[[str], None],
        preload: tuple[str, ...] = PRELOAD,
    ) -> None:
        self.argv = _argv(command, form)
        self.form = form
        self.nproc = nproc
        self.env_for = env_for
        self.log = log
        self.preload = preload
        self.spares: dict[int, Spare] = {}

    @staticmethod
    def _base(env: dict[str, str]) -> dict[str, str]:
        return {k: v for k, v in env.items() if k not in PER_ATTEMPT}

    def fill(self) -> None:
        """Replaces spares that died while waiting, starts the missing ones, and says which
        finished importing."""
        for i, spare in list(self.spares.items()):
            if spare.proc.poll() is not None:
                del self.spares[i]
                spare.close_fd()
                died = status_text(spare.proc.returncode)
                self.log(
                    f"the warm spare for process {i} (pid {spare.proc.pid}) {died} while "
                    "waiting; starting another"
                )
        ready = []
        for i, spare in self.spares.items():
            if spare.ready is None and spare.poll_ready():
                ready.append(f"pid {spare.proc.pid} for process {i} ({spare.ready:.1f} s)")
        if ready:
            self.log(f"warm spares ready: {', '.join(ready)}")
        started = []
        for i in range(self.nproc):
            if i not in self.spares:
                self.spares[i] = self._start(self._base(self.env_for(i)))
                started.append(f"pid {self.spares[i].proc.pid} for process {i}")
        if started:
            self.log(f"warm spares started: {', '.join(started)}")

    def _start(self, env: dict[str, str]) -> Spare:
        read, write = os.pipe()
        os.set_blocking(read, False)
        try:
            proc = subprocess.Popen(
                [sys.executable, spare_main.__file__, f"--ready-fd={write}", *self.preload],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                pass_fds=(write,),
                start_new_session=True,  # its own process group, as a cold worker's
            )
        except BaseException:
            os.close(read)
            raise
        finally:
            os.close(write)
        return Spare(proc, env, read, time.monotonic())

    def take(self, index: int, env: dict[str, str]) -> subprocess.Popen | None:
        """Hands rank ``index`` (its worker's environment ``env``) to its spare; returns the
        spare, now the worker, or None (start it cold: the line says why)."""
        spare = self.spares.pop(index, None)
        if spare is None:
            return None
        proc = spare.proc
        spare.close_fd()
        if proc.poll() is not None:
            self.log(
                f"the warm spare for process {index} (pid {proc.pid}) "
                f"{status_text(proc.returncode)} while waiting; starting process {index} cold"
            )
            return None
        base = self._base(env)
        names = base.keys() | spare.env.keys()
        differ = sorted(k for k in names if base.get(k) != spare.env.get(k))
        if differ:
            kill_all([proc])
            self.log(
                f"process {index} starts cold: its environment differs from its warm spare's in "
                f"{', '.join(differ)} (expected only {', '.join(PER_ATTEMPT)} to change)"
            )
            return None
        order = {"env": env, "argv": self.argv, "form": self.form, "t": time.time()}
        try:
            stdin = cast(IO[bytes], proc.stdin)  # a pipe: started with stdin=PIPE
            stdin.write(json.dumps(order).encode() + b"\n")
            stdin.close()
            proc.stdin = None  # as a cold worker's (stdin=DEVNULL): communicate() etc. work
        except OSError:  # it died between the poll and the write
            kill_all([proc])
            self.log(f"the warm spare for process {index} (pid {proc.pid}) died; starting cold")
            return None
        return proc

    def close(self) -> None:
        """Ends every waiting spare (the launcher is done)."""
        spares = list(self.spares.values())
        self.spares.clear()
        kill_all([spare.proc for spare in spares])
        for spare in spares:
            spare.close_fd()
            for stream in (spare.proc.stdin, spare.proc.stdout):
                if stream is not None:
                    stream.close()
