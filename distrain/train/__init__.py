"""Training: state, Trainer, callbacks, metrics (public through ``distrain``)."""

from distrain.train import callbacks as callbacks
from distrain.train import metrics as metrics
from distrain.train.history import History as History
from distrain.train.trainer import DataEndedError as DataEndedError
from distrain.train.trainer import Trainer as Trainer

__all__ = ["DataEndedError", "History", "Trainer", "callbacks", "metrics"]
