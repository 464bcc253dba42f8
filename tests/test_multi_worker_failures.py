"""Start-up and failure behaviour of multi-process jobs, with real processes on 127.0.0.1.

An unreachable coordinator, a missing peer, different device counts and a peer
that dies mid-run must all end every process with a clear error within the
configured timeout, never a hang.
"""

import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from distrain._src.cluster.launch import free_port
from tests.processes import run_together, xla_flags

SCRIPTS = Path(__file__).parent / "scripts"
TRAIN = str(SCRIPTS / "mw_train.py")
PROBE = str(SCRIPTS / "mw_probe.py")
FAULT = str(SCRIPTS / "mw_fault.py")


def env_for(port, nproc, pid, devices=1, timeout_s=3):
    """The variables of process ``pid``; ``timeout_s=None`` keeps distrain's default timeouts."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DISTRAIN_", "SLURM_", "OMPI_", "PMIX_")) and k != "TF_CONFIG"
    }
    env.update(
        XLA_FLAGS=xla_flags(devices),
        JAX_PLATFORMS="cpu",
        PYTHONUNBUFFERED="1",
        DISTRAIN_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
        DISTRAIN_NUM_PROCESSES=str(nproc),
        DISTRAIN_PROCESS_ID=str(pid),
    )
    if timeout_s is not None:
        env["DISTRAIN_TIMEOUT_SECONDS"] = str(timeout_s)
    return env


def fault_time(log: str) -> float:
    """The wall-clock time mw_fault.py printed just before failing."""
    match = re.search(r"^fault (\d+\.\d+)$", log, re.M)
    assert match, log
    return float(match.group(1))


@pytest.mark.one_end("newest")  # a slow test: see tests/conftest.py
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
@pytest.mark.split_ends  # a slow test: see tests/conftest.py
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


@pytest.mark.parametrize("failing", [1, 0], ids=["worker-raises", "coordinator-raises"])
@pytest.mark.split_ends  # a slow test: see tests/conftest.py
def test_an_uncaught_error_ends_every_process_within_seconds_by_default(failing):
    # Default timeouts (no DISTRAIN_TIMEOUT_SECONDS). Before distrain's fail-fast exit both
    # processes stayed in JAX's shutdown barrier until its 300 s timeout.
    port = free_port()
    argv = [sys.executable, FAULT, "--fault", "raise", "--fault-process", str(failing)]
    started = time.time()
    results = run_together([(argv, env_for(port, 2, pid, timeout_s=None)) for pid in (0, 1)], 90)
    fault = fault_time(results[failing][1])
    for pid, (code, log, seconds) in enumerate(results):
        assert code != 0, log
        if pid == failing:
            assert code == 1
            assert "exiting now with status 1 instead of waiting in JAX's shutdown barrier" in log
        assert started + seconds - fault < 15, (pid, started + seconds - fault, log)
    assert f"RuntimeError: injected failure in process {failing}" in results[failing][1]
    peer_log = results[1 - failing][1]
    # The peer's collective fails; or, when process 0 (the coordination service) is gone,
    # JAX may end the peer first (SIGABRT).
    assert "Gloo all-reduce failed" in peer_log or "JAX distributed service" in peer_log


@pytest.mark.one_end("newest")  # a slow test: see tests/conftest.py
def test_a_finished_process_waiting_for_a_dead_peer_exits_within_the_heartbeat_timeout():
    # Process 0 finishes after step 3 and waits in JAX's shutdown barrier for process 1,
    # which is SIGKILLed there: no collective notices, only the missing heartbeats do
    # (distrain's default heartbeat timeout: 20 s; JAX's own is 100 s).
    port = free_port()
    argv = [sys.executable, FAULT, "--fault", "kill", "--fault-process", "1", "--finish-early"]
    started = time.time()
    results = run_together([(argv, env_for(port, 2, pid, timeout_s=None)) for pid in (0, 1)], 90)
    (code, log, seconds), (dead_code, dead_log, _) = results
    assert dead_code == -signal.SIGKILL
    assert code != 0 and "done" in log, log
    assert "stopped sending heartbeats" in log or "another task died" in log, log
    assert 10 < started + seconds - fault_time(dead_log) < 35, log


def test_a_process_failing_its_own_checks_stops_every_process():
    # Process 1 asks for NCCL on a CPU-only machine (found only once its devices exist:
    # JAX_PLATFORMS is unset); process 0 is fine. Alone, process 0 would go on and wait
    # in its first collective for process 1.
    port = free_port()
    bad = env_for(port, 2, 1, timeout_s=20)
    bad["DISTRAIN_COLLECTIVES"] = "nccl"
    del bad["JAX_PLATFORMS"]
    bad["CUDA_VISIBLE_DEVICES"] = ""  # CPU-only on a GPU machine too (NCCL would be valid)
    jobs = [
        ([sys.executable, PROBE], env_for(port, 2, 0, timeout_s=20)),
        ([sys.executable, PROBE], bad),
    ]
    (code0, log0, _), (code1, log1, seconds) = run_together(jobs, timeout=60)
    assert code0 != 0 and code1 != 0 and "OK " not in log0 + log1
    assert "ValueError: CommunicationOptions(implementation='nccl') needs GPU" in log1, log1
    message = "RuntimeError: Process 1 failed its start-up checks, so process 0 stops too: "
    assert message + "CommunicationOptions(implementation='nccl') needs GPU" in log0, log0
    assert seconds < 40
