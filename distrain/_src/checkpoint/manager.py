"""``CheckpointManager``: atomic, asynchronous, verified checkpoints on orbax.

One checkpoint step holds everything a run needs to continue exactly: the train
state (any pytree of arrays, PRNG keys included), the input pipeline position and
the trainer's progress. Orbax writes each step into a temporary directory and
renames it when complete, so a step directory either holds a whole checkpoint or
does not exist; a process killed mid-save leaves only a temporary directory, which
the next ``CheckpointManager`` on that directory removes.

Older steps are deleted (orbax ``LatestN`` preservation policy) only by the save
that supersedes them, after that save has been committed: at every moment at
least one complete checkpoint exists. Restore verifies the arrays it reads
against fingerprints taken at save time and falls back to the previous step,
with a warning, when the newest one is damaged.

This module owns the save and restore flow. The rest of the package: ``_layout``
(what a step holds and its manifest), ``_fingerprint`` (content checks),
``_persistent_restore`` (a step read back, or the newest intact one), ``_restore``
(reading a state back into a target), ``_errors`` (damage or not, and the messages),
``_directory`` (the directory argument and what it must hold), ``_orbax_manager`` (the
orbax manager underneath: its items and options), ``_orbax_internals`` (the one place
that relies on what orbax does not offer publicly) and ``local`` (the local tier).

Example:
  >>> with dt.checkpoint.CheckpointManager("/tmp/run1", save_interval_steps=100) as mgr:
  ...     restored = mgr.restore(target=state)       # None on a fresh directory
  ...     if restored is not None:
  ...         state, step = restored.state, restored.step
  ...     for step in range(step + 1, num_steps + 1):
  ...         state = train_step(state, next(batches))
  ...         mgr.save(step, state, data_state={"position": step})
"""

from __future__ import annotations

import itertools
import os
import warnings
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from distrain._src import verbosity
from distrain._src.checkpoint import _directory, _errors, _fingerprint, _layout, _quiet
from distrain._src.checkpoint import _orbax_internals as _internals
from distrain._src.checkpoint import local as local_tier
from distrain._src.checkpoint._layout import LeafInfo
from distrain._src.checkpoint._orbax_manager import orbax_manager
from distrain._src.checkpoint._persistent_restore import Restored, StepReader
from distrain._src.pytree import PyTree
from distrain._src.validate import optional_positive_int, positive_int

# Managers built so far in this process: all processes build them in the same order,
# so the count names the same manager everywhere (see `_barrier_prefix`).
_instances = itertools.count()


