"""Start-up and failure behaviour of multi-process jobs, with real processes on 127.0.0.1.

An unreachable coordinator, a missing peer, different device counts and a peer
that dies mid-run must all end every process with a clear error within the
configured timeout, never a hang.
"""

import os
import signal
import sys
from pathlib import Path

import pytest

from distrain.cluster.launch import free_port
from tests.processes import run_together

SCRIPTS = Path(__file__).parent / "scripts"
TRAIN = str(SCRIPTS / "mw_train.py")
PROBE = str(SCRIPTS / "mw_probe.py")


def env_for(port, nproc, pid, devices=1, timeout_s=3):
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DISTRAIN_", "SLURM_", "OMPI_", "PMIX_")) and k != "TF_CONFIG"
    }
    env.update(
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        JAX_PLATFORMS="cpu",
        PYTHONUNBUFFERED="1",
        DISTRAIN_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
        DISTRAIN_NUM_PROCESSES=str(nproc),
        DISTRAIN_PROCESS_ID=str(pid),
        DISTRAIN_TIMEOUT_SECONDS=str(timeout_s),
    )
    return env


def test_unreachable_coordinator_names_the_address():
    port = free_port()  # nobody listens there: process 0 never starts
    [(code, log, seconds)] = run_together(
        [([sys.executable, PROBE], env_for(port, 2, 1))], timeout=60
    )
    assert code != 0
    assert f"TimeoutError: Could not reach the coordinator at 127.0.0.1:{port} within 3 s" in log
    assert seconds < 40


def test_missing_peer_ends_the_coordinator_with_a_clear_error():
    port = free_port()  # process 1 never starts
    [(code, log, seconds)] = run_together(
        [([sys.executable, PROBE], env_for(port, 2, 0))], timeout=60
    )
    assert code == 3, log
    assert f"not all 2 processes joined the cluster at 127.0.0.1:{port} within 3 s" in log
    assert seconds < 40


def test_processes_with_different_device_counts_fail_clearly():
    port = free_port()
    jobs = [
        ([sys.executable, PROBE], env_for(port, 2, 0, devices=2, timeout_s=20)),
        ([sys.executable, PROBE], env_for(port, 2, 1, devices=3, timeout_s=20)),
    ]
    for code, log, _ in run_together(jobs, timeout=60):
        assert code != 0
        assert "same number of local devices" in log and "process 0: 2, process 1: 3" in log


@pytest.mark.parametrize("dying", [1, 0], ids=["worker-dies", "coordinator-dies"])
def test_survivor_of_a_dead_peer_exits_within_the_timeout(tmp_path, dying):
    port = free_port()
    argv = [sys.executable, TRAIN, "--out", str(tmp_path), "--steps", "100000"]
    argv += ["--die-at", "3", "--kill-process", str(dying)]
    results = run_together([(argv, env_for(port, 2, pid)) for pid in (0, 1)], timeout=60)
    dead_code, _, _ = results[dying]
    survivor_code, survivor_log, seconds = results[1 - dying]
    assert dead_code == -signal.SIGKILL
    # JAX's coordination service notices the missing heartbeats (3 s here) and ends
    # the survivor with an error that says a task died.
    assert survivor_code != 0, survivor_log
    assert "another task died" in survivor_log or "heartbeat" in survivor_log, survivor_log
    assert seconds < 45


def test_processes_that_disagree_on_the_number_of_processes_fail_clearly():
    # Process 1 thinks the job has 3 processes: it still joins process 0's 2-process
    # cluster (ids 0 and 1 are valid there), so JAX alone lets both run.
    port = free_port()
    jobs = [
        ([sys.executable, PROBE], env_for(port, 2, 0, timeout_s=20)),
        ([sys.executable, PROBE], env_for(port, 3, 1, timeout_s=20)),
    ]
    for code, log, seconds in run_together(jobs, timeout=60):
        assert code != 0, log
        assert "OK " not in log
        assert "processes disagree on the number of processes" in log, log
        assert "process 0 expects 2, process 1 expects 3" in log, log
        assert seconds < 40
