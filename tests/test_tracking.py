"""WandbLogger and MLflowLogger with the real libraries and no network.

W&B runs offline (its transaction log is read back with tests/wandb_records.py); MLflow
writes to a ``file:`` store in tmp and is read back with ``MlflowClient``. Real 2-process
jobs and a SIGKILL-and-resume run tests/scripts/tracking_train.py.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

import distrain as dt
from distrain import Trainer
from distrain import callbacks as cb
from distrain.data import ArrayPipeline
from tests.linear_problem import eval_step, new_state, problem, train_step
from tests.processes import run_together, xla_flags
from tests.wandb_records import metric, offline_runs

pytestmark = pytest.mark.one_end("newest")  # see tests/conftest.py

SCRIPT = str(Path(__file__).parent / "scripts" / "tracking_train.py")

# No network, no telemetry; MLflow >= 3.7 refuses its file store unless allowed.
# W&B offline writes its log every 15 s by default: a killed run would lose that much.
ENV = {
    "WANDB_MODE": "offline",
    "WANDB_SILENT": "true",
    "WANDB_X_TRANSACTION_LOG_FLUSH_INTERVAL": "0.01",
    "MLFLOW_ALLOW_FILE_STORE": "true",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "1",
}


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path):
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))


@pytest.fixture
def strategy(devices):
    s = dt.MirroredStrategy()
    assert s.num_replicas_in_sync == 8
    return s


def wandb_runs(wandb_dir):
    """The offline runs in ``wandb_dir``, once W&B's core process has written them all
    (``finish`` returns before it has; ``teardown`` waits for it)."""
    import wandb

    wandb.teardown()
    return offline_runs(wandb_dir)


def pipeline(n=160, batch=32):
    return ArrayPipeline(problem(n), global_batch_size=batch, seed=0)  # 5 steps per epoch


def mlflow_client(uri):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def history(client, run_id, key):
    return [(m.step, m.value) for m in client.get_metric_history(run_id, key)]


def only_run(client):
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert len(runs) == 1, [r.info.run_id for r in runs]
    return runs[0]


def fit_with(strategy, tmp_path, *callbacks, epochs=2, **fit):
    throughput = cb.Throughput(
        global_batch_size=32, tokens_per_example=8, flops_per_example=1e3, peak_flops_per_device=1e9
    )
    trainer = Trainer(strategy, train_step, eval_step, log_every=2)
    trainer.fit(
        new_state(),
        pipeline(),
        epochs=epochs,
        validation_data=pipeline(64),
        callbacks=[throughput, *callbacks],
        **fit,
    )
    return trainer


CONFIG = {"optimizer": {"name": "sgd", "learning_rate": 0.05}, "seed": 0}


def test_wandb_logs_steps_epochs_validation_throughput_config_and_checkpoint(strategy, tmp_path):
    ckpt = cb.ModelCheckpoint(tmp_path / "ckpt", save_freq="epoch")
    logger = cb.WandbLogger(
        project="p", dir=tmp_path / "wb", config=CONFIG, tags=["t"], log_checkpoint=ckpt
    )
    trainer = fit_with(strategy, tmp_path, ckpt, logger)

    (run,) = wandb_runs(tmp_path / "wb")
    assert run.run_id == logger.run_id and run.exit_code == 0 and not run.resumed
    assert run.config["optimizer"] == CONFIG["optimizer"] and run.config["seed"] == 0
    assert run.config["distrain"] == {
        "strategy": "MirroredStrategy",
        "replicas": 8,
        "devices": 8,
        "processes": 1,
        "layout": {"replica": 8},
        "platform": "cpu",
        "device_kind": jax.devices()[0].device_kind,
    }
    rows = run.history
    assert [s for s, _ in metric(rows, "train/loss")] == [2, 4, 6, 8, 10]
    assert [s for s, _ in metric(rows, "train_epoch/loss")] == [5, 10]
    assert [v for _, v in metric(rows, "epoch")] == [0, 1]
    val = metric(rows, "val/loss")
    assert [s for s, _ in val] == [5, 10]
    assert val[1][1] == pytest.approx(trainer.loop.history.history["val_loss"][1])
    # Throughput's numbers (its first window is compilation, so from step 4 on).
    tps = metric(rows, "perf/tokens_per_sec")
    assert tps and all(v > 0 for _, v in tps) and metric(rows, "perf/mfu")
    assert not any(k.startswith("train/") and "per_sec" in k for r in rows for k in r)
    assert run.summary["val/loss"] == pytest.approx(val[1][1])
    # The newest checkpoint (step 10) as a model artifact.
    (art,) = run.artifacts
    assert art.type == "model" and "step-10" in art.aliases
    assert {e.path.split("/")[0] for e in art.manifest.contents}  # files of the checkpoint


def test_mlflow_logs_steps_epochs_validation_throughput_config_and_checkpoint(strategy, tmp_path):
    uri = (tmp_path / "mlruns").as_uri()
    ckpt = cb.ModelCheckpoint(tmp_path / "ckpt", save_freq="epoch")
    logger = cb.MLflowLogger(
        "exp",
        run_name="r",
        tracking_uri=uri,
        config=CONFIG,
        tags={"team": "a"},
        log_checkpoint=ckpt,
    )
    goodput = cb.Goodput(tmp_path / "run")
    # The logger first: it waits for the save.
    trainer = fit_with(strategy, tmp_path, logger, ckpt, goodput)

    client = mlflow_client(uri)
    run = only_run(client)
    assert run.info.run_id == logger.run_id and run.info.status == "FINISHED"
    assert run.info.run_name == "r" and run.data.tags["team"] == "a"
    params = run.data.params
    assert params["optimizer.learning_rate"] == "0.05" and params["seed"] == "0"
    assert params["distrain.replicas"] == "8" and params["distrain.processes"] == "1"
    assert params["distrain.layout.replica"] == "8"
    assert params["distrain.strategy"] == "MirroredStrategy"
    rid = run.info.run_id
    assert [s for s, _ in history(client, rid, "train/loss")] == [2, 4, 6, 8, 10]
    assert [s for s, _ in history(client, rid, "train_epoch/loss")] == [5, 10]
    val = history(client, rid, "val/loss")
    assert [s for s, _ in val] == [5, 10]
    assert val[1][1] == pytest.approx(trainer.loop.history.history["val_loss"][1])
    assert history(client, rid, "perf/tokens_per_sec") and history(client, rid, "perf/mfu")
    files = client.list_artifacts(rid, "checkpoints/step-10")
    assert files, "the newest checkpoint was not uploaded"
    # The goodput ledger's figures, once, at the end of fit.
    [(step, value)] = history(client, rid, "goodput/goodput")
    assert step == 10 and 0 < value < 1
    assert history(client, rid, "goodput/checkpoint_s")[0][1] > 0
    goodput.ledger.close()


def test_a_failed_fit_marks_the_run_failed(strategy, tmp_path):
    uri = (tmp_path / "mlruns").as_uri()

    def boom(info):
        if info.step == 3:
            raise RuntimeError("boom")

    wandb_logger = cb.WandbLogger(project="p", dir=tmp_path / "wb")
    mlflow_logger = cb.MLflowLogger("exp", tracking_uri=uri)
    trainer = Trainer(strategy, train_step, log_every=1)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(
            new_state(),
            pipeline(),
            epochs=1,
            callbacks=[wandb_logger, mlflow_logger, cb.LambdaCallback(on_train_batch_end=boom)],
        )
    (run,) = wandb_runs(tmp_path / "wb")
    assert run.exit_code == 1 and [s for s, _ in metric(run.history, "train/loss")] == [1, 2, 3]
    assert only_run(mlflow_client(uri)).info.status == "FAILED"


def test_only_the_chief_logs(strategy, tmp_path):
    uri = (tmp_path / "mlruns").as_uri()
    loggers = [cb.WandbLogger(project="p", dir=tmp_path / "wb"), cb.MLflowLogger(tracking_uri=uri)]
    trainer = Trainer(strategy, train_step, log_every=1, callbacks=loggers)
    trainer.is_chief = False
    trainer.fit(new_state(), pipeline(), epochs=1)
    assert not (tmp_path / "wb").exists() and not (tmp_path / "mlruns").exists()
    assert loggers[0].run_id is None and loggers[1].run_id is None


def test_resume_in_process_continues_the_run_and_the_step_axis(strategy, tmp_path):
    """BackupAndRestore after the loggers: the run opens only after the restore."""
    uri = (tmp_path / "mlruns").as_uri()
    backup = tmp_path / "backup"

    def stop_at(step):
        def stop(info):
            if info.step == step:
                raise KeyboardInterrupt  # a crash after the backup of step 4

        return cb.LambdaCallback(on_train_batch_end=stop)

    def attempt(*extra):
        logger = cb.MLflowLogger("exp", tracking_uri=uri)
        trainer = Trainer(strategy, train_step, log_every=1)
        restore = cb.BackupAndRestore(backup, save_freq=2, async_save=False)
        trainer.fit(new_state(), pipeline(), epochs=2, callbacks=[logger, restore, *extra])
        return logger

    with pytest.raises(KeyboardInterrupt):
        attempt(stop_at(5))
    logger = attempt()
    client = mlflow_client(uri)
    run = only_run(client)
    assert run.info.run_id == logger.run_id and run.info.status == "FINISHED"
    steps = [s for s, _ in history(client, logger.run_id, "train/loss")]
    assert steps == [1, 2, 3, 4, 5, 5, 6, 7, 8, 9, 10]  # step 5 again after the backup of 4


def _env(devices: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTRAIN_")}
    env.update(ENV, XLA_FLAGS=xla_flags(devices))
    env.update(JAX_PLATFORMS="cpu")
    return env


def _script_args(tmp_path: Path) -> list[str]:
    return [
        "--wandb-dir", str(tmp_path / "wb"),
        "--mlflow-uri", (tmp_path / "mlruns").as_uri(),
        "--backup", str(tmp_path / "backup"),
    ]  # fmt: skip


def test_two_processes_log_one_run(tmp_path):
    launch = [sys.executable, "-m", "distrain._src.cluster.launch", "--nproc", "2"]
    launch += ["--devices-per-proc", "2", "--timeout", "60", "--"]
    ((code, log, _),) = run_together(
        [([*launch, sys.executable, SCRIPT, *_script_args(tmp_path)], _env(4))], timeout=240
    )
    assert code == 0, log
    (line,) = [x for x in log.splitlines() if " RUN " in x or x.startswith("RUN")]
    assert line.startswith("[0] ")  # printed by the chief only
    wandb_id, mlflow_id = line.split()[-2:]

    (run,) = offline_runs(tmp_path / "wb")  # one run, not one per process
    assert run.run_id == wandb_id and run.exit_code == 0
    assert run.config["distrain"]["processes"] == 2 and run.config["distrain"]["replicas"] == 4
    assert [s for s, _ in metric(run.history, "train/loss")] == list(range(1, 9))

    client = mlflow_client((tmp_path / "mlruns").as_uri())
    mrun = only_run(client)
    assert mrun.info.run_id == mlflow_id and mrun.data.params["distrain.processes"] == "2"
    assert [s for s, _ in history(client, mlflow_id, "train/loss")] == list(range(1, 9))


def test_sigkill_and_resume_continue_one_run(tmp_path):
    argv = [sys.executable, SCRIPT, *_script_args(tmp_path), "--kill-at", "5"]
    argv += ["--marker", str(tmp_path / "killed")]
    ((code, log, _),) = run_together([(argv, _env(2))], timeout=120)
    assert code == -9, log  # SIGKILL after step 5; the newest backup is step 4
    ((code, log, _),) = run_together([(argv, _env(2))], timeout=120)
    assert code == 0, log
    wandb_id, mlflow_id = log.split("RUN ")[1].split()

    # W&B: two offline directories (one per process lifetime) of the same run id, which
    # `wandb sync` uploads as one run; the second continues at step 5.
    first, second = offline_runs(tmp_path / "wb")
    assert first.run_id == second.run_id == wandb_id
    assert not first.resumed and second.resumed and second.exit_code == 0
    assert [s for s, _ in metric(first.history, "train/loss")] == [1, 2, 3, 4, 5]
    assert [s for s, _ in metric(second.history, "train/loss")] == [5, 6, 7, 8]
    assert first.config["model"] == "mlp-8-16-4"

    # MLflow: one run, FINISHED, steps 1..8 with step 5 logged by both attempts.
    client = mlflow_client((tmp_path / "mlruns").as_uri())
    run = only_run(client)
    assert run.info.run_id == mlflow_id and run.info.status == "FINISHED"
    loss = history(client, mlflow_id, "train/loss")
    assert [s for s, _ in loss] == [1, 2, 3, 4, 5, 5, 6, 7, 8]
    assert loss[4][1] == pytest.approx(loss[5][1])  # the same step 5, bit-exact resume


def test_missing_packages_raise_one_error_naming_the_extra():
    """Without wandb/mlflow (their sys.modules entries set to None: imports fail),
    distrain imports and trains as before, and making a logger names the extra."""
    code = """
