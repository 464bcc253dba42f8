"""Experiment trackers: ``WandbLogger`` (Weights & Biases) and ``MLflowLogger`` (MLflow).

Both log the same things under the same names, against the Trainer's global step:

* ``train/<metric>`` every ``log_every`` steps (the Trainer's host syncs);
* ``perf/examples_per_sec``, ``perf/tokens_per_sec``, ``perf/mfu`` when a
  ``Throughput`` callback placed before the logger measured them;
* ``epoch`` and ``train_epoch/<metric>`` (the epoch's means) at every epoch end, and
  ``val/<metric>`` for the validation metrics (the Trainer's ``val_`` logs);
* the run's ``config`` (a dict you pass; ``distrain train`` passes its YAML after
  overrides) and, under ``distrain``, the strategy: class, replicas, devices,
  processes, mesh layout, platform and device kind;
* with ``log_checkpoint=<ModelCheckpoint>``, the newest checkpoint at the end of ``fit``.

Only the chief process logs. The tracked run's id is part of every checkpoint
(``Callback.state_dict``), so a ``fit`` resumed by ``BackupAndRestore`` continues the
same run, with the step axis continuing from the restored step. The run is opened at the
first thing to log (or checkpoint), after any resume.

The packages are optional extras, imported when a logger is made:
``pip install 'distrain[wandb]'`` / ``pip install 'distrain[mlflow]'``.

Example:
  >>> callbacks = [dt.callbacks.Throughput(global_batch_size=256),
  ...              dt.callbacks.WandbLogger(project="mnist", config=cfg),
  ...              dt.callbacks.BackupAndRestore("/tmp/backup", save_freq=100)]
"""

from __future__ import annotations

import abc
import importlib
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any, final

import jax

from distrain._src import verbosity
from distrain._src.train.callbacks.base import Callback, Logs, StepInfo
from distrain._src.train.callbacks.checkpointing import ModelCheckpoint
from distrain._src.train.callbacks.logging import _chief

STEP_KEY = "global_step"
"""The x axis of every logged value: the Trainer's global step (continues on resume)."""

_PERF_KEYS = ("examples_per_sec", "tokens_per_sec", "mfu")  # what Throughput adds to logs


def require(module: str, extra: str, who: str) -> Any:
    """Imports an optional package, or raises one error naming the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"{who} needs the `{module}` package, which is not installed (or failed to "
            f"import: {e}). Install it with: pip install 'distrain[{extra}]'."
        ) from e


def strategy_info(trainer: Any) -> dict[str, Any]:
    """What the run ran on: strategy class, replicas, devices, processes, mesh layout."""
    s = trainer.strategy
    return {
        "strategy": type(s).__name__,
        "replicas": int(s.num_replicas_in_sync),
        "devices": len(s.devices),
        "processes": jax.process_count(),
        "layout": {str(k): int(v) for k, v in s.mesh.shape.items()},
        "platform": s.devices[0].platform,
        "device_kind": s.devices[0].device_kind,
    }


def step_metrics(logs: Mapping[str, float]) -> dict[str, float]:
    """``train/<metric>`` and ``perf/<throughput>`` names for a step's logs."""
    return {(f"perf/{k}" if k in _PERF_KEYS else f"train/{k}"): float(v) for k, v in logs.items()}


def epoch_metrics(epoch: int, logs: Mapping[str, float]) -> dict[str, float]:
    """``epoch``, ``train_epoch/<metric>`` and ``val/<metric>`` names for an epoch's logs;
    a name that has a prefix already keeps it (a ``dt.SidecarEvaluator``'s ``eval/<metric>``)."""
    # Not epoch/<metric>: MLflow's file store keeps a metric as a file, so `epoch` and
    # `epoch/loss` cannot both exist.
    out = {"epoch": float(epoch)}
    for k, v in logs.items():
        if "/" in k:
            out[k] = float(v)
        else:
            out[f"val/{k[4:]}" if k.startswith("val_") else f"train_epoch/{k}"] = float(v)
    return out


