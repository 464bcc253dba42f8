"""The islands' coordinator on disk: one checkpoint per applied round, and its rows.

``DIR/checkpoints/round-R/meta.json`` holds the coordinator's state a round ``R``
starts from: the round, the model's structure, the configuration (the number of
parameter shards included), the row ledger and the inner steps each island had
applied; written in a temporary directory and renamed into place, it is the commit
point of round ``R - 1``. The parameters and the outer optimizer state are in the
shard holders' files, ``DIR/shards/round-R/shard-K-of-S.npz`` (``param_shards.py``),
written before it. The last ``CHECKPOINTS_KEPT`` are kept. ``DIR/rows/round-R.npy`` holds the
positions round ``R`` committed, written before the checkpoint that follows it.

Every file and every rename is fsynced, so an applied round survives a power loss. A
checkpoint that cannot be read anyway (torn by a crash of the disk or the machine) is
skipped by the coordinator's restore, which falls back to the one before.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable
from typing import IO, Any

import numpy as np

CHECKPOINTS_KEPT = 2


#: What the coordinator's checkpoints hold since the parameters moved to shard holders
#: (``param_shards.py``); checkpoints without it hold the parameters themselves.
FORMAT = 2


class OldFormat(ValueError):
    """A checkpoint written before the sharded exchange (the parameters inside it)."""


def checkpoint_dir(directory: str, round_: int) -> str:
    return os.path.join(directory, "checkpoints", f"round-{round_:07d}")


def save(directory: str, r: int, positions: np.ndarray, meta: dict[str, Any]) -> None:
    """Round ``r`` was applied: its committed ``positions``, then the coordinator's state
    after it (the checkpoint round ``r + 1`` starts from; the shard holders saved their
    shards of it before). A failure before the checkpoint is renamed into place removes
    the rows file: nothing was committed. After the rename the round is committed on
    disk, rows, state and (already there) the shards together."""
    rows_path = os.path.join(directory, "rows", f"round-{r:07d}.npy")
    write_durably(rows_path + ".tmp.npy", lambda f: np.save(f, positions))
    os.replace(rows_path + ".tmp.npy", rows_path)
    fsync_directory(os.path.dirname(rows_path))
    try:
        final = checkpoint_dir(directory, r + 1)
        tmp = final + f".tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        meta = {**meta, "format": FORMAT}
        write_durably(os.path.join(tmp, "meta.json"), lambda f: f.write(json.dumps(meta).encode()))
        fsync_directory(tmp)
        shutil.rmtree(final, ignore_errors=True)  # a torn one that a restore skipped
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(rows_path)
        raise
    fsync_directory(os.path.dirname(final))
    for old in rounds(directory)[:-CHECKPOINTS_KEPT]:
        shutil.rmtree(checkpoint_dir(directory, old), ignore_errors=True)


def read_meta(directory: str, round_: int) -> dict[str, Any]:
    """The coordinator's checkpoint of ``round_``.

    Raises:
      OSError, ValueError: it cannot be read (torn by a crash).
      OldFormat: it was written before the sharded exchange.
    """
    path = checkpoint_dir(directory, round_)
    with open(os.path.join(path, "meta.json")) as f:
        meta: dict[str, Any] = json.load(f)
    if meta.get("format") != FORMAT:
        raise OldFormat(
            f"{path} holds a checkpoint of the islands' star exchange (the parameters in "
            "the coordinator's state.npz), which this version cannot resume: it keeps them "
            "in shard holders. Expected a checkpoint of format 2. Finish that run with the "
            "distrain that wrote it, or start this one in another directory."
        )
    return meta


def newest_round(directory: str) -> int:
    """The newest round whose coordinator checkpoint reads (0 if none): the committed
    round a restarted shard holder serves."""
    for r in reversed(rounds(directory)):
        try:
            read_meta(directory, r)
        except (OSError, ValueError):
            continue
        return r
    return 0


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


def rounds(directory: str) -> list[int]:
    root = os.path.join(directory, "checkpoints")
    if not os.path.isdir(root):
        return []
    return sorted(
        int(n.split("-")[1]) for n in os.listdir(root) if n.startswith("round-") and "." not in n
    )


def write_durably(path: str, write: Callable[[IO[bytes]], Any]) -> None:
    """Writes ``path`` with ``write`` and fsyncs it (it must survive a power loss)."""
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def fsync_directory(path: str) -> None:
    """Makes the entries of ``path`` (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
