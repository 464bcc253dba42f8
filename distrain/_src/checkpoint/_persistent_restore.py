"""Restoring from the persistent checkpoints: one step read back, or the newest intact.

Every process reads a step (its manifest, data position and metadata first, then the
state), then all agree on the outcome before anyone goes on: a step damaged for one
process is damaged for all. A damaged newest step is renamed aside
(``<step>.corrupt-<time>-<id>``; left in place when read-only) with a warning, and the
previous one is tried. ``_errors`` says what is damage and words the messages.

Example:
  >>> reader = StepReader(orbax_manager, directory, read_only=False, barrier_prefix="ck0")
  >>> reader.restore(None, sorted(orbax_manager.all_steps()), target=state).step
  100
"""

from __future__ import annotations

import time
import uuid
import warnings
from typing import Any, NamedTuple

import jax
import orbax.checkpoint as ocp
from etils import epath

from distrain._src.checkpoint import _directory, _errors, _layout, _restore
from distrain._src.checkpoint import _orbax_internals as _internals
from distrain._src.checkpoint._layout import CheckpointCorruptionError, LeafInfo
from distrain._src.pytree import PyTree

__all__ = ["Restored", "StepReader"]


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


class StepReader:
    """Reads the steps of one checkpoint directory back, through its orbax manager."""

    def __init__(
        self,
        mgr: ocp.CheckpointManager,
        directory: epath.Path,
        read_only: bool,
        barrier_prefix: str,
    ) -> None:
        self._mgr = mgr
        self._directory = directory
        self._read_only = read_only
        self._barrier_prefix = barrier_prefix

    def restore(self, step: int | None, steps: list[int], target: PyTree | None) -> Restored | None:
        """``step`` (None: the newest of ``steps`` that restores intact, setting damaged
        ones aside), or None when ``steps`` is empty. All processes call it together."""
        if step is not None:
            if step not in steps:
                raise ValueError(
                    f"Expected `step` to be one of the checkpoints in {self._directory}: "
                    f"{steps}; received {step!r}."
                )
            return self.restore_step(int(step), target)
        failures = []
        for s in sorted(steps, reverse=True):
            try:
                result = self.restore_step(s, target)
            except CheckpointCorruptionError as e:
                failures.append(f"step {s}: {e}")
                aside = "the damaged step is left in place (read_only)"
                if not self._read_only:
                    aside = (
                        f"the damaged step was renamed to {self.quarantine(s)!r} (set aside "
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

    def restore_step(self, step: int, target: PyTree | None) -> Restored:
        """``step``, read back and verified; every process agrees on the outcome."""
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
                state = self._state(step, leaves, target)
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

    def _state(self, step: int, leaves: list[LeafInfo], target: PyTree | None) -> PyTree:
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

    def quarantine(self, step: int) -> str:
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