class _Tracker(Callback, abc.ABC):
    """What both loggers share: chief-only, lazy run, run id in checkpoints."""

    def __init__(
        self,
        config: Mapping[str, Any] | None,
        run_id: str | None,
        log_checkpoint: ModelCheckpoint | None,
    ) -> None:
        if config is not None and not isinstance(config, Mapping):
            raise TypeError(
                f"{type(self).__name__}(config=...) must be a dict of the run's settings. "
                f"Received: {type(config).__name__} {config!r:.100}."
            )
        if log_checkpoint is not None and not isinstance(log_checkpoint, ModelCheckpoint):
            raise TypeError(
                f"{type(self).__name__}(log_checkpoint=...) must be the ModelCheckpoint "
                f"callback whose newest checkpoint to upload. Received: {log_checkpoint!r}."
            )
        self.config = dict(config or {})
        self.log_checkpoint = log_checkpoint
        self.run_id: str | None = run_id
        """The tracked run's id (set once the run is open; kept after ``fit``)."""
        self._attach: str | None = run_id  # a run to continue instead of starting one
        self._open = False

    # ------------------------------------------------------------- backend hooks
    @abc.abstractmethod
    def _start(self, resume_id: str | None, config: dict[str, Any]) -> str:
        """Opens (or reopens ``resume_id``) and returns the run id."""

    @abc.abstractmethod
    def _log(self, metrics: dict[str, float], step: int) -> None: ...

    @abc.abstractmethod
    def _upload(self, path: str, step: int) -> None:
        """Uploads the checkpoint directory ``path`` (saved at ``step``)."""

    @abc.abstractmethod
    def _end(self, failed: bool) -> None: ...

    # -------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any] | None:
        # Saved with every checkpoint: open now, so even a checkpoint written before the
        # first log names the run that a resume continues.
        if self._ensure_open():
            return {"run_id": self.run_id}
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("run_id"):
            self._attach = str(state["run_id"])

    def _ensure_open(self) -> bool:
        if self._open:
            return True
        t = self.trainer
        if t is None or not t.loop.in_fit or not _chief(self):
            return False
        config = {**self.config, "distrain": strategy_info(t)}
        self.run_id = self._start(self._attach, config)
        self._attach, self._open = None, True
        return True

    # -------------------------------------------------------------------- hooks
    def on_train_batch_end(self, info: StepInfo) -> None:
        if info.logs and self._ensure_open():
            self._log(step_metrics(info.logs), info.step)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if self._ensure_open():
            self._log(epoch_metrics(epoch, logs or {}), self._fit_trainer.loop.global_step)

    def on_train_end(self, logs: Logs | None = None) -> None:
        if not self._ensure_open():
            return
        ck = self.log_checkpoint
        if ck is not None and ck.last_saved_step is not None:
            if ck.manager is not None:  # still open: this logger runs before it
                ck.manager.wait_until_finished()
            path = os.path.join(ck.directory, str(ck.last_saved_step))
            self._upload(path, ck.last_saved_step)
        figures = goodput_figures()
        if figures:
            self._log(figures, self._fit_trainer.loop.global_step)
        self._close(failed=False)

    def on_train_abort(self, error: BaseException) -> None:
        if self._open:
            self._close(failed=True)

    def _close(self, failed: bool) -> None:
        self._open = False
        self._end(failed)


