"""Callbacks for ``Trainer.fit`` (public as ``dt.callbacks``).

Example:
  >>> callbacks = [dt.callbacks.ProgressBar(), dt.callbacks.TerminateOnNaN(),
  ...              dt.callbacks.BackupAndRestore("/tmp/backup", save_freq=100)]
"""
