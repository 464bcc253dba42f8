"""Training: state, Trainer, callbacks, metrics (public through ``distrain``)."""

from distrain import _lazy
from distrain.train import metrics as metrics
from distrain.train.history import History as History
from distrain.train.trainer import DataEndedError as DataEndedError
from distrain.train.trainer import Trainer as Trainer

__getattr__, __dir__ = _lazy.exports(globals(), {"callbacks": "distrain.train.callbacks"})

__all__ = ["DataEndedError", "History", "Trainer", "callbacks", "metrics"]
