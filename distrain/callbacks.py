"""Callbacks for ``Trainer.fit`` (``dt.callbacks``).

``WandbLogger`` and ``MLflowLogger`` need the optional extras ``distrain[wandb]`` /
``distrain[mlflow]`` (imported when one is made, not with ``distrain``).

Example:
  >>> callbacks = [dt.callbacks.ProgressBar(), dt.callbacks.TerminateOnNaN(),
  ...              dt.callbacks.BackupAndRestore("/tmp/backup", save_freq=100)]
"""

from distrain._src.train.callbacks.base import Callback as Callback
from distrain._src.train.callbacks.base import CallbackList as CallbackList
from distrain._src.train.callbacks.base import LambdaCallback as LambdaCallback
from distrain._src.train.callbacks.base import StepInfo as StepInfo
from distrain._src.train.callbacks.checkpointing import BackupAndRestore as BackupAndRestore
from distrain._src.train.callbacks.checkpointing import ModelCheckpoint as ModelCheckpoint
from distrain._src.train.callbacks.control import EarlyStopping as EarlyStopping
from distrain._src.train.callbacks.control import TerminateOnNaN as TerminateOnNaN
from distrain._src.train.callbacks.goodput import Goodput as Goodput
from distrain._src.train.callbacks.logging import CSVLogger as CSVLogger
from distrain._src.train.callbacks.logging import JSONLinesLogger as JSONLinesLogger
from distrain._src.train.callbacks.logging import ProgressBar as ProgressBar
from distrain._src.train.callbacks.logging import TensorBoard as TensorBoard
from distrain._src.train.callbacks.throughput import ProfilerWindow as ProfilerWindow
from distrain._src.train.callbacks.throughput import Throughput as Throughput
from distrain._src.train.callbacks.throughput import format_throughput as format_throughput
from distrain._src.train.callbacks.tracking import MLflowLogger as MLflowLogger
from distrain._src.train.callbacks.tracking import WandbLogger as WandbLogger
from distrain._src.train.progress import LoopState as LoopState

__all__ = [
    "BackupAndRestore",
    "CSVLogger",
    "Callback",
    "CallbackList",
    "EarlyStopping",
    "Goodput",
    "JSONLinesLogger",
    "LambdaCallback",
    "LoopState",
    "MLflowLogger",
    "ModelCheckpoint",
    "ProfilerWindow",
    "ProgressBar",
    "StepInfo",
    "TensorBoard",
    "TerminateOnNaN",
    "Throughput",
    "WandbLogger",
    "format_throughput",
]
