"""The islands' coordinator on disk: one checkpoint per applied round, and its rows.

``DIR/checkpoints/round-R/`` holds the state a round ``R`` starts from (``state.npz``:
the global parameters ``p0, p1, ...`` and the outer optimizer state ``o0, o1, ...``;
``meta.json``: the round, the model's structure, the configuration, the row ledger and
the inner steps each island had applied), written in a temporary directory and renamed
into place; the last ``CHECKPOINTS_KEPT`` are kept. ``DIR/rows/round-R.npy`` holds the
positions round ``R`` committed, written before the checkpoint that follows it.

Every file and every rename is fsynced, so an applied round survives a power loss. A
checkpoint that cannot be read anyway (torn by a crash of the disk or the machine) is
skipped by :func:`load_newest`, which falls back to the one before.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import zipfile
from collections.abc import Callable
from typing import IO, Any, NamedTuple

import numpy as np

CHECKPOINTS_KEPT = 2


class Checkpoint(NamedTuple):
    """A checkpoint read back whole."""

    path: str
    meta: dict[str, Any]
    params: list[np.ndarray]
    opt_leaves: list[np.ndarray]


def checkpoint_dir(directory: str, round_: int) -> str:
    return os.path.join(directory, "checkpoints", f"round-{round_:07d}")


def save(
    directory: str,
    r: int,
    positions: np.ndarray,
    params: list[np.ndarray],
    opt_leaves: list[np.ndarray],
    meta: dict[str, Any],
) -> None:
    """Round ``r`` was applied: its committed ``positions``, then the state after it
    (the checkpoint round ``r + 1`` starts from). A failure before the checkpoint is
    renamed into place removes the rows file: nothing was committed. After the rename
    the round is committed on disk, rows and state together."""
    rows_path = os.path.join(directory, "rows", f"round-{r:07d}.npy")
    _write_durably(rows_path + ".tmp.npy", lambda f: np.save(f, positions))
    os.replace(rows_path + ".tmp.npy", rows_path)
    _fsync_directory(os.path.dirname(rows_path))
    try:
        final = checkpoint_dir(directory, r + 1)
        tmp = final + f".tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        arrays = {f"p{k}": p for k, p in enumerate(params)}
        arrays.update({f"o{k}": x for k, x in enumerate(opt_leaves)})
        _write_durably(os.path.join(tmp, "state.npz"), lambda f: np.savez(f, **arrays))  # type: ignore[arg-type]  # numpy's stub
        _write_durably(os.path.join(tmp, "meta.json"), lambda f: f.write(json.dumps(meta).encode()))
        _fsync_directory(tmp)
        shutil.rmtree(final, ignore_errors=True)  # a torn one that a restore skipped
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(rows_path)
        raise
    _fsync_directory(os.path.dirname(final))
    for old in _rounds(directory)[:-CHECKPOINTS_KEPT]:
        shutil.rmtree(checkpoint_dir(directory, old), ignore_errors=True)


def load_newest(
    directory: str, num_params: int, num_opt_leaves: int
) -> tuple[Checkpoint | None, list[str]]:
    """The newest checkpoint that reads whole, or None; and one line for each newer one
    that did not (the path, why, and what is used instead)."""
    rounds, skipped = _rounds(directory), []
    for k in range(len(rounds) - 1, -1, -1):
        path = checkpoint_dir(directory, rounds[k])
        try:
            with open(os.path.join(path, "meta.json")) as f:
                meta = json.load(f)
            with np.load(os.path.join(path, "state.npz")) as z:
                params = [z[f"p{i}"] for i in range(num_params)]
                opt_leaves = [z[f"o{i}"] for i in range(num_opt_leaves)]
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
            instead = f"round {rounds[k - 1]}" if k else "the initial state (no other)"
            reason = f"{type(e).__name__}: {e}".replace("\n", " ")
            skipped.append(f"{path} is unreadable ({reason}); resuming from {instead}")
            continue
        return Checkpoint(path, meta, params, opt_leaves), skipped
    return None, skipped


def drop_rows_from(directory: str, round_: int) -> None:
    """Deletes the rows of rounds ``round_`` and later (an abandoned timeline: the
    state restored is the one round ``round_`` starts from)."""
    root = os.path.join(directory, "rows")
    for name in os.listdir(root):
        if name.startswith("round-") and int(name[6:13]) >= round_:
            os.remove(os.path.join(root, name))


def committed_rows(directory: str) -> np.ndarray:
    """Every position committed by the applied rounds kept in ``directory/rows``."""
    root = os.path.join(directory, "rows")
    names = sorted(n for n in os.listdir(root) if n.startswith("round-") and "tmp" not in n)
    parts = [np.load(os.path.join(root, n)) for n in names]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def check_matches(path: str, meta: dict[str, Any], structure: str, rows: dict[str, Any]) -> None:
    """Refuses to resume from the checkpoint at ``path`` unless it holds this run's model
    (``structure``) and rows (``rows``: its ``num_rows``, ``epochs`` and ``seed``).

    Raises:
      ValueError: another model, or other rows (the row ledger would not match).
    """
    if meta["structure"] != structure:
        raise ValueError(
            f"{path} holds a checkpoint of another model; nothing was restored.\n"
            f"  checkpoint: {meta['structure']}\n  this run:   {structure}\n"
            "Use another directory for another model."
        )
    saved = {k: v for k, v in meta["config"].items() if k in rows}
    mine = {k: rows[k] for k in saved}
    if saved != mine:
        raise ValueError(
            f"{path} was written for the rows {saved}; this run has {mine}. The row ledger "
            "would not match: use another directory."
        )


def _rounds(directory: str) -> list[int]:
    root = os.path.join(directory, "checkpoints")
    if not os.path.isdir(root):
        return []
    return sorted(
        int(n.split("-")[1]) for n in os.listdir(root) if n.startswith("round-") and "." not in n
    )


def _write_durably(path: str, write: Callable[[IO[bytes]], Any]) -> None:
    """Writes ``path`` with ``write`` and fsyncs it (it must survive a power loss)."""
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_directory(path: str) -> None:
    """Makes the entries of ``path`` (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