class CheckpointManager:
    """Saves and restores training checkpoints in one directory.

    Args:
      directory: where step directories ``<dir>/<step>/`` are written. Created if
        missing; it must be writable (checked here, not at the first save).
      max_to_keep: how many of the newest checkpoints to keep (None: all). Keep at
        least 2 so that a damaged newest checkpoint has a predecessor to fall back to.
      save_interval_steps: ``save`` writes when ``step % save_interval_steps == 0``
        (or when ``force=True``).
      async_save: write in a background thread; ``save`` returns once the arrays
        are copied off the devices. Call :meth:`wait_until_finished` (or
        :meth:`close`, or leave the ``with`` block) before the process exits.
      local_directory: a fast local tier (e.g. ``/dev/shm/run1`` or a node-local
        disk, apart from ``directory``): ``save`` writes there every
        ``local_save_interval_steps`` steps when no persistent save is due, each
        process its own shards, copied to a peer process (on another host when there
        is one). ``restore`` takes the newest step that verifies among the local
        copies, the peers' copies and the persistent checkpoints, data position and
        metadata included. See ``docs/fault_tolerance.md`` ("The local tier").
      local_save_interval_steps: steps between local saves (required with
        ``local_directory``).
      local_max_to_keep: local steps kept per process (and per peer copy).
      read_only: follow a directory another job writes (``dt.SidecarEvaluator``): nothing
        is created, written, cleaned up or set aside; ``save`` raises, ``all_steps`` and
        ``latest_step`` list the directory afresh, and ``restore(step=N)`` of a damaged
        step raises ``CheckpointCorruptionError``, leaving it in place.

    Raises:
      ValueError: if a directory cannot be created or written, for invalid
        ``max_to_keep`` / ``save_interval_steps`` / local tier arguments, or a
        ``local_directory`` inside (or around) ``directory``.

    All processes of a multi-process job must make the same calls in the same order.

    Example:
      >>> mgr = dt.checkpoint.CheckpointManager("/tmp/ckpt", max_to_keep=3, save_interval_steps=10)
      >>> mgr.save(10, state, data_state={"epoch": 0, "batch": 10}, metadata={"epoch": 0})
      True
      >>> mgr.restore(target=state).step
      10
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_to_keep: int | None = 3,
        save_interval_steps: int = 1,
        async_save: bool = True,
        local_directory: str | os.PathLike[str] | None = None,
        local_save_interval_steps: int | None = None,
        local_max_to_keep: int = 2,
        read_only: bool = False,
    ) -> None:
        self._read_only = bool(read_only)
        self._max_to_keep = optional_positive_int("max_to_keep", max_to_keep)
        self._interval = positive_int("save_interval_steps", save_interval_steps)
        verbosity.quiet_orbax()  # orbax's INFO log of every save: only with DISTRAIN_VERBOSE
        _quiet.install()  # Ctrl-C while orbax waits for a save: the caller's line, no traceback
        checked = _directory.check_directory_arg(directory, "CheckpointManager")
        self._directory = epath.Path(checked).absolute()
        self._local = _local_tier(
            self._directory, local_directory, local_save_interval_steps, local_max_to_keep
        )
        if not self._read_only:
            _directory.check_writable(self._directory)
        self.restored_from: str | None = None
        self._barrier_prefix = f"distrain_ckpt{next(_instances)}"
        self._pending: tuple[int | None, str | None] = (None, None)  # save in flight
        self._mgr = orbax_manager(
            self._directory,
            interval=self._interval,
            max_to_keep=self._max_to_keep,
            async_save=bool(async_save),
            read_only=self._read_only,
            barrier_prefix=self._barrier_prefix,
        )
        self._reader = StepReader(self._mgr, self._directory, self._read_only, self._barrier_prefix)
        self._closed = False

    # ------------------------------------------------------------------ queries
    @property
    def directory(self) -> epath.Path:
        """The checkpoint directory (absolute)."""
        return self._directory

    def latest_step(self) -> int | None:
        """The newest committed step, or None if there is none."""
        if self._read_only:
            self._mgr.reload()  # another job writes the directory
        return self._mgr.latest_step()

    def all_steps(self) -> list[int]:
        """All committed steps, oldest first (orbax lists a step once it is renamed into
        place, or has its commit file on object stores: never a save in progress)."""
        if self._read_only:
            self._mgr.reload()
        return sorted(self._mgr.all_steps())

    # --------------------------------------------------------------------- save
    def save(
        self,
        step: int,
        state: PyTree,
        *,
        data_state: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
        force: bool = False,
    ) -> bool:
        """Saves ``state`` (and the data position and metadata) as step ``step``.

        Writes when ``step`` is a multiple of ``save_interval_steps`` or ``force`` is
        true, and only if ``step`` is newer than the latest checkpoint; otherwise, with
        a local tier, writes there when ``step`` is a multiple of
        ``local_save_interval_steps`` (see :meth:`save_local`). With
        ``async_save`` the write continues in the background; the arrays are copied
        to host memory before this returns, so the caller may update ``state``.

        Args:
          step: the training step the state corresponds to (e.g. steps completed).
          state: any pytree of jax/NumPy arrays, typed PRNG keys and Python numbers.
          data_state: the input pipeline position (JSON-compatible dict).
          metadata: trainer progress such as epoch and history (JSON-compatible).
          force: save even if ``step`` is not a multiple of the interval.

        Returns:
          Whether a checkpoint was written (started, when asynchronous).

        Raises:
          TypeError: if ``state`` holds unsupported leaves or ``data_state`` /
            ``metadata`` are not JSON-compatible.
          ValueError: if ``step`` is not a non-negative int.
        """
        self._check_open("save")
        self._check_writer("save")
        _check_step(step)
        step = int(step)
        latest = self._mgr.latest_step()
        if latest is not None and step <= latest:
            if step < latest:
                warnings.warn(
                    f"Not saving step {step}: the checkpoint directory {self._directory} "
                    f"already holds the newer step {latest}. Resume from the latest step, or "
                    "use a new directory to branch off an older one.",
                    stacklevel=2,
                )
            return False
        if not force and step % self._interval:
            if self._local is not None and step % self._local.interval == 0:
                return self.save_local(step, state, data_state=data_state, metadata=metadata)
            return False
        data_json = _layout.to_json(data_state, "`data_state`")
        meta_json = _layout.to_json(metadata, "`metadata`")
        stored, leaves = _layout.to_storable(state)
        if not leaves:
            raise ValueError(
                "Expected a state with at least one array leaf to checkpoint; received "
                f"{type(state).__name__} {state!r:.100}. Pass the train state."
            )
        fingerprints = _fingerprint.fingerprint_any([v for _, v, _ in leaves])
        manifest = {
            "format": _layout.FORMAT,
            "process_count": jax.process_count(),
            "leaves": [
                LeafInfo(
                    path=path,
                    shape=_layout.leaf_shape_dtype(value)[0],
                    dtype=_layout.leaf_shape_dtype(value)[1].name,
                    key_impl=impl,
                    fingerprint=fp,
                ).to_json()
                for (path, value, impl), fp in zip(leaves, fingerprints, strict=True)
            ],
        }
        try:
            saved = self._orbax_save(step, stored, data_json, meta_json, manifest)
        except BaseException as e:
            # The error may be this save's or the previous one's (orbax waits for it).
            previous = self._pending[0]
            _internals.release_waiting_save_threads(self._pending[1])
            _internals.release_waiting_save_threads(_internals.current_operation())
            self._pending = (None, None)
            label = (
                step if previous is None else f"{step}, or the save of step {previous} before it,"
            )
            raise _errors.write_error(e, label, self._directory) from e
        self._pending = (step, _internals.current_operation())
        return saved

    def save_local(
        self,
        step: int,
        state: PyTree,
        *,
        data_state: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> bool:
        """Saves ``state`` as step ``step`` in the local tier only (whatever the intervals).

        This process's shards are copied to the host and sent to its peer before this
        returns; both copies are written in the background. All processes call it
        together. Skipped (False) when ``step`` is not newer than the newest persistent
        checkpoint; local steps at or after ``step`` are replaced (they are of a
        timeline this one abandoned). Whether to save is decided from what every
        process sees alike, never from its own local directory, which may have been
        lost: a process that skipped while its peers saved would leave them waiting.

        Raises:
          ValueError: without a ``local_directory``, or for a bad ``step``.
          TypeError: as :meth:`save`.
          OSError: if the previous local write failed.
        """
        self._check_open("save_local")
        self._check_writer("save_local")
        if self._local is None:
            raise ValueError(
                "CheckpointManager.save_local() needs a local tier: pass local_directory= "
                "and local_save_interval_steps= when creating the manager."
            )
        _check_step(step)
        latest = self._mgr.latest_step()
        if latest is not None and step <= latest:
            return False
        self._local.drop_newer_than(int(step) - 1)
        data_json = _layout.to_json(data_state, "`data_state`")
        meta_json = _layout.to_json(metadata, "`metadata`")
        self._local.save(int(step), state, data_json, meta_json)
        return True

    def delete_local(self) -> None:
        """Deletes this process's local tier (its own and its peer's copies), if any."""
        if self._local is not None:
            self._local.delete()

    def _orbax_save(
        self, step: int, stored: PyTree, data_json: Any, meta_json: Any, manifest: dict
    ) -> bool:
        return bool(
            self._mgr.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.PyTreeSave(stored),
                    data=ocp.args.JsonSave(_layout.seal({"data_state": data_json})),
                    # The manifest shares the meta item: each orbax item costs a
                    # directory and several small files (about 5 ms of CPU per save).
                    meta=ocp.args.JsonSave(
                        _layout.seal({"metadata": meta_json, "manifest": manifest})
                    ),
                ),
                force=True,  # the decision was made above
            )
        )

    # ------------------------------------------------------------------ restore
    def restore(self, step: int | None = None, *, target: PyTree | None = None) -> Restored | None:
        """Restores a checkpoint: the newest intact one, or ``step``.

        Args:
          step: the step to restore; None for the newest. When the newest is damaged
            (truncated, garbled or missing files, an empty step directory), a warning
            names its directory, the damaged step is renamed to
            ``<step>.corrupt-<time>-<id>`` (set aside for inspection, ignored from then
            on) and the previous step is tried.
          target: a pytree like the saved state giving structure, shapes, dtypes and
            placement: arrays (their sharding is used) or ``jax.ShapeDtypeStruct``s
            with shardings. The checkpoint can be restored onto a different number
            of devices or processes than it was written from. NumPy leaves restore
            as NumPy. Without a target, arrays come back as NumPy (PRNG keys as keys)
            in nested dicts and lists.

          With a local tier, ``restore(target=...)`` first looks for a newer step there
          (see the class doc); ``restored_from`` then says where the state came from:
          ``"local"``, ``"peer"`` (some process's copy came from its peer) or
          ``"persistent"``. ``step=`` and restores without a target read the
          persistent checkpoints only.

        Returns:
          A :class:`Restored`, or None if the directory holds no checkpoint (with a
          warning if it holds other files: a wrong directory is not a fresh start).

        Raises:
          ValueError: if ``target`` does not match the checkpoint (names the first
            mismatching leaf and both shapes, or a dtype the saved values cannot be
            cast to without loss), if ``step`` does not exist, if the step is not a
            distrain checkpoint, or if the processes of a multi-process job see
            different checkpoints (the directory must be shared by all of them).
          CheckpointCorruptionError: if ``step`` was given and is damaged (the message
            names the step and its directory), or no checkpoint in the directory could
            be read back intact.
          Other errors (e.g. ``PermissionError``) propagate with the step's path in the
            message; they leave the checkpoint in place.
        """
        self._check_open("restore")
        self.wait_until_finished()
        # Each process lists the directory itself: they must agree on what it holds.
        self._mgr.reload()
        steps = self.all_steps()
        if not (self._read_only and step is not None):
            # A follower's processes agree on `step` before they call this; the
            # directory may grow between their listings.
            _directory.check_shared(self._directory, steps)
        self.restored_from = None
        restored: Restored | None = None
        if step is None and target is not None and self._local is not None:
            local = self._local.restore(target, newer_than=steps[-1] if steps else None)
            if local is not None:
                self.restored_from = "peer" if local.from_peer else "local"
                restored = Restored(local.step, local.state, local.data_state, local.metadata)
        if restored is None:
            restored = self._reader.restore(step, steps, target)
            self.restored_from = None if restored is None else "persistent"
        if self._local is not None and target is not None:
            # The run goes on from here: local steps past it are of an abandoned timeline.
            self._local.drop_newer_than(-1 if restored is None else restored.step)
        return restored

    # ---------------------------------------------------------------- lifecycle
    def wait_until_finished(self) -> None:
        """Blocks until the pending asynchronous save (if any) is committed.

        Raises:
          OSError: if the background write failed (e.g. the directory became
            unwritable); the committed checkpoints are intact.
        """
        if self._local is not None:
            self._local.wait_until_finished()
        try:
            self._mgr.wait_until_finished()
        except BaseException as e:
            step, op = self._pending
            self._pending = (None, None)
            _internals.release_waiting_save_threads(op)
            raise _errors.write_error(e, step, self._directory) from e
        self._pending = (None, None)

    def close(self) -> None:
        """Waits for pending saves and releases resources. Idempotent."""
        if not self._closed:
            self._closed = True
            try:
                self.wait_until_finished()
            finally:
                self._mgr.close()

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(
                f"CheckpointManager.{what}() called after close(). Create a new "
                "CheckpointManager for the directory."
            )

    def _check_writer(self, what: str) -> None:
        if self._read_only:
            raise ValueError(
                f"CheckpointManager.{what}() writes, but this manager of {self._directory} "
                "was created with read_only=True. Create one without read_only to save."
            )

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        local = ""
        if self._local is not None:
            local = (
                f", local_directory={str(self._local.root)!r}, "
                f"local_save_interval_steps={self._local.interval}"
            )
        return (
            f"CheckpointManager({str(self._directory)!r}, max_to_keep={self._max_to_keep}, "
            f"save_interval_steps={self._interval}{local})"
        )


def _check_step(step: Any) -> None:
    if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
        raise ValueError(f"Expected `step` to be a non-negative int; received {step!r}.")


def _local_tier(
    directory: epath.Path,
    local_directory: str | os.PathLike[str] | None,
    interval: int | None,
    keep: int,
) -> local_tier.LocalTier | None:
    """The local tier the arguments ask for (None: none), its directory checked."""
    checked = local_tier.check_arguments(directory, local_directory, interval)
    if checked is None:
        return None
    tier = local_tier.LocalTier(*checked, positive_int("local_max_to_keep", keep))
    _directory.check_writable(tier.own)
    return tier
