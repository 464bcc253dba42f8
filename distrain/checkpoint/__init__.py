"""Fault tolerance: checkpoints that resume exactly, preemption handling.

Example:
  >>> import distrain as dt
  >>> with dt.CheckpointManager("/tmp/run", save_interval_steps=100) as mgr:
  ...     restored = mgr.restore(target=state)
"""

from distrain.checkpoint._layout import CheckpointCorruptionError as CheckpointCorruptionError
from distrain.checkpoint.manager import CheckpointManager as CheckpointManager
from distrain.checkpoint.manager import Restored as Restored
from distrain.checkpoint.preemption import PREEMPTION_EXIT_CODE as PREEMPTION_EXIT_CODE
from distrain.checkpoint.preemption import PreemptionHandler as PreemptionHandler

__all__ = [
    "PREEMPTION_EXIT_CODE",
    "CheckpointCorruptionError",
    "CheckpointManager",
    "PreemptionHandler",
    "Restored",
]
