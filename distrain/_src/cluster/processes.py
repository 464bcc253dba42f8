"""The processes `distrain launch` starts: which program, their environment, their output
(each line prefixed with the process's index) and how they are signalled."""

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
from typing import IO

from distrain._src import compile_cache, verbosity
from distrain._src.cluster.base import (
    ENV_COORDINATOR_ADDRESS,
    ENV_LOCAL_DEVICES,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
)
from distrain._src.cluster.communication import ENV_TIMEOUT_SECONDS

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


def is_noise(line: bytes) -> bool:
    m = _GLOO_CONNECTED.fullmatch(line.strip())
    return m is not None and m[1] == m[2] and not verbosity.verbose()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def child_env(args: argparse.Namespace, index: int, port: int, attempt: int) -> dict[str, str]:
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
        gpus = visible_gpus(os.environ, args.nproc * args.gpus_per_proc)
        mine = gpus[index * args.gpus_per_proc : (index + 1) * args.gpus_per_proc]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(mine)
        env[ENV_LOCAL_DEVICES] = str(args.gpus_per_proc)
        # The process sees its GPUs as ordinals 0..G-1: an inherited list of device ids
        # (meant for the whole machine) would name GPUs it cannot see.
        for name in ("DISTRAIN_LOCAL_DEVICE_IDS", "JAX_LOCAL_DEVICE_IDS"):
            env.pop(name, None)
    if args.timeout is not None:
        env[ENV_TIMEOUT_SECONDS] = f"{args.timeout:g}"
    return compile_cache.child_env(env)  # a restarted process reads its programs back


def visible_gpus(environ: dict[str, str] | os._Environ, needed: int) -> list[str]:
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


def prefix_lines(stream: IO[bytes], prefix: bytes, out: IO[bytes], lock: threading.Lock) -> None:
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
                if not is_noise(segments[i])
            )
            with lock:
                out.write(text)
                out.flush()
    if pending:
        with lock:
            out.write(prefix + pending + b"\n")
            out.flush()
    stream.close()


def status_text(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def exit_code(code: int) -> int:
    return 128 - code if code < 0 else code


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_all(procs: list[subprocess.Popen]) -> None:
    """SIGKILLs every process group still running and reaps the processes."""
    for p in procs:
        if p.poll() is None:
            signal_group(p, signal.SIGKILL)
    for p in procs:
        p.wait()


def stop_all(procs: list[subprocess.Popen], grace: float) -> None:
    """SIGTERM every process group still running, SIGKILL what is left after `grace` s."""
    # Only groups whose leader is still running: a reaped leader's id may be reused.
    running = [p for p in procs if p.poll() is None]
    for p in running:
        signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in running:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in running:
        # The whole group: the process may have started children of its own.
        signal_group(p, signal.SIGKILL)
        p.wait()


class CannotStart(Exception):
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


def check_program(program: str) -> str:
    """The path to run for `program` (see `_resolve_program`).

    Raises:
        CannotStart: exit status 127 (not found) or 126 (not executable), as a shell.
    """
    found = _resolve_program(program)
    if found is not None:
        return found
    has_dir = os.sep in program or (os.altsep is not None and os.altsep in program)
    if has_dir and os.path.isfile(program):
        raise CannotStart(
            f"cannot start {program!r}: not executable. Expected an executable file; run it "
            f"through its interpreter (e.g. `-- python {program}`) or `chmod +x` it.",
            126,
        )
    if has_dir:
        raise CannotStart(
            f"cannot start {program!r}: no such file. Expected the program to run after "
            "'--', e.g. `distrain launch --nproc 2 -- python train.py`; check the path.",
            127,
        )
    bin_dir = _own_bin_dir() if sys.executable else None
    looked = f"on PATH or in {bin_dir} (next to this launcher's Python)" if bin_dir else "on PATH"
    raise CannotStart(
        f"cannot start {program!r}: not found {looked}. Expected the program to run after "
        "'--', e.g. `distrain launch --nproc 2 -- python train.py`; check its spelling, give "
        "its full path, or activate the environment that provides it (e.g. "
        "`source .venv/bin/activate`).",
        127,
    )
