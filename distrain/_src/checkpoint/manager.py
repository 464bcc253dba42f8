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
``_restore`` (reading a state back into a target), ``_errors`` (damage or not, and
the messages), ``_directory`` (the directory argument and what it must hold) and
``_orbax_internals`` (the one place that relies on what orbax does not offer publicly).

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
import logging
import os
import time
import uuid
import warnings
from typing import Any, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import checkpoint_managers as ocp_policies

from distrain._src import verbosity
from distrain._src.checkpoint import _directory, _errors, _fingerprint, _layout, _restore
from distrain._src.checkpoint import _orbax_internals as _internals
from distrain._src.checkpoint import local as local_tier
from distrain._src.checkpoint._layout import CheckpointCorruptionError, LeafInfo
from distrain._src.pytree import PyTree
from distrain._src.validate import optional_positive_int, positive_int


class Restored(NamedTuple):
    """What :meth:`CheckpointManager.restore` returns.

    Attributes:
      step: the step the checkpoint was saved at.
      state: the restored state (the target's structure and placement if a target
        was given; otherwise nested dicts/lists of NumPy arrays).
      data_state: the ``data_state`` passed to ``save`` (None if none was).
      metadata: the ``metadata`` passed to ``save`` (None if none was).
    """

    step: int
    state: PyTree
    data_state: dict[str, Any] | None
    metadata: dict[str, Any] | None


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
        # Orbax says what read_only turns off (saving, creating, cleaning up) and that
        # the directory is read-only, as warnings: all of it was asked for.
        absl = logging.getLogger("absl")
        absl.addFilter(_not_a_read_only_notice)
        try:
            options = ocp.CheckpointManagerOptions(
                # Save exactly at multiples of the interval (orbax's default would also
                # save the first step it sees). `save` decides before calling orbax (cheaper
                # than orbax's should_save on every step); preemption saves use force=True.
                save_decision_policy=ocp_policies.FixedIntervalPolicy(self._interval),
                preservation_policy=ocp_policies.LatestN(n=self._max_to_keep),
                enable_async_checkpointing=bool(async_save),
                # Leftovers of a process killed mid-save; a follower must not touch the
                # writer's saves in progress.
                cleanup_tmp_directories=not self._read_only,
                create=not self._read_only,
                read_only=self._read_only,
                # Orbax names its cross-process barriers after the operation and step only:
                # two managers saving the same step at once (ModelCheckpoint and
                # BackupAndRestore) would wait at the same barrier and fail with "Barrier ...
                # is already ongoing". A prefix per manager keeps them apart.
                multiprocessing_options=ocp.options.MultiprocessingOptions(
                    barrier_sync_key_prefix=self._barrier_prefix
                ),
            )
            self._mgr = ocp.CheckpointManager(
                self._directory,
                item_handlers={
                    "state": _state_handler(),
                    "data": ocp.JsonCheckpointHandler(),
                    "meta": ocp.JsonCheckpointHandler(),
                },
                options=options,
            )
        finally:
            absl.removeFilter(_not_a_read_only_notice)
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
            restored = self._restore_persistent(step, steps, target)
            self.restored_from = None if restored is None else "persistent"
        if self._local is not None and target is not None:
            # The run goes on from here: local steps past it are of an abandoned timeline.
            self._local.drop_newer_than(-1 if restored is None else restored.step)
        return restored

    def _restore_persistent(
        self, step: int | None, steps: list[int], target: PyTree | None
    ) -> Restored | None:
        if step is not None:
            if step not in steps:
                raise ValueError(
                    f"Expected `step` to be one of the checkpoints in {self._directory}: "
                    f"{steps}; received {step!r}."
                )
            return self._restore_step(int(step), target)
        failures = []
        for s in sorted(steps, reverse=True):
            try:
                result = self._restore_step(s, target)
            except CheckpointCorruptionError as e:
                failures.append(f"step {s}: {e}")
                aside = "the damaged step is left in place (read_only)"
                if not self._read_only:
                    aside = (
                        f"the damaged step was renamed to {self._quarantine(s)!r} (set aside "
                        "for inspection)"
                    )
                warnings.warn(
                    f"{e}. Falling back to the previous checkpoint; {aside}.", stacklevel=2
                )
                continue
            return result
        if failures:
            raise CheckpointCorruptionError(
                f"No checkpoint in {self._directory} could be restored intact: "
                + "; ".join(failures)
                + ". Restore from a backup or start a new run in a new directory."
            )
        _directory.warn_if_not_a_checkpoint_directory(self._directory)
        return None

    def _read_side_items(self, step: int, where: str) -> tuple[list[LeafInfo], Any, Any]:
        """The manifest, data position and metadata of ``step`` (raises on damage)."""
        if not (self._directory / str(step) / "meta").exists():
            if _internals.is_foreign(self._directory / str(step)):
                raise _errors.Foreign(
                    f"Expected a checkpoint written by dt.checkpoint.CheckpointManager in {where}, "
                    "but it has no 'meta' item. Use orbax directly for other checkpoints."
                )
            raise CheckpointCorruptionError("its 'meta' item is missing")
        _internals.check_json_metadata(self._directory / str(step))
        side = self._mgr.restore(
            step,
            args=ocp.args.Composite(data=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore()),
        )
        meta = _layout.unseal(side["meta"], "meta")
        data = _layout.unseal(side["data"], "data")
        manifest = meta["manifest"]
        if manifest.get("format") != _layout.FORMAT:
            raise CheckpointCorruptionError(
                f"expected manifest format {_layout.FORMAT!r}, found {manifest.get('format')!r}"
            )
        leaves = [LeafInfo.from_json(d) for d in manifest["leaves"]]
        return leaves, _layout.from_json(data["data_state"]), _layout.from_json(meta["metadata"])

    def _restore_step(self, step: int, target: PyTree | None) -> Restored:
        where = f"{self._directory / str(step)}"
        # Every process reads, then all agree on the outcome before anyone goes on:
        # a step damaged for one process is damaged for all.
        code, error = _errors.OK, None
        try:
            leaves, data_state, metadata = self._read_side_items(step, where)
        except Exception as e:  # noqa: BLE001 - classified below, re-raised on every process
            code, error = _errors.outcome(e), e
        code = _errors.worst(code)
        if code == _errors.OK:
            if target is not None:
                _layout.check_compatible(leaves, target, where)
            try:
                state = self._restore_state(step, leaves, target)
            except Exception as e:  # noqa: BLE001 - classified, re-raised on every process
                code, error = _errors.outcome(e), e
            code = _errors.worst(code)
            if code == _errors.OK:
                return Restored(step, state, data_state, metadata)
        if isinstance(error, _errors.Foreign):
            raise ValueError(str(error)) from None
        if isinstance(error, _errors.TargetError):  # the target cannot hold it: the caller's error
            raise error.error
        if code == _errors.FAILED:
            if error is None or _errors.is_damage(error):
                raise RuntimeError(
                    f"Could not restore checkpoint {where}: it failed on another process "
                    "(see that process's error). The checkpoint was left in place."
                )
            raise _errors.restore_error(error, where) from error
        reason = _errors.describe(error) if error is not None else "damaged on another process"
        if isinstance(error, CheckpointCorruptionError):
            reason = str(error)
        raise CheckpointCorruptionError(
            f"Checkpoint {where} is damaged: step {step} could not be read back intact ({reason})"
        ) from error

    def _restore_state(self, step: int, leaves: list[LeafInfo], target: PyTree | None) -> PyTree:
        try:
            return _restore.restore_state(self._mgr, step, leaves, target)
        except CheckpointCorruptionError:
            raise
        except Exception as e:
            if target is None:
                if _errors.is_damage(e):
                    raise CheckpointCorruptionError(_errors.describe(e)) from e
                raise
            # Was it the files or the target (e.g. a sharding on missing devices)?
            # Reading the same step to host memory tells them apart.
            try:
                _restore.restore_state(self._mgr, step, leaves, None)
            except Exception as e2:
                if _errors.is_damage(e2):
                    raise CheckpointCorruptionError(_errors.describe(e2)) from e2
                raise
            raise _errors.TargetError(e) from e

    def _quarantine(self, step: int) -> str:
        """Renames a damaged step aside (process 0 does it); returns the new name."""
        stamp = time.strftime("%Y%m%dT%H%M%S")
        name = f"{step}.corrupt-{stamp}-{uuid.uuid4().hex[:6]}"
        if jax.process_index() == 0:
            (self._directory / str(step)).rename(self._directory / name)
        else:
            name = f"{step}.corrupt-<time>-<id>"  # chosen by process 0
        if jax.process_count() > 1:
            ocp.multihost.sync_global_processes(f"{self._barrier_prefix}_quarantine_{step}")
        self._mgr.reload()
        return name

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


def _state_handler() -> ocp.PyTreeCheckpointHandler:
    """Orbax's pytree handler; on CPU without "replica-parallel" writes.

    Replica-parallel saving splits each replicated array into one slice per device so
    that every device copies a part to the host: worthwhile on accelerators, pure
    overhead on CPU devices, which share host memory (125 eager slice ops and about a
    third of the CPU time of a save for the MNIST MLP on 8 CPU devices).
    """
    if jax.default_backend() != "cpu":
        return ocp.PyTreeCheckpointHandler()
    handlers = [
        (t, ocp.type_handlers.get_type_handler(t)) for t in ocp.type_handlers.supported_types()
    ]
    handlers = [
        (t, ocp.type_handlers.ArrayHandler(use_replica_parallel=False) if t is jax.Array else h)
        for t, h in handlers
    ]
    registry = ocp.type_handlers.create_type_handler_registry(*handlers)
    return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)


def _not_a_read_only_notice(record: logging.LogRecord) -> bool:
    """A log filter: drops orbax's notices about what ``read_only=True`` implies."""
    message = record.getMessage()
    return "read only" not in message and "read_only" not in message
