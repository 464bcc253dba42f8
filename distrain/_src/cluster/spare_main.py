"""The entry point of a warm spare: a process `distrain launch` keeps beside a worker, that
has already imported the heavy libraries and waits on its standard input for a rank.

Started as ``python .../spare_main.py [--ready-fd=N] MODULE ...`` (by path: ``-m`` would import
``distrain`` and so jax even for ``MODULE``-less spares) with the worker's
environment less the per-attempt variables (``spares.PER_ATTEMPT``), it imports each
``MODULE`` (jax, flax, optax, orbax, grain, distrain: nothing that initialises jax's
backends or ``jax.distributed``), writes one byte to file descriptor ``N`` (the launcher
learns it is ready), then blocks reading one JSON line from standard input:

    {"env": {...}, "argv": [...], "form": "script" | "module" | "code", "t": 1.7e9}

It then becomes the worker: its environment becomes ``env`` exactly, standard input
becomes ``/dev/null`` (as a cold worker's), the goodput ledger's clock restarts at ``t``
(the time the launcher handed the rank over: this attempt's start, as a new process's
start would be), and it runs ``argv`` as ``python`` would (``form``): a script or console
script by path, ``-m module``, or ``-c code``, in a fresh ``__main__``. Exit status,
signals and output are the program's own. An end of input before a line (the launcher
closed the pipe or died) ends the spare quietly with status 0.

Example (what the launcher does)::

    spare = subprocess.Popen([python, spare_main.__file__, "jax"],
                             stdin=subprocess.PIPE, ...)
    spare.stdin.write(json.dumps({"env": env, "argv": ["train.py"], "form": "script",
                                  "t": time.time()}).encode() + b"\\n")
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys
import types
from typing import Any


def _preload(modules: list[str]) -> None:
    """Imports what the program would import anyway; one that is missing or fails to
    import is left for the program (which then fails as it would have cold)."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the program's own import will report it
            pass


def _become(order: dict[str, Any]) -> None:
    """Takes the worker's environment, standard input and clock."""
    os.environ.clear()
    os.environ.update(order["env"])
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # a cold worker's stdin is /dev/null; this closes the pipe too
    os.close(devnull)
    if "distrain._src.goodput.ledger" in sys.modules:
        from distrain._src.goodput import ledger

        ledger.restart_clock(float(order["t"]))


def _run(form: str, argv: list[str]) -> None:
    """Runs ``argv`` as ``python ARGV`` would (``form`` says which of python's forms)."""
    safe_path = bool(os.environ.get("PYTHONSAFEPATH"))
    if form == "module":  # python -m MODULE ARGS: sys.path starts with the working dir
        if not safe_path:
            sys.path.insert(0, os.getcwd())
        sys.argv = list(argv)
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    elif form == "code":  # python -c CODE ARGS
        if not safe_path:
            sys.path.insert(0, "")
        sys.argv = ["-c", *argv[1:]]
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(argv[0], "<string>", "exec"), main.__dict__)  # noqa: S102 - python -c
    else:  # a script or a console script: sys.path starts with its (resolved) directory
        if not safe_path:
            sys.path.insert(0, os.path.dirname(os.path.realpath(argv[0])))
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")


def _own_frame(tb: types.TracebackType) -> bool:
    name = tb.tb_frame.f_code.co_filename
    return name in (__file__, runpy.__file__, "<frozen runpy>")


def main() -> None:
    if not os.environ.get("PYTHONSAFEPATH"):
        # This file's directory, which python put first: it holds modules (``launch``,
        # ``kubernetes``...) that would shadow top-level ones. The program's comes back.
        sys.path.pop(0)
    args = sys.argv[1:]
    ready_fd = -1
    if args and args[0].startswith("--ready-fd="):
        ready_fd = int(args.pop(0).split("=", 1)[1])
    _preload(args)
    if ready_fd >= 0:  # tell the launcher the imports are done
        try:
            os.write(ready_fd, b"r")
        except BrokenPipeError:
            pass  # it already handed the rank over (and stopped listening): run it
        os.close(ready_fd)
    line = sys.stdin.buffer.readline()
    if not line.strip():
        raise SystemExit(0)  # the launcher closed the pipe: never handed a rank
    order = json.loads(line)
    _become(order)
    try:
        _run(order["form"], list(order["argv"]))
    except Exception as e:  # uncaught in the program: reported as python would, status 1
        tb = e.__traceback__
        while tb is not None and _own_frame(tb):  # the spare's and runpy's frames
            tb = tb.tb_next
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
