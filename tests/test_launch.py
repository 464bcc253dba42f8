"""`distrain launch`: environment, output prefixes, stopping, restarting, exit codes.

The quick tests launch small Python programs (no JAX). The slow ones train with
MultiWorkerMirroredStrategy: one SIGKILLs a worker mid-run, another SIGTERMs one (a
preemption: both save and exit 143, restarted without using a restart), and both check
that the restarted job resumes from its dt.checkpoint.CheckpointManager checkpoint and
ends with the parameters of an uninterrupted run; one checks on which address process
0's coordinator service listens.
"""

import importlib.util
import ipaddress
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import distrain as dt
from distrain._src.cluster import launch
from distrain._src.cluster.supervisor import Supervisor

pytestmark = pytest.mark.one_end("newest")  # see tests/conftest.py

PY = sys.executable
TRAIN = str(Path(__file__).parent / "scripts" / "mw_train.py")
FAULT = str(Path(__file__).parent / "scripts" / "mw_fault.py")


def py(code: str) -> list[str]:
    return ["--", PY, "-c", code]


def test_processes_get_cluster_variables_and_prefixed_output(capfd, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_other=1")
    code = (
        "import os; e = os.environ; print(e['DISTRAIN_PROCESS_ID'], e['DISTRAIN_NUM_PROCESSES'], "
        "e['DISTRAIN_COORDINATOR_ADDRESS'], e['DISTRAIN_LOCAL_DEVICES'], "
        "e['DISTRAIN_RESTART_COUNT'], e['DISTRAIN_TIMEOUT_SECONDS'], e['XLA_FLAGS'])"
    )
    argv = ["--nproc", "3", "--devices-per-proc", "2", "--timeout", "7", "--port", "29876"]
    assert launch.main(argv + py(code)) == 0
    out = capfd.readouterr()
    lines = sorted(line for line in out.out.splitlines() if line.startswith("["))
    flags = "--xla_other=1 --xla_force_host_platform_device_count=2"
    assert lines == [f"[{i}] {i} 3 127.0.0.1:29876 2 0 7 {flags}" for i in range(3)]
    assert "[launch] all processes finished" in out.err


def test_carriage_returns_and_unterminated_lines_keep_the_prefix(capfd):
    code = "import sys; sys.stdout.write('10%\\r50%\\r100%\\ndone'); sys.stdout.flush()"
    assert launch.main(["--nproc", "1"] + py(code)) == 0
    assert "[0] 10%\r[0] 50%\r[0] 100%\n[0] done\n" in capfd.readouterr().out


def test_failure_stops_the_others_and_returns_its_status(capfd):
    # Process 0 would sleep for a minute; process 1 fails at once.
    code = (
        "import os, sys, time\n"
        "if os.environ['DISTRAIN_PROCESS_ID'] == '1': sys.exit(7)\n"
        "time.sleep(60)"
    )
    start = time.monotonic()
    assert launch.main(["--nproc", "2", "--grace-period", "1"] + py(code)) == 7
    assert time.monotonic() - start < 20
    err = capfd.readouterr().err
    assert "[launch] process 1 exited with status 7; stopping the other processes" in err
    assert "giving up after 1 attempt(s); exit status 7" in err


IGNORE_SIGTERM = (
    "import os, signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *a: print('ignoring SIGTERM', flush=True))\n"
    "open(os.path.join({dir!r}, os.environ['DISTRAIN_PROCESS_ID']), 'w').write(str(os.getpid()))\n"
    "if os.environ['DISTRAIN_PROCESS_ID'] == '1' and {fail}:\n"
    "    time.sleep(1); sys.exit(1)\n"
    "while True: time.sleep(0.1)"
)


def _assert_all_gone(pid_dir: Path) -> None:
    for pid_file in pid_dir.iterdir():
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid_file.read_text()), 0)


