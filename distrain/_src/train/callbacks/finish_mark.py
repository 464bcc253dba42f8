"""The mark training leaves in a checkpoint directory when it finished: its final checkpoint.

``ModelCheckpoint`` (and ``BackupAndRestore`` when it keeps the finished state) writes
``<directory>/training_finished.json`` when ``fit`` completes, after the last save is
committed, and removes it when a ``fit`` begins writing into the directory again. A
``dt.SidecarEvaluator`` following the directory stops once it has evaluated the step the
mark names: without the mark it could not tell a finished job from a slow one.

The file is written whole (a temporary file renamed into place) by the chief alone;
orbax ignores it when it lists steps (its name is not a step number).

Example:
  >>> write("/ckpt/run-42", 400)
  >>> read("/ckpt/run-42")
  (True, 400)
"""

from __future__ import annotations

import json
import os
import time

FILENAME = "training_finished.json"


def write(directory: str | os.PathLike[str], step: int | None) -> None:
    """Marks ``directory``'s training as finished, ``step`` being its final checkpoint
    (None: it wrote none)."""
    path = os.path.join(os.fspath(directory), FILENAME)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"final_step": step, "time": time.time()}, f)
    os.replace(tmp, path)


def clear(directory: str | os.PathLike[str]) -> None:
    """Removes the mark: a ``fit`` is writing into ``directory`` again."""
    try:
        os.remove(os.path.join(os.fspath(directory), FILENAME))
    except FileNotFoundError:
        pass


def read(directory: str | os.PathLike[str]) -> tuple[bool, int | None]:
    """``(finished, final step)``: whether the mark is there, and the step it names.

    Raises:
      ValueError: a mark that is not this module's JSON (named, with what it holds).
    """
    path = os.path.join(os.fspath(directory), FILENAME)
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return False, None
    try:
        step = json.loads(text)["final_step"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(
            f"Expected {path} to be the JSON mark of a finished training "
            f'({{"final_step": N, ...}}). Received: {text[:100]!r}. Remove the file, or point '
            "the evaluator at the checkpoint directory of a distrain run."
        ) from None
    return True, None if step is None else int(step)