import sys
sys.modules["wandb"] = None
sys.modules["mlflow"] = None
import distrain as dt
for make, extra in ((lambda: dt.callbacks.WandbLogger(project="p"), "wandb"),
                    (lambda: dt.callbacks.MLflowLogger("e"), "mlflow")):
    try:
        make()
    except ImportError as e:
        assert f"pip install 'distrain[{extra}]'" in str(e), e
    else:
        raise AssertionError("no ImportError")
print("OK")
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0 and out.stdout.strip() == "OK", out.stderr[-2000:]


def test_distrain_does_not_import_the_trackers():
    code = "import sys, distrain as dt; dt.callbacks.WandbLogger; print(sorted(m for m in "
    code += "('wandb', 'mlflow') if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:]


def test_bad_arguments():
    with pytest.raises(TypeError, match=r"config=\.\.\.\) must be a dict.*Received: list"):
        cb.MLflowLogger(config=[1, 2])
    with pytest.raises(TypeError, match="log_checkpoint=.*must be the ModelCheckpoint"):
        cb.WandbLogger(project="p", log_checkpoint="/tmp/ckpt")


def test_callback_state_is_saved_with_checkpoints_and_restored(strategy, tmp_path):
    """The generic side: any callback's state_dict travels with BackupAndRestore."""

    class Counter(cb.Callback):
        def __init__(self):
            self.seen, self.loaded = 0, None

        def on_train_batch_end(self, info):
            self.seen += 1

        def state_dict(self):
            return {"seen": self.seen}

        def load_state_dict(self, state):
            self.loaded = state

    backup = tmp_path / "backup"

    def crash(info):
        if info.step == 3:
            raise KeyboardInterrupt

    restore = cb.BackupAndRestore(backup, save_freq=2, async_save=False)
    with pytest.raises(KeyboardInterrupt):
        Trainer(strategy, train_step, log_every=1).fit(
            new_state(), pipeline(), epochs=1,
            callbacks=[Counter(), restore, cb.LambdaCallback(on_train_batch_end=crash)],
        )  # fmt: skip
    restored = dt.checkpoint.CheckpointManager(backup).restore(target=new_state())
    assert restored.metadata["progress"]["callbacks"] == {"Counter": {"seen": 2}}
    second = Counter()
    Trainer(strategy, train_step, log_every=1).fit(
        new_state(), pipeline(), epochs=1, callbacks=[restore, second]
    )
    assert second.loaded == {"seen": 2}