def test_after_a_failure_the_others_are_killed_at_once(capfd, tmp_path):
    # Process 0 ignores SIGTERM (as JAX's preemption service makes a process do); the
    # launcher must not wait out the grace period before restarting.
    code = IGNORE_SIGTERM.format(dir=str(tmp_path), fail=True)
    start = time.monotonic()
    assert launch.main(["--nproc", "2", "--grace-period", "60"] + py(code)) == 1
    assert time.monotonic() - start < 20
    assert "ignoring SIGTERM" not in capfd.readouterr().out
    _assert_all_gone(tmp_path)


def test_a_stopped_launcher_kills_a_process_ignoring_sigterm_after_the_grace_period(tmp_path):
    code = IGNORE_SIGTERM.format(dir=str(tmp_path), fail=False)
    argv = [PY, "-m", "distrain._src.cluster.launch", "--nproc", "2", "--grace-period", "1"]
    proc = subprocess.Popen(argv + py(code), start_new_session=True, stdout=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while len(list(tmp_path.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        # A pid file is written after its process installed the SIGTERM handler.
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
        assert proc.returncode == 130
        assert b"[0] ignoring SIGTERM" in out and b"[1] ignoring SIGTERM" in out
        _assert_all_gone(tmp_path)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_restarts_after_a_failure_until_success(capfd):
    # Fails on the first two attempts, succeeds on the third.
    code = "import os, sys; sys.exit(0 if os.environ['DISTRAIN_RESTART_COUNT'] == '2' else 3)"
    assert launch.main(["--nproc", "2", "--max-restarts", "2"] + py(code)) == 0
    err = capfd.readouterr().err
    assert err.count("[launch] starting 2 processes") == 3
    assert "restarting all processes (2 of 2)" in err
    ports = {line.rsplit(":", 1)[1] for line in err.splitlines() if "coordinator" in line}
    assert len(ports) == 3  # a fresh port for every attempt


def test_out_of_restarts_returns_the_last_status_and_signals_as_128_plus(capfd):
    code = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    assert launch.main(["--nproc", "1", "--max-restarts", "1"] + py(code)) == 128 + 9
    err = capfd.readouterr().err
    assert "[launch] process 0 was killed by SIGKILL\n" in err  # nothing else to stop
    assert err.count("starting 1 process (") == 2  # issue 51: "1 processes"


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--nproc", "0", "--", "x"], r"--nproc: expected an integer >= 1, received '0'"),
        (["--nproc", "2", "--max-restarts", "-1", "--", "x"], r"expected an integer >= 0"),
        (["--nproc", "2", "--timeout", "0", "--", "x"], r"--timeout: expected seconds > 0"),
        (["--nproc", "2", "--port", "70000", "--", "x"], r"expected a port in 0..65535"),
        (["--", "x"], r"one of the arguments --nproc --islands is required"),
    ],
)
def test_bad_arguments(capsys, argv, match):
    with pytest.raises(SystemExit) as exc:
        launch.main(argv)
    assert exc.value.code == 2
    assert re.search(match, capsys.readouterr().err)


def test_missing_command(capsys):
    assert launch.main(["--nproc", "2"]) == 2
    assert "expected the program to run after '--'" in capsys.readouterr().err


def test_sigterm_to_the_launcher_stops_every_process(tmp_path):
    code = (
        "import os, time\n"
        f"open(os.path.join({str(tmp_path)!r}, os.environ['DISTRAIN_PROCESS_ID']), 'w')"
        ".write(str(os.getpid()))\n"
        "time.sleep(60)"
    )
    argv = [PY, "-m", "distrain._src.cluster.launch", "--nproc", "2", "--grace-period", "1"]
    proc = subprocess.Popen(argv + py(code), start_new_session=True, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while len(list(tmp_path.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = [int(p.read_text() or 0) for p in tmp_path.iterdir()]
        assert len(pids) == 2 and all(pids)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 130
        time.sleep(0.2)
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _train_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTRAIN_")}
    env.pop("TF_CONFIG", None)
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _load_script(path: str):
    spec = importlib.util.spec_from_file_location("mw_train", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _uninterrupted_reference(devices, steps: int, batch: int = 16) -> dict:
    """The same training, in this process, on 2 devices (no kill, no checkpoint)."""
    mw = _load_script(TRAIN)
    strategy = dt.MirroredStrategy(devices[:2])
    step_fn = mw.make_train_step(batch)
    losses = []
    with strategy.scope():
        state = strategy.put_replicated(mw.initial_state())
        for i in range(steps):
            batch_i = strategy.distribute_batch(mw.global_batch(i, batch))
            state, loss = strategy.run(step_fn, args=(state, batch_i))
            losses.append(float(strategy.reduce("sum", loss)))
    return {"losses": np.asarray(losses), **{k: np.asarray(v) for k, v in state.params.items()}}


def test_killed_worker_is_restarted_and_resumes_from_its_checkpoint(tmp_path, devices):
    # Process 1 SIGKILLs itself after step 3 (before saving it) on the first attempt.
    cmd = [PY, "-m", "distrain._src.cluster.launch", "--nproc", "2", "--devices-per-proc", "1"]
    cmd += ["--max-restarts", "1", "--grace-period", "1", "--timeout", "20", "--"]
    cmd += [PY, TRAIN, "--out", str(tmp_path / "out"), "--ckpt", str(tmp_path / "ckpt")]
    cmd += ["--ckpt-impl", "distrain", "--kill-at", "3", "--steps", "6"]
    proc = subprocess.Popen(
        cmd,
        env=_train_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # the launcher stops its processes
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    log = out.decode(errors="replace")
    assert proc.returncode == 0, log
    assert "[1] killing myself at step 3" in log
    assert "[launch] process 1 was killed by SIGKILL; stopping the other processes" in log
    assert "[launch] restarting all processes (1 of 1)" in log
    assert "[0] resumed from step 2" in log and "[1] resumed from step 2" in log
    ref = _uninterrupted_reference(devices, steps=6)
    for pid in (0, 1):
        got = np.load(tmp_path / "out" / f"result_{pid}.npz")
        assert int(got["start"]) == 2 and int(got["step"]) == 6
        np.testing.assert_allclose(got["losses"], ref["losses"][2:], rtol=1e-6)
        for name in ("w1", "b1", "w2", "b2"):
            np.testing.assert_allclose(got[name], ref[name], rtol=1e-6, atol=1e-7)


def test_a_preempted_worker_saves_and_restarts_without_using_a_restart(tmp_path, devices):
    # Process 1 gets SIGTERM after step 2 on the first attempt (not through the launcher):
    # both processes save step 2 and exit 143, and the launcher starts them again although
    # --max-restarts is 0. The job ends as an uninterrupted one would.
    cmd = [PY, "-m", "distrain._src.cluster.launch", "--nproc", "2", "--devices-per-proc", "1"]
    cmd += ["--max-restarts", "0", "--grace-period", "30", "--timeout", "20", "--"]
    cmd += [PY, TRAIN, "--out", str(tmp_path / "out"), "--ckpt", str(tmp_path / "ckpt")]
    cmd += ["--ckpt-impl", "distrain", "--term-at", "2", "--steps", "4"]
    proc = subprocess.Popen(
        cmd,
        env=_train_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log = out.decode(errors="replace")
    assert proc.returncode == 0, log
    assert "[1] sending myself SIGTERM at step 2" in log
    assert "[0] preempted: saved step 2" in log and "[1] preempted: saved step 2" in log
    assert (
        "[launch] preempted: process(es) 0, 1 saved after SIGTERM and exited with status 143" in log
    )
    assert "[launch] restarting all processes after the preemption (1 of 10" in log
    assert "[0] resumed from step 2" in log and "[1] resumed from step 2" in log
    assert "stopping the other processes" not in log, log
    ref = _uninterrupted_reference(devices, steps=4)
    for pid in (0, 1):
        got = np.load(tmp_path / "out" / f"result_{pid}.npz")
        assert int(got["start"]) == 2 and int(got["step"]) == 4
        np.testing.assert_allclose(got["losses"], ref["losses"][2:], rtol=1e-6)
        for name in ("w1", "b1", "w2", "b2"):
            np.testing.assert_allclose(got[name], ref[name], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "program, status, match",
    [
        (
            "no-such-program-distrain",
            127,
            r"cannot start 'no-such-program-distrain': not found on PATH or in \S+ \(next to "
            r"this launcher's Python\)\..*`source \.venv/bin/activate`",
        ),
        ("./missing.sh", 127, r"cannot start '\./missing\.sh': no such file\..*check the path"),
        ("./not-executable.sh", 126, r"cannot start '\./not-executable\.sh': not executable"),
        ("./garbage.bin", 126, r"cannot start '\./garbage\.bin': Exec format error"),
    ],
)
def test_a_command_that_cannot_start_is_one_error_and_no_restart(
    capfd, tmp_path, monkeypatch, program, status, match
):
    (tmp_path / "not-executable.sh").write_text("echo hi\n")
    (tmp_path / "garbage.bin").write_bytes(b"\x00\x01 not a program")
    (tmp_path / "garbage.bin").chmod(0o755)  # passes the check; exec() itself fails
    monkeypatch.chdir(tmp_path)
    argv = ["--nproc", "2", "--max-restarts", "3", "--", program, "--flag"]
    assert launch.main(argv) == status
    err = capfd.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and re.search(match, errors[0]), err
    # One error, no restart loop, no traceback; usually caught before anything starts.
    assert "Traceback" not in err and "restarting" not in err
    assert err.count("starting 2 processes") <= 1


def test_a_program_not_on_path_runs_from_the_launchers_own_bin_dir(tmp_path):
    # `.venv/bin/distrain launch -- distrain train ...` without the venv activated: the
    # program is not on PATH but next to the launcher's interpreter, and runs from there.
    name = os.path.basename(PY)  # e.g. "python": always next to the interpreter
    env = {**os.environ, "PATH": str(tmp_path)}  # an empty directory: nothing on PATH
    cmd = [PY, "-m", "distrain._src.cluster.launch", "--nproc", "2", "--", name, "-c"]
    cmd += ["import sys; print(sys.executable)"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    own = os.path.join(os.path.dirname(os.path.abspath(PY)), name)
    assert sorted(done.stdout.splitlines()) == [f"[0] {own}", f"[1] {own}"]
    note = f"[launch] {name!r} is not on PATH; running {own} (next to this launcher's Python)"
    assert done.stderr.splitlines().count(note) == 1, done.stderr


# A process that "saves after SIGTERM" exits 143 (dt.checkpoint.PREEMPTION_EXIT_CODE).
PREEMPTED = (
    "import os, sys, time\n"
    "pid, attempt = os.environ['DISTRAIN_PROCESS_ID'], os.environ['DISTRAIN_RESTART_COUNT']\n"
    "if int(attempt) >= {until}: sys.exit(0)\n"
    "if pid == '0':\n"
    "    time.sleep({slow})  # still writing its part of the checkpoint\n"
    "    open(os.path.join({dir!r}, 'saved-' + attempt), 'w').close()\n"
    "    sys.exit({code0})\n"
    "sys.exit(143)"
)


def test_a_preemption_restarts_without_using_a_restart(capfd, tmp_path):
    # Attempts 0 and 1 are preempted: process 1 exits 143 first, process 0 a moment
    # later, once it saved. It must not be killed before that, and neither preemption
    # uses one of the (zero) --max-restarts.
    code = PREEMPTED.format(until=2, slow=0.5, dir=str(tmp_path), code0=143)
    argv = ["--nproc", "2", "--max-restarts", "0", "--grace-period", "20"]
    assert launch.main(argv + py(code)) == 0
    err = capfd.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["saved-0", "saved-1"]
    assert err.count("[launch] starting 2 processes") == 3
    assert "[launch] process 1 was preempted (exit status 143: it saved after SIGTERM)" in err
    assert (
        "[launch] preempted: process(es) 0, 1 saved after SIGTERM and exited with status 143" in err
    )
    assert "restarting all processes after the preemption (2 of 10 --max-preemptions; " in err
    assert "--max-restarts used: 0 of 0)" in err
    assert "(attempt 3 of 3)" in err
    assert "stopping the other processes" not in err and "giving up" not in err


def test_preemption_restarts_are_bounded(capfd, tmp_path):
    # Every attempt is preempted: the launcher still ends, with 143.
    code = PREEMPTED.format(until=99, slow=0, dir=str(tmp_path), code0=143)
    argv = ["--nproc", "2", "--max-restarts", "3", "--max-preemptions", "2"]
    assert launch.main(argv + py(code)) == 143
    err = capfd.readouterr().err
    assert err.count("[launch] starting 2 processes") == 3
    assert (
        "giving up after 2 restart(s) after preemptions (--max-preemptions 2); exit status "
        "143: the processes saved, run the same command to continue"
    ) in err
    assert "restarting all processes (" not in err  # no failure restart was used


@pytest.mark.parametrize(
    "slow, code0, status, match",
    [
        # Process 0 fails while process 1 exits 143: a failure.
        (0.3, 1, 1, r"process 0 exited with status 1 \(a failure, not a preemption\)"),
        # Process 0 does not exit within the grace period: killed, a failure.
        (60, 143, 137, r"process 0 did not exit within 1 s of process 1's preemption exit; "),
    ],
)
def test_a_preemption_with_a_failing_or_stuck_process_is_a_failure(
    capfd, tmp_path, slow, code0, status, match
):
    code = PREEMPTED.format(until=99, slow=slow, dir=str(tmp_path), code0=code0)
    start = time.monotonic()
    argv = ["--nproc", "2", "--grace-period", "1", "--max-preemptions", "5"]
    assert launch.main(argv + py(code)) == status
    assert time.monotonic() - start < 20
    err = capfd.readouterr().err
    assert re.search(match, err), err
    assert f"giving up after 1 attempt(s); exit status {status}" in err
    assert err.count("[launch] starting 2 processes") == 1


def test_sigterm_to_the_launcher_whose_processes_save_exits_143_and_restarts_nothing(tmp_path):
    # The processes save on SIGTERM and exit 143; the launcher was told to stop, so this
    # preemption restarts nothing (else stopping a job would restart it forever).
    code = (
        "import os, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))\n"
        f"open(os.path.join({str(tmp_path)!r}, os.environ['DISTRAIN_PROCESS_ID']), 'w')"
        ".write(str(os.getpid()))\n"
        "time.sleep(60)"
    )
    argv = [PY, "-m", "distrain._src.cluster.launch", "--nproc", "2", "--grace-period", "10"]
    argv += ["--max-preemptions", "5"]
    proc = subprocess.Popen(
        argv + py(code), start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 30
        while len(list(tmp_path.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
        assert proc.returncode == 143, err
        err_text = err.decode()
        assert err_text.count("[launch] starting 2 processes") == 1
        assert (
            "[launch] interrupted; every process saved after SIGTERM and exited with status "
            "143: run the same command to continue"
        ) in err_text
        _assert_all_gone(tmp_path)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


LISTENING = (
    "import json, os, psutil\n"
    "import distrain as dt\n"
    "dt.MultiWorkerMirroredStrategy()\n"
    "port = int(os.environ['DISTRAIN_COORDINATOR_ADDRESS'].rsplit(':', 1)[1])\n"
    "mine = psutil.Process().net_connections(kind='tcp')\n"
    "ips = sorted(c.laddr.ip for c in mine if c.status == 'LISTEN' and c.laddr.port == port)\n"
    "print('LISTENING', json.dumps(ips), flush=True)\n"
)


def _unmapped(ip: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """``::ffff:127.0.0.1`` (an IPv6 socket bound to an IPv4 address) as ``127.0.0.1``."""
    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)
    return mapped if mapped is not None else address


def test_the_coordinator_listens_on_loopback_only():
    # JAX's coordinator service binds every interface ([::]:port) unless told otherwise;
    # under `distrain launch` nothing off this machine needs to reach it.
    cmd = [PY, "-m", "distrain._src.cluster.launch", "--nproc", "2", "--devices-per-proc", "1"]
    cmd += ["--timeout", "60"] + py(LISTENING)
    env = _train_env()
    env.pop("JAX_COORDINATOR_BIND_ADDRESS", None)
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log = out.decode(errors="replace")
    assert proc.returncode == 0, log
    listening = {
        int(m.group(1)): json.loads(m.group(2))
        for m in re.finditer(r"^\[(\d)\] LISTENING (.*)$", log, re.M)
    }
    # Process 0 hosts the coordinator service (gRPC may bind it as ::ffff:127.0.0.1);
    # process 1 only connects to it. Before: ["::"], every interface.
    assert [str(_unmapped(ip)) for ip in listening[0]] == ["127.0.0.1"], log
    assert listening[1] == [], log


def test_a_worker_error_is_restarted_within_seconds(tmp_path):
    # Process 1 raises after step 3 on the first attempt. Before distrain's fail-fast exit
    # it then waited in JAX's shutdown barrier for 300 s, and so did the restart.
    cmd = [PY, "-m", "distrain._src.cluster.launch", "--nproc", "2", "--devices-per-proc", "1"]
    cmd += ["--max-restarts", "1", "--", PY, FAULT, "--fault", "raise", "--steps", "5"]
    proc = subprocess.Popen(
        cmd,
        env=_train_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log = out.decode(errors="replace")
    assert proc.returncode == 0, log
    assert "[launch] process 1 exited with status 1; stopping the other processes" in log
    assert "[launch] restarting all processes (1 of 1)" in log
    fault = float(re.search(r"^\[1\] fault (\S+)$", log, re.M).group(1))
    # The last "step 1" of process 0 is the restarted attempt's first step.
    restarted = float(re.findall(r"^\[0\] step 1 (\S+)$", log, re.M)[-1])
    assert 0 < restarted - fault < 25, log  # includes starting Python and JAX again


GPU_ENV = (
    "import os; e = os.environ; print(e['DISTRAIN_PROCESS_ID'], e['CUDA_VISIBLE_DEVICES'], "
    "e['DISTRAIN_LOCAL_DEVICES'], 'JAX_LOCAL_DEVICE_IDS' in e, 'DISTRAIN_LOCAL_DEVICE_IDS' in e)"
)


@pytest.mark.parametrize(
    "visible, expected",
    [
        (None, ["0 0,1 2", "1 2,3 2", "2 4,5 2"]),
        ("7,5,3,1,0,2", ["0 7,5 2", "1 3,1 2", "2 0,2 2"]),
    ],
)
def test_gpus_per_proc_gives_each_process_its_own_gpus(capfd, monkeypatch, visible, expected):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setenv("JAX_LOCAL_DEVICE_IDS", "0,1,2,3,4,5")  # whole-machine ids: dropped
    monkeypatch.setenv("DISTRAIN_LOCAL_DEVICE_IDS", "0,1")
    assert launch.main(["--nproc", "3", "--gpus-per-proc", "2"] + py(GPU_ENV)) == 0
    lines = sorted(line for line in capfd.readouterr().out.splitlines() if line.startswith("["))
    assert lines == [f"[{i}] {want} False False" for i, want in enumerate(expected)]


def test_gpus_per_proc_errors(capfd, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    assert launch.main(["--nproc", "2", "--gpus-per-proc", "2"] + py(GPU_ENV)) == 2
    err = capfd.readouterr().err
    assert "needs 4 GPUs, but CUDA_VISIBLE_DEVICES lists 3 ('0,1,2')" in err
    assert "starting" not in err
    argv = ["--nproc", "1", "--gpus-per-proc", "1", "--devices-per-proc", "2"]
    assert launch.main(argv + py(GPU_ENV)) == 2
    assert "--devices-per-proc (virtual CPU devices) and --gpus-per-proc" in capfd.readouterr().err
    with pytest.raises(SystemExit):
        launch.main(["--nproc", "1", "--gpus-per-proc", "0", "--", "x"])


# An island's process: says it started (its pid in DIR/<attempt>), exits 143 on SIGTERM
# after writing DIR/terminated, or fails at once with status 9 on its first attempt.
ISLAND = (
    "import os, signal, sys, time\n"
    "d = {dir!r}\n"
    "def on_term(*a):\n"
    "    open(os.path.join(d, 'terminated'), 'w').close(); sys.exit(143)\n"
    "signal.signal(signal.SIGTERM, on_term)\n"
    "attempt = os.environ['DISTRAIN_RESTART_COUNT']\n"
    "open(os.path.join(d, attempt), 'w').write(str(os.getpid()))\n"
    "if attempt == '0' and {fail}: sys.exit(9)\n"
    "while True: time.sleep(0.05)"
)


def _island_launcher(argv: list[str]) -> Supervisor:
    """One island's launcher, as `distrain launch --islands` makes it."""
    parser = launch.argparse.ArgumentParser()
    launch.add_arguments(parser)
    args = parser.parse_args(argv)
    args.nproc = args.nproc_per_island
    return Supervisor(args, args.command[1:], name="island 1 ")


def test_a_stopped_island_ends_on_sigterm_and_is_not_reported_as_killed(tmp_path, capfd):
    """Issue 51: after Ctrl-C, `distrain launch --islands` printed `island 0 process 0
    was killed by SIGKILL; stopping the other processes`: the SIGKILL was its own. A
    stopped island's attempt now ends with SIGTERM (SIGKILL only after --grace-period),
    reports no failure and restarts nothing. A failure of a one-process island says
    that the other islands go on, not that "the other processes" stop; each attempt
    prints its process ids (to kill one by hand)."""
    code = ISLAND.format(dir=str(tmp_path), fail=True)
    launcher = _island_launcher(
        ["--islands", "2", "--max-restarts", "3", "--grace-period", "60"] + py(code)
    )
    codes = []
    thread = launch.threading.Thread(target=lambda: codes.append(launcher.run()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not (tmp_path / "1").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)  # the second attempt's SIGTERM handler is installed
    start = time.monotonic()
    launcher.stop()
    thread.join(timeout=30)
    assert not thread.is_alive() and codes == [130]
    assert time.monotonic() - start < 10  # SIGTERM ended it, not the 60 s SIGKILL
    assert (tmp_path / "terminated").exists()
    err = capfd.readouterr().err
    pids = [(tmp_path / a).read_text() for a in ("0", "1")]
    assert f"[launch] island 1 process 0 is pid {pids[0]}" in err
    assert f"[launch] island 1 process 0 is pid {pids[1]}" in err
    assert "[launch] island 1 starting 1 process (attempt 1 of 4)" in err
    assert "[launch] island 1 process 0 exited with status 9; the other islands go on" in err
    assert "[launch] island 1 restarting its processes (1 of 3)" in err
    assert "killed by" not in err and "other processes" not in err, err
    assert "restarting its processes (2 of 3)" not in err and "finished" not in err