@final
class WandbLogger(_Tracker):
    """Logs a ``fit`` to Weights & Biases (``wandb``), one run per training run.

    Names and step axis as the module says: every value is logged with
    ``global_step`` (the Trainer's step) as its x axis, so a run resumed by
    ``BackupAndRestore`` continues the same W&B run and the same curve. Offline
    (``mode="offline"`` or ``WANDB_MODE=offline``), the run is written under ``dir`` for
    a later ``wandb sync``.

    Args:
      project: the W&B project.
      name: the run's display name.
      config: the run's settings (a dict), shown as the run's config.
      entity: the W&B team or user (default: yours).
      group: groups runs (e.g. the runs of a sweep).
      tags: labels for the run.
      mode: ``"online"``, ``"offline"`` or ``"disabled"`` (default: ``WANDB_MODE`` or online).
      dir: where W&B writes its files (default: ``WANDB_DIR`` or the working directory).
      run_id: continue this W&B run (e.g. the id a ``ModelCheckpoint`` saved in its
        ``metadata["progress"]["callbacks"]["WandbLogger"]["run_id"]``).
      log_checkpoint: a ``ModelCheckpoint`` callback of the same ``fit``: its newest
        checkpoint is uploaded as a ``model`` artifact at the end.
      init_kwargs: more arguments for ``wandb.init``.

    Raises:
      ImportError: ``wandb`` is not installed (``pip install 'distrain[wandb]'``).
      TypeError: ``config`` not a dict, ``log_checkpoint`` not a ``ModelCheckpoint``.

    Example:
      >>> logger = dt.callbacks.WandbLogger(project="mnist", config={"lr": 1e-3})
      >>> trainer.fit(state, data, epochs=3, callbacks=[logger])
    """

    def __init__(
        self,
        project: str | None = None,
        *,
        name: str | None = None,
        config: Mapping[str, Any] | None = None,
        entity: str | None = None,
        group: str | None = None,
        tags: Sequence[str] | None = None,
        mode: str | None = None,
        dir: str | os.PathLike[str] | None = None,
        run_id: str | None = None,
        log_checkpoint: ModelCheckpoint | None = None,
        init_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self._wandb = require("wandb", "wandb", "WandbLogger")
        super().__init__(config, run_id, log_checkpoint)
        self.init_kwargs = {
            k: v
            for k, v in dict(
                project=project,
                name=name,
                entity=entity,
                group=group,
                tags=list(tags) if tags is not None else None,
                mode=mode,
                dir=os.fspath(dir) if dir is not None else None,
            ).items()
            if v is not None
        }
        self.init_kwargs.update(init_kwargs or {})
        self.run: Any = None
        """The ``wandb`` run while ``fit`` runs (for logging more yourself)."""

    def _start(self, resume_id: str | None, config: dict[str, Any]) -> str:
        wandb = self._wandb
        kwargs: dict[str, Any] = {"config": config, **self.init_kwargs}
        if resume_id is not None:
            kwargs.update(id=resume_id, resume="allow")
        if "dir" in kwargs:
            os.makedirs(kwargs["dir"], exist_ok=True)
        self.run = wandb.init(**kwargs)
        # Our step, not W&B's own counter: a resumed run re-logs the steps after its
        # checkpoint, which W&B's monotonic _step would drop.
        self.run.define_metric(STEP_KEY)
        self.run.define_metric("*", step_metric=STEP_KEY)
        return str(self.run.id)

    def _log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log({**metrics, STEP_KEY: step})

    def _upload(self, path: str, step: int) -> None:
        art = self._wandb.Artifact(f"checkpoint-{self.run.id}", type="model")
        art.add_dir(path)
        self.run.log_artifact(art, aliases=["latest", f"step-{step}"])

    def _end(self, failed: bool) -> None:
        run, self.run = self.run, None
        if run is not None:
            run.finish(exit_code=1 if failed else 0)


@final
class MLflowLogger(_Tracker):
    """Logs a ``fit`` to MLflow, one run per training run (through ``MlflowClient``).

    Metrics as the module says, each with ``step`` = the Trainer's global step, so a run
    resumed by ``BackupAndRestore`` continues the same MLflow run and the same curves.
    The config and the strategy become parameters with dotted names
    (``optimizer.learning_rate``, ``distrain.replicas``); a resumed run keeps those it
    has.

    Args:
      experiment: the experiment name (created if missing).
      run_name: the run's name.
      config: the run's settings (a dict), logged as parameters.
      tracking_uri: where runs go (e.g. ``http://host:5000``, ``sqlite:///mlflow.db`` or a
        ``file:`` directory; default: ``MLFLOW_TRACKING_URI`` or MLflow's default).
      tags: tags of the run.
      run_id: continue this MLflow run (e.g. the id a ``ModelCheckpoint`` saved in its
        ``metadata["progress"]["callbacks"]["MLflowLogger"]["run_id"]``).
      log_checkpoint: a ``ModelCheckpoint`` callback of the same ``fit``: its newest
        checkpoint is uploaded as artifacts under ``checkpoints/step-<N>`` at the end.

    Raises:
      ImportError: ``mlflow`` is not installed (``pip install 'distrain[mlflow]'``).
      TypeError: ``config`` not a dict, ``log_checkpoint`` not a ``ModelCheckpoint``.
      ValueError: during ``fit``, a run to continue that the tracking store does not have.

    Example:
      >>> logger = dt.callbacks.MLflowLogger("mnist", tracking_uri="sqlite:///mlflow.db")
      >>> trainer.fit(state, data, epochs=3, callbacks=[logger])
    """

    def __init__(
        self,
        experiment: str = "distrain",
        *,
        run_name: str | None = None,
        config: Mapping[str, Any] | None = None,
        tracking_uri: str | None = None,
        tags: Mapping[str, str] | None = None,
        run_id: str | None = None,
        log_checkpoint: ModelCheckpoint | None = None,
    ) -> None:
        require("mlflow", "mlflow", "MLflowLogger")
        super().__init__(config, run_id, log_checkpoint)
        self.experiment = experiment
        self.run_name = run_name
        self.tracking_uri = tracking_uri
        self.tags = {str(k): str(v) for k, v in (tags or {}).items()}
        self.client: Any = None
        """The ``MlflowClient`` while ``fit`` runs."""

    def _start(self, resume_id: str | None, config: dict[str, Any]) -> str:
        from mlflow.entities import Param, RunStatus
        from mlflow.tracking import MlflowClient

        verbosity.quiet_mlflow()  # its INFO lines on creating a SQL store's tables
        self.client = client = _open_store(MlflowClient, self.tracking_uri)
        if resume_id is not None:
            try:
                client.get_run(resume_id)
            except Exception as e:  # MlflowException: no such run in this store
                store = self.tracking_uri or "MLFLOW_TRACKING_URI"
                raise ValueError(
                    f"MLflowLogger: expected to continue MLflow run {resume_id!r} (from "
                    f"run_id= or the restored checkpoint), but the tracking store {store!r} "
                    f"has no such run ({e}). Use the tracking_uri the run was logged to, or a "
                    "new backup directory to start a new run."
                ) from e
            client.update_run(resume_id, status=RunStatus.to_string(RunStatus.RUNNING))
            return resume_id
        exp = client.get_experiment_by_name(self.experiment)
        exp_id = exp.experiment_id if exp is not None else client.create_experiment(self.experiment)
        run = client.create_run(exp_id, run_name=self.run_name, tags=self.tags)
        params = [Param(k, str(v)[:6000]) for k, v in _flatten(config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            client.log_batch(run.info.run_id, params=params[i : i + 100])
        return str(run.info.run_id)

    def _log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, v, now, step) for k, v in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def _upload(self, path: str, step: int) -> None:
        self.client.log_artifacts(self.run_id, path, artifact_path=f"checkpoints/step-{step}")

    def _end(self, failed: bool) -> None:
        client, self.client = self.client, None
        if client is not None:
            client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")


def goodput_figures() -> dict[str, float]:
    """``goodput/goodput`` and ``goodput/<bucket>_s`` of the run so far, when this fit keeps
    a goodput ledger (``dt.callbacks.Goodput``); else nothing."""
    from distrain._src.goodput import ledger as goodput
    from distrain._src.goodput.report import report

    ledger = goodput.current()
    if ledger is None:
        return {}
    ledger.record("tick")  # the totals up to now
    r = report(os.path.dirname(ledger.path))
    return {
        "goodput/goodput": r.goodput,
        "goodput/wall_s": r.wall_s,
        **{f"goodput/{k}_s": v for k, v in r.buckets_s.items()},
    }


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _open_store(client_class: Any, uri: str | None) -> Any:
    """An ``MlflowClient`` whose store opened, or one line naming the URI and the fix.

    MLflow resolves the store on first use, and its errors for a store it cannot open
    (a SQL URI without SQLAlchemy, MLflow 3's refusal of the plain file store, an
    unknown scheme) are long and name the model registry; this asks once, up front.
    """
    from mlflow.exceptions import MlflowException

    try:
        client = client_class(tracking_uri=uri)
        client.get_experiment_by_name("Default")
    except (MlflowException, ImportError) as e:
        shown = uri or os.environ.get("MLFLOW_TRACKING_URI") or "the default ./mlruns"
        first = " ".join(str(e).split())[:160]
        raise ValueError(
            f"MLflowLogger: MLflow cannot open the tracking store {shown!r} ({first}). "
            "A sqlite:// (or other SQL) store needs SQLAlchemy and Alembic: pip install "
            "'distrain[mlflow]'; a local directory (file://...) needs "
            "MLFLOW_ALLOW_FILE_STORE=true with MLflow 3; a server is http://host:5000."
        ) from None
    return client
