"""How a round of fault-isolated islands commits, and how a restarted coordinator
finds the round to resume: the protocol between the coordinator and its shard holders.

A round ``r`` commits in three steps (:func:`commit`):

1. every holder applies ``r`` to its shard and saves round ``r + 1`` durably, but still
   serves round ``r`` (``ShardHolder.apply``);
2. the coordinator saves its checkpoint of round ``r + 1`` (the ledger with the round's
   rows committed): the **commit point**;
3. every holder serves round ``r + 1`` (``ShardHolder.install``).

A failure in 1 or 2 discards the holders' round ``r + 1`` and applies nothing (when a
holder lost a pseudo-gradient, a restart, the coordinator trains the round again). A crash
between 1 and 2 leaves shards of a round never committed: the restarted coordinator
resumes from round ``r`` and the holders delete them (:func:`restore`); a crash between
2 and 3 resumes from round ``r + 1``, whose shards are on disk.

Example (what ``IslandCoordinator._apply`` does, unlocked)::

    failure = commit(exchange, lambda: store.save(directory, r, rows, meta), r,
                     [(island, token, r, weight), ...], directory)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from distrain._src.islands import store
from distrain._src.islands.param_shards import Exchange, HolderLost, PseudoGradientLost

#: The prefix of :func:`commit`'s failure when the round was committed but a holder
#: could not serve it.
INSTALLED = "installed: "
#: The prefix of :func:`commit`'s failure when nothing was applied because a holder lost
#: a pseudo-gradient of the round (it restarted): the round can be trained again.
LOST = "lost: "


def commit(
    exchange: Exchange,
    save: Callable[[], None],
    r: int,
    entries: list[tuple[int, str, int, float]],
    directory: str,
) -> str | None:
    """Commits round ``r`` (the three steps above); ``entries``: ``(island, token,
    round, weight)`` of each pseudo-gradient in the mean; ``save``: the coordinator's
    checkpoint. Returns None, or what failed in one line (prefixed with
    :data:`INSTALLED` when only step 3 did: the round is committed; with :data:`LOST`
    when step 1 failed for a holder's restart)."""
    try:
        exchange.map("apply", r, entries)
    except Exception as e:  # noqa: BLE001 - nothing was applied: say why, one line
        with contextlib.suppress(Exception):
            exchange.map("discard", r + 1)
        lost = isinstance(e, PseudoGradientLost | HolderLost)
        return (LOST if lost else "") + f"update in the parameter shards failed ({line(e)})"
    try:
        save()
    except Exception as e:  # noqa: BLE001
        with contextlib.suppress(Exception):
            exchange.map("discard", r + 1)
        return f"checkpoint could not be written to {directory} ({line(e)})"
    try:
        exchange.map("install", r + 1)
    except Exception as e:  # noqa: BLE001
        return INSTALLED + line(e)
    return None


def restore(
    directory: str,
    exchange: Exchange,
    structure: str,
    config: Any,
    skip: Callable[[str], None],
) -> dict[str, Any] | None:
    """The coordinator's checkpoint to resume from: the newest that reads whole, and of
    which every holder reads its shard (each newer one, torn by a crash, is reported to
    ``skip`` in one line); every holder then serves its round. None: the initial state.

    Raises:
      ValueError: a checkpoint of another model, rows or number of shards, or of the
        star exchange (``store.OldFormat``); holders that cannot serve the initial state.
    """
    rounds = store.rounds(directory)
    for k in range(len(rounds) - 1, -1, -1):
        path = store.checkpoint_dir(directory, rounds[k])
        instead = f"round {rounds[k - 1]}" if k else "the initial state (no other)"
        try:
            meta = store.read_meta(directory, rounds[k])
        except store.OldFormat:
            raise
        except (OSError, ValueError) as e:
            skip(f"{path} is unreadable ({line(e)}); resuming from {instead}")
            continue
        rows = {name: getattr(config, name) for name in ("num_rows", "epochs", "seed")}
        store.check_matches(path, meta, structure, rows)
        if meta["shards"] != config.shards:
            raise ValueError(
                f"{path} holds the parameters in {meta['shards']} shards; this run has "
                f"exchange_shards={config.exchange_shards} ({config.shards} shards). "
                f"Resume with exchange_shards={meta['shards']}."
            )
        problems = [p for p in exchange.map("restore", rounds[k]) if p]
        if problems:
            skip(f"{path} is unreadable ({problems[0]}); resuming from {instead}")
            continue
        return meta
    problems = [p for p in exchange.map("restore", 0) if p]
    if problems:
        raise ValueError(
            f"{directory} holds no checkpoint, but its shard holders served a later round "
            f"({problems[0]}). Expected the holders of a fresh run: end the run's actors "
            "(or use another directory), then start again."
        )
    return None


def line(e: BaseException) -> str:
    """``e`` in one line."""
    return f"{type(e).__name__}: {e}".replace("\n", " ")
