"""MultiWorkerMirroredStrategy with real processes on 127.0.0.1.

2 processes x 2 virtual CPU devices must train exactly like 1 process x 4 devices
(same losses, same parameters), with global batches split by
experimental_distribute_dataset and with per-process pipelines from
distribute_datasets_from_function. TF_CONFIG clusters start too.
"""

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from distrain._src.cluster.launch import free_port
from tests.processes import run_together, xla_flags

SCRIPTS = Path(__file__).parent / "scripts"
TRAIN = str(SCRIPTS / "mw_train.py")
PROBE = str(SCRIPTS / "mw_probe.py")
TIMEOUT = 90  # seconds for one group of processes; the machine is shared and slow


def clean_env(devices: int, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DISTRAIN_", "SLURM_", "OMPI_", "PMIX_")) and k != "TF_CONFIG"
    }
    env["XLA_FLAGS"] = xla_flags(devices)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def cluster(script_args, nproc, devices, timeout_s=20, **extra):
    port = free_port()
    jobs = []
    for i in range(nproc):
        env = clean_env(
            devices,
            DISTRAIN_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
            DISTRAIN_NUM_PROCESSES=str(nproc),
            DISTRAIN_PROCESS_ID=str(i),
            DISTRAIN_TIMEOUT_SECONDS=str(timeout_s),
            **extra,
        )
        jobs.append(([sys.executable, *script_args], env))
    return run_together(jobs, TIMEOUT)


def load(out_dir, pid=0):
    with np.load(Path(out_dir) / f"result_{pid}.npz") as f:
        return {k: f[k] for k in f.files}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process x 4 devices, no cluster variables at all."""
    out = tmp_path_factory.mktemp("ref")
    [(code, log, _)] = run_together(
        [([sys.executable, TRAIN, "--out", str(out)], clean_env(4))], TIMEOUT
    )
    assert code == 0, log
    ref = load(out)
    assert (int(ref["nproc"]), int(ref["replicas"])) == (1, 4)
    return ref


@pytest.mark.parametrize("input_mode", ["global", "local"])
@pytest.mark.split_ends  # a slow test: see tests/conftest.py
def test_two_processes_match_one_process(tmp_path, reference, input_mode):
    results = cluster([TRAIN, "--out", str(tmp_path), "--input", input_mode], nproc=2, devices=2)
    for code, log, _ in results:
        assert code == 0, log
    # Only the chief prints progress.
    assert "step 4 loss" in results[0][1] and "step 4 loss" not in results[1][1]
    for pid in (0, 1):
        got = load(tmp_path, pid)
        assert (int(got["nproc"]), int(got["replicas"])) == (2, 4)
        assert len(got["losses"]) == 4
        np.testing.assert_allclose(got["losses"], reference["losses"], rtol=1e-6, atol=1e-7)
        for name in ("w1", "b1", "w2", "b2"):
            np.testing.assert_allclose(got[name], reference[name], rtol=1e-5, atol=1e-6)
    # The parameters really moved: the comparison is not between two initial states.
    assert reference["losses"][0] != reference["losses"][-1]


def test_tf_config_cluster_starts_with_chief_and_worker():
    port1, port2 = free_port(), free_port()
    spec = {"chief": [f"127.0.0.1:{port1}"], "worker": [f"127.0.0.1:{port2}"]}
    jobs = []
    for task_type in ("chief", "worker"):
        config = json.dumps({"cluster": spec, "task": {"type": task_type, "index": 0}})
        jobs.append(
            ([sys.executable, PROBE], clean_env(2, TF_CONFIG=config, DISTRAIN_TIMEOUT_SECONDS="20"))
        )
    results = run_together(jobs, TIMEOUT)
    seen = []
    for code, log, _ in results:
        assert code == 0, log
        seen.append(json.loads(log.split("OK ", 1)[1].splitlines()[0]))
    assert [s["task_type"] for s in seen] == ["chief", "worker"]
    assert [s["process_id"] for s in seen] == [0, 1]
    assert [s["is_chief"] for s in seen] == [True, False]
    assert {s["replicas"] for s in seen} == {4}
    assert {s["resolver"] for s in seen} == {"TFConfigClusterResolver"}


def test_slurm_variables_are_detected_through_jax():
    # What `srun --ntasks 2` sets, on one node; JAX derives the coordinator from them.
    port = free_port()
    jobs = []
    for i in range(2):
        slurm = {
            "SLURM_JOB_ID": "4242",
            "SLURM_STEP_NODELIST": "localhost",
            "SLURM_NTASKS": "2",
            "SLURM_PROCID": str(i),
            "SLURM_LOCALID": str(i),
            "JAX_COORDINATOR_PORT": str(port),
            "DISTRAIN_TIMEOUT_SECONDS": "20",
        }
        jobs.append(([sys.executable, PROBE], clean_env(2, **slurm)))
    seen = []
    for code, log, _ in run_together(jobs, TIMEOUT):
        assert code == 0, log
        seen.append(json.loads(log.split("OK ", 1)[1].splitlines()[0]))
    assert [(s["process_id"], s["is_chief"]) for s in seen] == [(0, True), (1, False)]
    assert {(s["num_processes"], s["replicas"], s["resolver"]) for s in seen} == {
        (2, 4, "AutoClusterResolver")
    }