def test_distrain_train_config_sections_log_the_config_after_overrides(tmp_path, devices):
    from distrain.config import load_config, run_config

    root = Path(__file__).parent.parent
    uri = (tmp_path / "mlruns").as_uri()
    overrides = [
        "train.epochs=1", "train.steps=4", "train.log_every=2", "logging.progress_bar=false",
        f"logging.wandb={{project: cli, mode: offline, dir: {tmp_path / 'wb'}, tags: [x]}}",
        f"logging.mlflow={{experiment: cli, tracking_uri: '{uri}'}}",
        f"checkpoint.dir={tmp_path / 'ckpt'}", "logging.mlflow.log_checkpoint=true",
    ]  # fmt: skip
    cfg = load_config(root / "configs" / "quickstart.yaml", overrides)
    run_config(cfg, print_fn=None)

    (run,) = wandb_runs(tmp_path / "wb")
    assert run.config["train"]["steps"] == 4 and run.config["name"] == "quickstart"
    assert run.config["logging"]["wandb"]["project"] == "cli"
    assert [s for s, _ in metric(run.history, "train/loss")] == [2, 4]
    client = mlflow_client(uri)
    mrun = only_run(client)
    assert mrun.info.run_name == "quickstart" and mrun.data.params["train.steps"] == "4"
    assert [s for s, _ in history(client, mrun.info.run_id, "train/loss")] == [2, 4]
    assert client.list_artifacts(mrun.info.run_id, "checkpoints/step-4")

    bad = load_config(root / "configs" / "quickstart.yaml", [*overrides[:-2]])
    bad.logging.wandb.log_checkpoint = True
    with pytest.raises(ValueError, match=r"logging\.wandb\.log_checkpoint .* checkpoint\.dir"):
        run_config(bad, print_fn=None)


