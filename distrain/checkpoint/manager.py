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

Example:
  >>> with dt.CheckpointManager("/tmp/run1", save_interval_steps=100) as mgr:
  ...     restored = mgr.restore(target=state)       # None on a fresh directory
  ...     if restored is not None:
  ...         state, step = restored.state, restored.step
  ...     for step in range(step + 1, num_steps + 1):
  ...         state = train_step(state, next(batches))
  ...         mgr.save(step, state, data_state={"position": step})
"""

from __future__ import annotations

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

from distrain.checkpoint import _fingerprint, _layout, _restore
from distrain.checkpoint._layout import CheckpointCorruptionError, LeafInfo, PyTree


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


def _positive_int(name: str, value: Any, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        choices = "a positive int or None" if allow_none else "a positive int"
        raise ValueError(f"Expected `{name}` to be {choices}; received {value!r}.")
    return int(value)


def _agree(ok: bool) -> bool:
    """True only if ``ok`` on every process (all processes must call it together)."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    flags = multihost_utils.process_allgather(np.asarray(int(ok), np.int32))
    return bool(np.all(flags))


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

    Raises:
      ValueError: if the directory cannot be created or written, or for invalid
        ``max_to_keep`` / ``save_interval_steps``.

    All processes of a multi-process job must make the same calls in the same order.

    Example:
      >>> mgr = dt.CheckpointManager("/tmp/ckpt", max_to_keep=3, save_interval_steps=10)
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
    ) -> None:
        self._max_to_keep = _positive_int("max_to_keep", max_to_keep, allow_none=True)
        self._interval = _positive_int("save_interval_steps", save_interval_steps)
        self._directory = epath.Path(os.fspath(directory)).absolute()
        _check_writable(self._directory)
        options = ocp.CheckpointManagerOptions(
            # Save exactly at multiples of the interval (orbax's default would also
            # save the first step it sees). `save` decides before calling orbax (cheaper
            # than orbax's should_save on every step); preemption saves use force=True.
            save_decision_policy=ocp_policies.FixedIntervalPolicy(self._interval),
            preservation_policy=ocp_policies.LatestN(n=self._max_to_keep),
            enable_async_checkpointing=bool(async_save),
            cleanup_tmp_directories=True,  # leftovers of a process killed mid-save
            create=True,
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
        self._closed = False

    # ------------------------------------------------------------------ queries
    @property
    def directory(self) -> epath.Path:
        """The checkpoint directory (absolute)."""
        return self._directory

    def latest_step(self) -> int | None:
        """The newest committed step, or None if there is none."""
        return self._mgr.latest_step()

    def all_steps(self) -> list[int]:
        """All committed steps, oldest first."""
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
        true, and only if ``step`` is newer than the latest checkpoint. With
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
        if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
            raise ValueError(f"Expected `step` to be a non-negative int; received {step!r}.")
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
            (truncated or garbled files), a warning names its directory, the damaged
            step is renamed to ``<step>.corrupt-<time>`` (kept for inspection, ignored
            from then on) and the previous step is tried.
          target: a pytree like the saved state giving structure, shapes, dtypes and
            placement: arrays (their sharding is used) or ``jax.ShapeDtypeStruct``s
            with shardings. The checkpoint can be restored onto a different number
            of devices or processes than it was written from. NumPy leaves restore
            as NumPy. Without a target, arrays come back as NumPy (PRNG keys as keys)
            in nested dicts and lists.

        Returns:
          A :class:`Restored`, or None if the directory holds no checkpoint.

        Raises:
          ValueError: if ``target`` does not match the checkpoint (names the first
            mismatching leaf and both shapes), or if ``step`` does not exist.
          CheckpointCorruptionError: if ``step`` was given and is damaged, or no
            checkpoint in the directory could be read back intact.
        """
        self._check_open("restore")
        self._mgr.wait_until_finished()
        if step is not None:
            if step not in self._mgr.all_steps():
                raise ValueError(
                    f"Expected `step` to be one of the checkpoints in {self._directory}: "
                    f"{self.all_steps()}; received {step!r}."
                )
            return self._restore_step(int(step), target)
        failures = []
        for s in sorted(self._mgr.all_steps(), reverse=True):
            try:
                result = self._restore_step(s, target)
            except CheckpointCorruptionError as e:
                failures.append(f"step {s}: {e}")
                warnings.warn(
                    f"Checkpoint {self._directory / str(s)} is damaged ({e}); falling back "
                    "to the previous checkpoint. The damaged step is kept as "
                    f"'{s}.corrupt-<time>' for inspection.",
                    stacklevel=2,
                )
                self._quarantine(s)
                continue
            return result
        if failures:
            raise CheckpointCorruptionError(
                f"No checkpoint in {self._directory} could be restored intact: "
                + "; ".join(failures)
                + ". Restore from a backup or start a new run in a new directory."
            )
        return None

    def _restore_step(self, step: int, target: PyTree | None) -> Restored:
        where = f"{self._directory / str(step)}"
        if not (self._directory / str(step) / "meta").exists():
            raise ValueError(
                f"Expected a checkpoint written by distrain.CheckpointManager in {where}, "
                "but it has no 'meta' item. Use orbax directly for other checkpoints."
            )
        ok, err, result = True, "", None
        try:
            side = self._mgr.restore(
                step,
                args=ocp.args.Composite(
                    data=ocp.args.JsonRestore(),
                    meta=ocp.args.JsonRestore(),
                ),
            )
            meta = _layout.unseal(side["meta"], "meta")
            data = _layout.unseal(side["data"], "data")
            manifest = meta["manifest"]
            if manifest.get("format") != _layout.FORMAT:
                raise CheckpointCorruptionError(
                    f"expected manifest format {_layout.FORMAT!r}, found {manifest.get('format')!r}"
                )
            leaves = [LeafInfo.from_json(d) for d in manifest["leaves"]]
            data_state = _layout.from_json(data["data_state"])
            metadata = _layout.from_json(meta["metadata"])
        except Exception as e:  # noqa: BLE001 - any failure to read the JSON items
            ok, err = False, _describe(e)
        if _agree(ok):
            if target is not None:
                _layout.check_compatible(leaves, target, where)
            try:
                state = self._restore_state(step, leaves, target)
            except CheckpointCorruptionError as e:
                ok, err = False, str(e)
            else:
                result = Restored(step, state, data_state, metadata)
        if not _agree(ok) or result is None:
            raise CheckpointCorruptionError(err or "damaged on another process")
        return result

    def _restore_state(self, step: int, leaves: list[LeafInfo], target: PyTree | None) -> PyTree:
        try:
            return _restore.restore_state(self._mgr, step, leaves, target)
        except CheckpointCorruptionError:
            raise
        except Exception as e:
            if target is None:
                raise CheckpointCorruptionError(_describe(e)) from e
            # Was it the files or the target (e.g. a sharding on missing devices)?
            # Reading the same step to host memory tells them apart.
            try:
                _restore.restore_state(self._mgr, step, leaves, None)
            except Exception as e2:  # noqa: BLE001
                raise CheckpointCorruptionError(_describe(e2)) from e2
            raise

    def _quarantine(self, step: int) -> None:
        if jax.process_index() == 0:
            src = self._directory / str(step)
            stamp = time.strftime("%Y%m%dT%H%M%S")
            dst = self._directory / f"{step}.corrupt-{stamp}-{uuid.uuid4().hex[:6]}"
            src.rename(dst)
        if jax.process_count() > 1:
            ocp.multihost.sync_global_processes(f"distrain_quarantine_{step}")
        self._mgr.reload()

    # ---------------------------------------------------------------- lifecycle
    def wait_until_finished(self) -> None:
        """Blocks until the pending asynchronous save (if any) is committed."""
        self._mgr.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases resources. Idempotent."""
        if not self._closed:
            self._closed = True
            self._mgr.close()

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(
                f"CheckpointManager.{what}() called after close(). Create a new "
                "CheckpointManager for the directory."
            )

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"CheckpointManager({str(self._directory)!r}, max_to_keep={self._max_to_keep}, "
            f"save_interval_steps={self._interval})"
        )


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


def _describe(e: BaseException, limit: int = 300) -> str:
    """``Type: message``, cut short (tensorstore errors embed a page-long spec)."""
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= limit else text[:limit] + " ..."


def _check_writable(directory: epath.Path) -> None:
    probe = directory / f".distrain-write-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ValueError(
            f"Expected a checkpoint directory this process can create and write; "
            f"{directory} is not writable ({type(e).__name__}: {e}). Choose another "
            "directory or fix its permissions."
        ) from e
