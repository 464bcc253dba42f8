"""Callbacks for ``Trainer.fit`` (public as ``dt.callbacks``)."""