def test_the_documented_config_sections_run_as_printed(tmp_path, devices, monkeypatch):
    """docs/tracking.md's `distrain train` YAML, verbatim: MLflow's local sqlite store
    (the `mlflow` extra brings SQLAlchemy and Alembic for it), W&B offline, a backup."""
    import re

    import yaml

    from distrain.config import load_config, run_config

    root = Path(__file__).parent.parent
    doc = (root / "docs" / "tracking.md").read_text()
    section = doc[doc.index("## From `distrain train`") :]
    block = yaml.safe_load(re.search(r"```yaml\n(.*?)```", section, re.S).group(1))
    monkeypatch.chdir(tmp_path)  # the doc's relative paths: mlflow.db, backups/mnist
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    overrides = [f"{k}={json.dumps(v)}" for k, v in block.items()]
    overrides += ["train.epochs=1", "train.steps=2", "logging.progress_bar=false"]
    run_config(load_config(root / "configs" / "quickstart.yaml", overrides), print_fn=None)
    mrun = only_run(mlflow_client("sqlite:///mlflow.db"))
    assert mrun.info.run_name == "quickstart" and mrun.data.metrics
    assert (tmp_path / "mlflow.db").exists()


def test_a_store_mlflow_cannot_open_is_one_line(strategy, tmp_path):
    logger = cb.MLflowLogger(tracking_uri="nosuchscheme://store")
    trainer = Trainer(strategy, train_step, log_every=1, callbacks=[logger])
    with pytest.raises(ValueError) as e:
        trainer.fit(new_state(), pipeline(), epochs=1)
    message = str(e.value)
    assert "\n" not in message
    assert "cannot open the tracking store 'nosuchscheme://store'" in message
    assert "pip install 'distrain[mlflow]'" in message


def test_tracking_doc_runs(devices, capsys, tmp_path):
    from tests.test_trainer_docs import run_blocks

    ns = run_blocks("tracking.md")
    out = capsys.readouterr().out
    assert "crashed after step 5" in out and "FINISHED" in out
    assert [m.step for m in ns["history"]] == [1, 2, 3, 4, 5, 5, 6, 7, 8]
    (run,) = wandb_runs(os.path.join(ns["workdir"], "wandb"))
    assert run.run_id == ns["wandb_logger"].run_id and run.config["learning_rate"] == 0.05
    assert [s for s, _ in metric(run.history, "train/loss")] == [2, 4, 6, 8, 10, 12, 14, 16]
    print(out)


def test_mlflow_run_to_continue_must_exist(strategy, tmp_path):
    uri = (tmp_path / "mlruns").as_uri()
    logger = cb.MLflowLogger(tracking_uri=uri, run_id="0123456789abcdef0123456789abcdef")
    trainer = Trainer(strategy, train_step, log_every=1, callbacks=[logger])
    with pytest.raises(ValueError, match=r"continue MLflow run '0123456789abcdef.*has no such run"):
        trainer.fit(new_state(), pipeline(), epochs=1)
