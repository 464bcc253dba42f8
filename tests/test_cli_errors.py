"""`distrain train`, as a real process: every user error is one `distrain train: error:`
line on stderr (exit 2) that says what to do; a traceback only with --debug or
DISTRAIN_DEBUG=1."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from distrain._src.cluster.launch import free_port
from tests.processes import xla_flags

pytestmark = pytest.mark.one_end("newest")  # see tests/conftest.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")


def _run(args, tmp_path, devices=8, timeout=180, **extra):
    env = {
        **os.environ,
        "XLA_FLAGS": xla_flags(devices),
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": ROOT,  # the shipped configs name examples.classification
        **extra,
    }
    if "DISTRAIN_DEBUG" not in extra:
        env.pop("DISTRAIN_DEBUG", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "distrain.cli", "train", *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, out, err


def _one_error_line(err):
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith("distrain train: error: "), lines[0]
    assert "Traceback" not in err
    return lines[0]


def _offline_env(tmp_path):
    # A port nothing listens on: the download fails at once, as on an offline machine.
    return {
        "DISTRAIN_DATA_DIR": str(tmp_path / "data"),
        "DISTRAIN_MNIST_URL": f"http://127.0.0.1:{free_port()}/mnist/",
    }


@pytest.mark.parametrize("config", ["mnist_mlp.yaml", "mnist_cnn.yaml"])
def test_mnist_config_offline_is_one_line_saying_where_to_put_the_files(tmp_path, config):
    rc, _, err = _run(
        ["--config", os.path.join(CONFIGS, config), "--no-progress"],
        tmp_path,
        **_offline_env(tmp_path),
    )
    line = _one_error_line(err)
    assert rc == 2
    cache = os.path.join(str(tmp_path / "data"), "mnist")
    assert f"into {cache}/" in line
    assert "train-images-idx3-ubyte.gz" in line and "t10k-labels-idx1-ubyte.gz" in line
    assert "DISTRAIN_MNIST_URL" in line and "configs/quickstart.yaml" in line
    # The runner knows no dataset: the loader's error is reported as a config error,
    # with the keyword arguments a config can set (the example's mnist takes no base_url).
    assert "Config field 'data.fn' (examples.classification:mnist) could not load" in line
    assert "set as data.kwargs.cache_dir, data.kwargs.num_validation;" in line


def test_batch_not_divisible_by_replicas_is_one_line(tmp_path):
    rc, _, err = _run(
        [
            "--config",
            os.path.join(CONFIGS, "quickstart.yaml"),
            "--no-progress",
            "data.global_batch_size=60",
        ],
        tmp_path,
    )
    line = _one_error_line(err)
    assert rc == 2
    assert "data.global_batch_size (60)" in line and "number of replicas (8)" in line
    assert "56 or 64" in line


def test_eval_batch_not_divisible_by_replicas_is_one_line(tmp_path):
    rc, _, err = _run(
        [
            "--config",
            os.path.join(CONFIGS, "quickstart.yaml"),
            "--no-progress",
            "data.eval_batch_size=100",
        ],
        tmp_path,
    )
    line = _one_error_line(err)
    assert rc == 2 and "data.eval_batch_size (100)" in line and "96 or 104" in line


def _failing_step_config(tmp_path):
    (tmp_path / "failing_task.py").write_text(
        textwrap.dedent("""
        def step(state, batch, *, apply_fn):
            raise RuntimeError("boom from the user's train_step\\nsecond line")
    """)
    )
    cfg = tmp_path / "fail.yaml"
    cfg.write_text(
        textwrap.dedent("""
        name: fail
        model: {fn: "examples.classification:mlp", kwargs: {input_shape: [8, 8, 1]}}
        data: {fn: "examples.classification:digits"}
        train: {train_step: "failing_task:step", epochs: 1}
        logging: {progress_bar: false}
    """)
    )
    return str(cfg)


def test_unexpected_error_is_one_line_with_the_debug_hint(tmp_path):
    rc, _, err = _run(["--config", _failing_step_config(tmp_path)], tmp_path)
    line = _one_error_line(err)
    assert rc == 1
    assert "RuntimeError: boom from the user's train_step second line" in line
    assert "--debug" in line and "DISTRAIN_DEBUG=1" in line


@pytest.mark.parametrize("how", ["flag", "env"])
def test_debug_shows_the_traceback(tmp_path, how):
    args = ["--config", _failing_step_config(tmp_path)]
    env = {}
    if how == "flag":
        args.append("--debug")
    else:
        env["DISTRAIN_DEBUG"] = "1"
    rc, _, err = _run(args, tmp_path, **env)
    assert rc == 1
    assert "Traceback (most recent call last)" in err and "boom from the user's" in err
