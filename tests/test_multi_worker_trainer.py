"""The Trainer under MultiWorkerMirroredStrategy: same result as one process, chief-only output.

2 processes x 2 devices run `Trainer.fit` with a progress bar, a CSV log and
TensorBoard; only process 0 may print or write them, and both processes must end
with the parameters of 1 process x 4 devices.
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.processes import xla_flags

SCRIPT = str(Path(__file__).parent / "scripts" / "mw_trainer.py")


def env_for(devices: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTRAIN_")}
    env.pop("TF_CONFIG", None)
    env.update(XLA_FLAGS=xla_flags(devices), JAX_PLATFORMS="cpu")
    return env


def run(argv: list[str], env: dict[str, str], timeout: float = 120) -> str:
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # a launcher stops its own processes
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    log = out.decode(errors="replace")
    assert proc.returncode == 0, log
    return log


@pytest.mark.one_end("newest")  # a slow test: see tests/conftest.py
def test_trainer_on_two_processes_matches_one_and_only_the_chief_logs(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    run([sys.executable, SCRIPT, "--out", str(one)], env_for(4))
    launch = [sys.executable, "-m", "distrain._src.cluster.launch", "--nproc", "2"]
    launch += ["--devices-per-proc", "2", "--timeout", "30", "--"]
    log = run([*launch, sys.executable, SCRIPT, "--out", str(two)], env_for(8))

    # Only the chief drew the progress bar and wrote the CSV log and event files.
    progress = [line for line in log.splitlines() if "epoch 2/2" in line]
    assert progress and all(line.startswith("[0] ") for line in progress)
    assert (two / "log_0.csv").is_file() and not (two / "log_1.csv").exists()
    assert any((two / "tb_0").iterdir())
    assert not (two / "tb_1").exists() or not any((two / "tb_1").iterdir())

    ref = np.load(one / "result_0.npz")
    for pid in (0, 1):
        got = np.load(two / f"result_{pid}.npz")
        assert bool(got["chief"]) == (pid == 0)
        for name in ("w1", "b1", "w2", "b2"):
            np.testing.assert_allclose(got[name], ref[name], rtol=1e-5, atol=1e-6)
