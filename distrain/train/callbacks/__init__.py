"""Callbacks for ``Trainer.fit`` (public as ``dt.callbacks``).

Example:
  >>> callbacks = [dt.callbacks.ProgressBar(), dt.callbacks.TerminateOnNaN(),
  ...              dt.callbacks.BackupAndRestore("/tmp/backup", save_freq=100)]
"""

from distrain.train.callbacks.base import Callback as Callback
from distrain.train.callbacks.base import CallbackList as CallbackList
from distrain.train.callbacks.base import LambdaCallback as LambdaCallback
from distrain.train.callbacks.base import StepInfo as StepInfo
from distrain.train.callbacks.checkpointing import BackupAndRestore as BackupAndRestore
from distrain.train.callbacks.checkpointing import ModelCheckpoint as ModelCheckpoint
from distrain.train.callbacks.control import EarlyStopping as EarlyStopping
from distrain.train.callbacks.control import TerminateOnNaN as TerminateOnNaN
from distrain.train.callbacks.logging import CSVLogger as CSVLogger
from distrain.train.callbacks.logging import JSONLinesLogger as JSONLinesLogger
from distrain.train.callbacks.logging import ProgressBar as ProgressBar
from distrain.train.callbacks.logging import TensorBoard as TensorBoard
from distrain.train.callbacks.throughput import ProfilerWindow as ProfilerWindow
from distrain.train.callbacks.throughput import Throughput as Throughput

__all__ = [
    "BackupAndRestore",
    "CSVLogger",
    "Callback",
    "CallbackList",
    "EarlyStopping",
    "JSONLinesLogger",
    "LambdaCallback",
    "ModelCheckpoint",
    "ProfilerWindow",
    "ProgressBar",
    "StepInfo",
    "TensorBoard",
    "TerminateOnNaN",
    "Throughput",
]
