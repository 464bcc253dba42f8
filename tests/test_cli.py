"""The `distrain` command: help everywhere, config errors, the quickstart end to end."""

import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

from distrain.cli import main
from tests.processes import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.yaml")


@pytest.mark.parametrize(
    "argv,expect",
    [
        (["--help"], ["train", "launch"]),
        (["train", "--help"], ["--config", "key=value", "train.epochs=5"]),
        (["launch", "--help"], ["distrain launch"]),
    ],
)
def test_help_everywhere(argv, expect, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    out = capsys.readouterr().out
    for word in expect:
        assert word in out


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def test_train_needs_config(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train"])
    assert e.value.code == 2
    assert "--config" in capsys.readouterr().err


def test_bad_config_is_a_clean_error(tmp_path, capsys):
    assert main(["train", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["train", "--config", QUICKSTART, "train.epoch=1"]) == 2
    assert "Did you mean 'train.epochs'?" in capsys.readouterr().err


def test_print_config_applies_overrides(capsys):
    assert main(["train", "--config", QUICKSTART, "--print-config", "train.epochs=7"]) == 0
    out = capsys.readouterr().out
    assert "epochs: 7" in out and "fn: examples.classification:mlp" in out


def test_config_names_user_code_by_import_path(tmp_path, monkeypatch, capsys, devices):
    pkg = tmp_path / "mylab"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "task.py").write_text(
        textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np
        from distrain._src.train.metrics import Mean

        def linear(*, key, dim):
            params = {"w": jnp.zeros((dim,)), "b": jnp.zeros(())}
            return (lambda p, x: x @ p["w"] + p["b"]), params

        def regression(*, n, dim):
            rng = np.random.default_rng(0)
            x = rng.normal(size=(n, dim)).astype(np.float32)
            y = (x @ np.arange(dim, dtype=np.float32) + 1.0).astype(np.float32)
            return {"train": {"x": x, "y": y}, "test": {"x": x[:40], "y": y[:40]}}

        def mse_step(state, batch, *, apply_fn):
            import distrain as dt
            def loss_fn(p):
                err = (apply_fn(p, batch["x"]) - batch["y"]) ** 2
                return dt.compute_average_loss(err), err
            grads, err = jax.grad(loss_fn, has_aux=True)(state.params)
            return state.apply_gradients(grads=grads), {"mse": Mean.from_values(err)}

        def mse_eval(state, batch, *, apply_fn):
            import distrain as dt
            err = (apply_fn(state.params, batch["x"]) - batch["y"]) ** 2
            return {"mse": Mean.from_values(err, mask=batch["mask"])}
    """)
    )
    cfg = tmp_path / "lab.yaml"
    cfg.write_text(
        textwrap.dedent("""
        name: lab
        model: {fn: "mylab.task:linear", kwargs: {dim: 3}}
        data: {fn: "mylab.task:regression", kwargs: {n: 256, dim: 3}, global_batch_size: 32}
        optimizer: {name: sgd, learning_rate: 0.1}
        train: {train_step: "mylab.task:mse_step", eval_step: "mylab.task:mse_eval",
                epochs: 5}
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["train", "--config", str(cfg), "--no-progress", "data.kwargs.size=3"]) == 2
    assert "cannot be called with" in capsys.readouterr().err
    assert main(["train", "--config", str(cfg), "--no-progress"]) == 0
    out = capsys.readouterr().out
    mse = float(next(ln for ln in out.splitlines() if ln.startswith("final test")).split("=")[-1])
    assert mse < 1e-3


def _distrain_command() -> list[str]:
    script = os.path.join(os.path.dirname(sys.executable), "distrain")
    if os.path.exists(script) or shutil.which("distrain"):
        return [script if os.path.exists(script) else "distrain"]
    return [sys.executable, "-m", "distrain.cli"]


@pytest.mark.one_end("lowest")  # a slow test: see tests/conftest.py
def test_console_script_runs_the_quickstart(tmp_path):
    """The installed `distrain` entry point, as a real process, prints the accuracy; import
    paths in the config resolve from the working directory (as with `python -m`) and from
    PYTHONPATH (here the checkout, for the example the quickstart names)."""
    env = {
        **os.environ,
        "XLA_FLAGS": xla_flags(2),
        "PYTHONPATH": ROOT,
    }
    (tmp_path / "mydigits.py").write_text("from examples.classification import digits as splits\n")
    cmd = [
        *_distrain_command(),
        "train",
        "--config",
        QUICKSTART,
        "--no-progress",
        "train.epochs=1",
        "data.fn=mydigits:splits",  # a module in the working directory only
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    assert "num_replicas_in_sync=2" in out
    assert "test accuracy:" in out
