"""Fault tolerance (``dt.checkpoint``): checkpoints that resume exactly, preemption.

``import distrain`` does not import orbax: this module loads on first use of
``dt.checkpoint``.

Example:
  >>> import distrain as dt
  >>> with dt.checkpoint.CheckpointManager("/tmp/run", save_interval_steps=100) as mgr:
  ...     restored = mgr.restore(target=state)
"""

from distrain._src.checkpoint._layout import CheckpointCorruptionError as CheckpointCorruptionError
from distrain._src.checkpoint._persistent_restore import Restored as Restored
from distrain._src.checkpoint.manager import CheckpointManager as CheckpointManager
from distrain._src.checkpoint.preemption import PREEMPTION_EXIT_CODE as PREEMPTION_EXIT_CODE
from distrain._src.checkpoint.preemption import PreemptionHandler as PreemptionHandler

__all__ = [
    "PREEMPTION_EXIT_CODE",
    "CheckpointCorruptionError",
    "CheckpointManager",
    "PreemptionHandler",
    "Restored",
]
