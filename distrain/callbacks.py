"""Callbacks for ``Trainer.fit`` (``dt.callbacks``).

Example:
  >>> callbacks = [dt.callbacks.ProgressBar(), dt.callbacks.TerminateOnNaN(),
  ...              dt.callbacks.BackupAndRestore("/tmp/backup", save_freq=100)]
"""

from distrain.train.callbacks import BackupAndRestore as BackupAndRestore
from distrain.train.callbacks import Callback as Callback
from distrain.train.callbacks import CallbackList as CallbackList
from distrain.train.callbacks import CSVLogger as CSVLogger
from distrain.train.callbacks import EarlyStopping as EarlyStopping
from distrain.train.callbacks import JSONLinesLogger as JSONLinesLogger
from distrain.train.callbacks import LambdaCallback as LambdaCallback
from distrain.train.callbacks import ModelCheckpoint as ModelCheckpoint
from distrain.train.callbacks import ProfilerWindow as ProfilerWindow
from distrain.train.callbacks import ProgressBar as ProgressBar
from distrain.train.callbacks import StepInfo as StepInfo
from distrain.train.callbacks import TensorBoard as TensorBoard
from distrain.train.callbacks import TerminateOnNaN as TerminateOnNaN
from distrain.train.callbacks import Throughput as Throughput
from distrain.train.callbacks.throughput import format_throughput as format_throughput

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
    "format_throughput",
]
