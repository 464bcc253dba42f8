"""Fault tolerance: checkpoints that resume exactly, preemption handling.

Example:
  >>> import distrain as dt
  >>> with dt.CheckpointManager("/tmp/run", save_interval_steps=100) as mgr:
  ...     restored = mgr.restore(target=state)
"""
