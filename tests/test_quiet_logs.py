"""Quiet by default: orbax's and MLflow's INFO logs only with DISTRAIN_VERBOSE / --verbose.

The real libraries: orbax writes checkpoints to tmp_path, MLflow a SQLite store there
(no network). In-process tests read the records the loggers let through; the CLI test
reads a real `distrain train` process's stderr.
"""

import logging
import os
import signal
import subprocess
import sys

import pytest

import distrain as dt
from distrain import callbacks as cb
from distrain._src import verbosity
from distrain.checkpoint import CheckpointManager
from tests.linear_problem import new_state, problem, train_step
from tests.processes import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.yaml")
MLFLOW_ENV = {"MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "1"}
TABLES = "Creating initial MLflow database tables"


def orbax_info(records):
    return [
        r for r in records if r.levelno < logging.WARNING and f"{os.sep}orbax{os.sep}" in r.pathname
    ]


@pytest.mark.parametrize("verbose", [False, True], ids=["default", "verbose"])
def test_orbax_saves_log_info_only_when_verbose(tmp_path, caplog, monkeypatch, verbose):
    # Where the root logger is at INFO (a Ray worker, logging.basicConfig(level=INFO))
    # orbax logged every save: its handlers, the metadata dict, bytes per second.
    monkeypatch.setenv(verbosity.ENV, "1" if verbose else "0")
    caplog.set_level(logging.INFO)
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(1, new_state())
        mgr.wait_until_finished()
        assert mgr.restore(target=new_state()).step == 1
    seen = orbax_info(caplog.records)
    if verbose:
        assert any("Saving checkpoint at step 1" in r.getMessage() for r in seen), seen[:3]
    else:
        assert seen == []


def test_orbax_warnings_and_other_absl_users_pass(caplog, monkeypatch):
    monkeypatch.delenv(verbosity.ENV, raising=False)
    verbosity.quiet_orbax()
    from absl import logging as absl_logging

    caplog.set_level(logging.INFO)
    absl_logging.info("a user's own absl line")  # this file is not orbax's
    assert [r.getMessage() for r in caplog.records] == ["a user's own absl line"]


class Records(logging.Handler):
    """Keeps the records that reach it."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.mark.parametrize("verbose", [False, True], ids=["default", "verbose"])
@pytest.mark.split_ends  # a slow test: see tests/conftest.py
def test_mlflow_store_creation_is_quiet_unless_verbose(devices, tmp_path, monkeypatch, verbose):
    for k, v in MLFLOW_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv(verbosity.ENV, "1" if verbose else "0")
    monkeypatch.chdir(tmp_path)  # MLflow's default artifact root is ./mlruns
    import mlflow  # noqa: F401  (configures its loggers: its own INFO handler)

    handler = Records()
    mlflow_logger = logging.getLogger("mlflow")  # MLflow's records stop there
    mlflow_logger.addHandler(handler)
    try:
        logger = cb.MLflowLogger("exp", tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
        data = dt.data.ArrayPipeline(problem(64), global_batch_size=32, seed=0)
        dt.Trainer(dt.MirroredStrategy(), train_step).fit(
            new_state(), data, epochs=1, callbacks=[logger]
        )
    finally:
        mlflow_logger.removeHandler(handler)
    lines = [r.getMessage() for r in handler.records]
    assert any(TABLES in m for m in lines) == verbose, lines


def run_cli(tmp_path, *extra):
    """`distrain train` on the quickstart for one epoch with a checkpoint directory and
    an MLflow SQLite store: (exit status, stderr)."""
    env = {
        **os.environ,
        **MLFLOW_ENV,
        "XLA_FLAGS": xla_flags(2),
        "PYTHONPATH": ROOT,
    }
    env.pop(verbosity.ENV, None)
    run = tmp_path / ("verbose" if extra else "quiet")
    cmd = [
        sys.executable,
        "-m",
        "distrain.cli",
        "train",
        "--config",
        QUICKSTART,
        "--no-progress",
        "train.epochs=1",
        f"checkpoint.dir={run / 'ckpt'}",
        f"logging.mlflow={{tracking_uri: 'sqlite:///{run / 'mlflow.db'}'}}",
        *extra,
    ]
    run.mkdir()
    proc = subprocess.Popen(
        cmd,
        cwd=run,  # MLflow's default artifact root, ./mlruns, stays in tmp_path
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, err


@pytest.mark.one_end("lowest")  # a slow test: see tests/conftest.py
def test_distrain_train_verbose_lets_the_libraries_info_logs_through(tmp_path):
    code, err = run_cli(tmp_path)
    assert code == 0, err[-3000:]
    assert TABLES not in err and "orbax" not in err.lower(), err[-3000:]

    code, err = run_cli(tmp_path, "--verbose")
    assert code == 0, err[-3000:]
    assert TABLES in err, err[-3000:]
    assert "Saving checkpoint at step" in err, err[-3000:]  # orbax, through absl


ALL_REDUCE = """
import jax.numpy as jnp
import distrain as dt

strategy = dt.MultiWorkerMirroredStrategy()
ones = strategy.run(lambda: dt.get_replica_context().all_reduce("sum", jnp.ones(())))
print("sum", float(strategy.reduce("mean", ones, axis=None)), flush=True)
"""


@pytest.mark.parametrize("verbose", [False, True], ids=["default", "verbose"])
@pytest.mark.split_ends  # a slow test: see tests/conftest.py
def test_launch_drops_gloo_connection_lines_unless_verbose(capfd, monkeypatch, verbose):
    # gloo prints "[Gloo] Rank i is connected to n peer ranks..." from C++ to stdout in
    # every process, for every communicator, with no switch: the launcher drops it.
    from distrain._src.cluster import launch

    monkeypatch.setenv(verbosity.ENV, "1" if verbose else "0")
    argv = ["--nproc", "2", "--devices-per-proc", "1", "--", sys.executable, "-c", ALL_REDUCE]
    assert launch.main(argv) == 0
    out = capfd.readouterr().out
    assert sorted(line for line in out.splitlines() if "sum" in line) == [
        "[0] sum 2.0",
        "[1] sum 2.0",
    ]
    gloo = [line for line in out.splitlines() if "[Gloo]" in line]
    if verbose:
        assert len(gloo) >= 2 and all("connected to 1 peer ranks" in line for line in gloo), out
    else:
        assert gloo == [], out


def test_a_gloo_line_with_missing_peers_is_kept(monkeypatch):
    from distrain._src.cluster.processes import is_noise

    monkeypatch.delenv(verbosity.ENV, raising=False)
    line = "[Gloo] Rank 1 is connected to {} peer ranks. " + (
        "Expected number of connected peer ranks is : 3"
    )
    assert is_noise(line.format(3).encode())
    assert not is_noise(line.format(2).encode())  # a peer missing: kept
    assert not is_noise(b"[Gloo] Rank 1 is NOT connected to: [2]")
