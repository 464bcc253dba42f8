"""Runs the benchmark suite: ``python -m benchmarks.run [--quick] [--steps N] [--out PATH]``.

For each device count (1 and 8 virtual CPU devices) the runner starts one worker
process per framework (``benchmarks/worker.py``; the device count must be set before
JAX or TensorFlow starts), sets every configuration up (compile and warm up), then
runs ``--repeats`` rounds in which every configuration trains ``--steps`` steps once,
in a rotated order. Medians of those interleaved repeats, and their ratios, are what
it reports: a slow spell of the (shared) machine hits every configuration alike.

Then it runs the other benchmark scripts that are present (``checkpoint_overhead``,
``multi_process``, ``parameter_server``, ``xla_cpu``) as ``python -m benchmarks.NAME --json PATH
[--quick]`` and includes their JSON. It prints a table and writes JSON (``--out``)
and, with ``--plot``, a PNG.

Example::

    python -m benchmarks.run --quick
    python -m benchmarks.run --steps 200 --repeats 7 --plot docs/performance_steps_per_sec.png
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import portable, report
from benchmarks.loops import JAX_CONFIGS
from benchmarks.workloads import WORKLOADS

ROOT = Path(__file__).resolve().parent.parent
PEER_CONFIGS = {"keras_jax_fit": "keras_jax", "tf_mirrored_fit": "tf"}
EXTRA_SCRIPTS = ("checkpoint_overhead", "multi_process", "parameter_server", "xla_cpu")
# XLA flags for the JAX workers (hand-written, distrain, Keras on JAX alike): XLA:CPU's
# YNNPACK fusions make the CNN's gradient step 1.4-1.6x slower on this machine and the
# MLP's no faster (`python -m benchmarks.xla_cpu`). `--xla-cpu-flags ""` runs stock XLA.
JAX_XLA_CPU_FLAGS = "--xla_cpu_experimental_ynn_fusion_type="


class WorkerError(RuntimeError):
    """A worker process died, timed out or could not start."""


class Worker:
    """A ``benchmarks.worker`` subprocess; ``request`` sends one command, returns its reply."""

    def __init__(self, kind: str, devices: int, log_dir: str, xla_flags: str = "") -> None:
        self.kind, self.devices = kind, devices
        self.log_path = os.path.join(log_dir, f"worker-{kind}-{devices}.log")
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in close()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        )
        self.proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "benchmarks.worker"),
                *("--kind", kind, "--devices", str(devices), f"--xla-flags={xla_flags}"),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            cwd=ROOT,
            env=env,
            start_new_session=True,  # its own process group: killed as a whole in close()
        )
        self._replies: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@"):
                self._replies.put(line[2:])
        self._replies.put(None)  # end of output: the process exited

    def request(self, cmd: dict[str, Any], timeout: float) -> dict[str, Any]:
        if self.proc.poll() is not None:
            raise WorkerError(f"worker {self.kind}/{self.devices} exited: {self.log_tail()}")
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        try:
            line = self._replies.get(timeout=timeout)
        except queue.Empty:
            self.close()
            raise WorkerError(
                f"worker {self.kind}/{self.devices} timed out after {timeout:.0f}s on {cmd}"
            ) from None
        if line is None:
            raise WorkerError(f"worker {self.kind}/{self.devices} exited: {self.log_tail()}")
        return json.loads(line)

    def log_tail(self, n: int = 1500) -> str:
        self._log.flush()
        text = Path(self.log_path).read_text(errors="replace")
        return text[-n:].strip()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=20)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)
        self._log.close()


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _peer_skip_reason(config: str) -> str | None:
    if importlib.util.find_spec("keras") is None:
        return "keras is not installed (pip install keras)"
    if config == "tf_mirrored_fit" and importlib.util.find_spec("tensorflow") is None:
        return "tensorflow is not installed (pip install tensorflow-cpu)"
    return None


def _log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_device_count(
    devices: int,
    workloads: list[str],
    configs: list[str],
    steps: int,
    repeats: int,
    log_dir: str,
    on_group: Callable[[dict[str, Any]], None] = lambda group: None,
    xla_flags: str = JAX_XLA_CPU_FLAGS,
) -> list[dict[str, Any]]:
    """All groups (one per workload) on ``devices`` devices, repeats interleaved.

    ``xla_flags`` are added to ``XLA_FLAGS`` in the JAX workers (not TensorFlow's).

    ``on_group`` receives each finished group (the runner saves partial results).
    """
    kinds = {c: PEER_CONFIGS.get(c, "jax") for c in configs}
    skipped = {c: _peer_skip_reason(c) for c in configs if c in PEER_CONFIGS}
    workers: dict[str, Worker] = {}
    groups = []
    try:
        for name in workloads:
            w = WORKLOADS[name]
            group: dict[str, Any] = {
                "workload": name,
                "devices": devices,
                "global_batch_size": w.global_batch_size,
                "steps_per_repeat": w.steps(steps),
                "repeats": repeats,
                "configs": {c: {"samples": []} for c in configs},
            }
            live = []
            for c in configs:
                entry = group["configs"][c]
                if skipped.get(c):
                    entry["skipped"] = skipped[c]
                    _log(f"{name}/{devices}: {c} skipped: {skipped[c]}")
                    continue
                kind = kinds[c]
                try:
                    if kind not in workers:
                        flags = "" if kind == "tf" else xla_flags
                        workers[kind] = Worker(kind, devices, log_dir, flags)
                    _log(f"{name}/{devices}: setting up {c}")
                    rep = workers[kind].request(
                        {"op": "setup", "workload": name, "config": c, "steps": steps}, 600
                    )
                except WorkerError as e:
                    rep = {"ok": False, "error": str(e)}
                    workers.pop(kind, None)
                if rep.get("ok"):
                    entry["setup_s"] = rep["setup_s"]
                    live.append(c)
                else:
                    entry["skipped"] = f"failed: {rep.get('error')}"
                    _log(f"{name}/{devices}: {c} failed: {rep.get('error')}")
            for r in range(repeats):
                order = live[r % len(live) :] + live[: r % len(live)] if live else []
                for c in order:
                    if group["configs"][c].get("skipped"):
                        continue
                    try:
                        rep = workers[kinds[c]].request(
                            {"op": "time", "workload": name, "config": c, "steps": steps}, 600
                        )
                    except (WorkerError, KeyError) as e:
                        rep = {"ok": False, "error": str(e)}
                    if rep.pop("ok", False):
                        group["configs"][c]["samples"].append({"round": r, **rep})
                    else:
                        group["configs"][c]["skipped"] = f"failed: {rep.get('error')}"
                _log(f"{name}/{devices}: repeat {r + 1}/{repeats} done")
            for kind, worker in list(workers.items()):
                try:
                    worker.request({"op": "close", "workload": name}, 300)
                except WorkerError as e:
                    _log(f"{name}/{devices}: closing {kind} failed: {e}")
                    workers.pop(kind)
            groups.append(report.summarize_group(group))
            on_group(groups[-1])
    finally:
        for worker in workers.values():
            worker.close()
    return groups


def _extra_result(name: str, json_path: str, output: str, started: float) -> Any:
    """The script's JSON: from ``--json``, its default results file, or its last JSON line."""
    default = ROOT / "benchmarks" / "results" / f"{name}.json"
    for path in (Path(json_path), default):
        if path.exists() and path.stat().st_mtime >= started:
            return json.loads(path.read_text())
    for line in reversed(output.strip().splitlines()):
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            continue
    raise ValueError("it wrote no JSON result")


def run_extras(quick: bool, log_dir: str, timeout: float) -> dict[str, Any]:
    """Runs the other benchmark scripts that exist; returns their JSON (or why not).

    Each runs as ``python -m benchmarks.NAME [--json PATH] [--quick]``, passing the
    flags the script offers.
    """
    out: dict[str, Any] = {}
    for name in EXTRA_SCRIPTS:
        script = ROOT / "benchmarks" / f"{name}.py"
        if not script.exists():
            out[name] = {"skipped": f"benchmarks/{name}.py is not present"}
            continue
        source = script.read_text()
        json_path = os.path.join(log_dir, f"{name}.json")
        cmd = [sys.executable, "-m", f"benchmarks.{name}"]
        if '"--json"' in source:
            cmd += ["--json", json_path]
        if quick and '"--quick"' in source:
            cmd.append("--quick")
        _log(f"running {' '.join(cmd[1:])}")
        started, t0 = time.time(), time.perf_counter()
        log_path = os.path.join(log_dir, f"{name}.log")
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
                rc = None
        text = Path(log_path).read_text(errors="replace")
        entry: dict[str, Any] = {
            "command": portable.command(cmd[1:]),
            "wall_s": time.perf_counter() - t0,
        }
        try:
            if rc != 0:
                raise ValueError("timed out" if rc is None else f"exit code {rc}")
            entry["result"] = _extra_result(name, json_path, text, started)
        except ValueError as e:
            entry["skipped"] = f"failed ({e}): {text[-800:].strip()}"
        out[name] = entry
        _log(f"{name}: {'failed' if 'skipped' in entry else 'done'} in {entry['wall_s']:.0f} s")
    return out


def _machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
        "versions": {
            d: _version(d)
            for d in ("jax", "jaxlib", "optax", "grain", "keras", "tensorflow-cpu", "tensorflow")
        },
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="distrain benchmark suite (see docs/performance.md).")
    p.add_argument(
        "--quick",
        action="store_true",
        help="MLP only, 60 steps x 3 repeats; extras in their quick mode",
    )
    p.add_argument("--steps", type=int, help="steps per repeat (MLP; the CNN runs 1/10)")
    p.add_argument("--repeats", type=int, help="interleaved repeats per configuration")
    p.add_argument("--workloads", default=None, help="comma list of: " + ",".join(WORKLOADS))
    p.add_argument("--devices", default="1,8", help="comma list of device counts")
    p.add_argument(
        "--configs", default=None, help="comma list of: " + ",".join([*JAX_CONFIGS, *PEER_CONFIGS])
    )
    p.add_argument("--no-peers", action="store_true", help="skip Keras and TensorFlow")
    p.add_argument(
        "--no-extras",
        action="store_true",
        help="skip checkpoint_overhead / multi_process / parameter_server / xla_cpu",
    )
    p.add_argument(
        "--xla-cpu-flags",
        default=JAX_XLA_CPU_FLAGS,
        help=f"XLA_FLAGS added in the JAX workers (default {JAX_XLA_CPU_FLAGS!r}; '' = stock)",
    )
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "latest.json"))
    p.add_argument("--plot", default=None, help="also write a PNG plot here")
    args = p.parse_args(argv)
    args.steps = args.steps or (60 if args.quick else 100)
    args.repeats = args.repeats or (3 if args.quick else 7)
    args.workloads = (args.workloads or ("mlp" if args.quick else "mlp,cnn")).split(",")
    args.devices = [int(d) for d in args.devices.split(",")]
    configs = (args.configs or ",".join([*JAX_CONFIGS, *PEER_CONFIGS])).split(",")
    if args.no_peers:
        configs = [c for c in configs if c not in PEER_CONFIGS]
    for value, valid, flag in (
        (args.workloads, WORKLOADS, "--workloads"),
        (configs, [*JAX_CONFIGS, *PEER_CONFIGS], "--configs"),
    ):
        bad = [v for v in value if v not in valid]
        if bad:
            p.error(f"{flag}: unknown {bad}; expected some of {list(valid)}")
    if args.steps < 2 or args.repeats < 1 or any(d < 1 for d in args.devices):
        p.error("--steps must be >= 2, --repeats >= 1 and every device count >= 1")
    args.configs = configs
    return args


def _write(results: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))


def _terminate(signum: int, frame: Any) -> None:
    # Turn SIGTERM into an exception so `finally` blocks stop the worker processes.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    t0 = time.perf_counter()
    out = Path(args.out)
    results: dict[str, Any] = {
        "meta": {
            "command": "python -m benchmarks.run "
            + " ".join(sys.argv[1:] if argv is None else argv),
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "steps": args.steps,
            "repeats": args.repeats,
            "jax_xla_cpu_flags": args.xla_cpu_flags,
            "machine": _machine(),
        },
        "groups": [],
    }
    m = results["meta"]["machine"]
    results["meta"]["machine_summary"] = (
        f"{m['cpu_count']} CPU cores (shared), no GPU; load avg at start "
        f"{m['loadavg_start'][0]:.1f}; jax {m['versions']['jax']}"
    )
    with tempfile.TemporaryDirectory(prefix="distrain-bench-") as log_dir:
        for devices in args.devices:
            run_device_count(
                devices,
                args.workloads,
                args.configs,
                args.steps,
                args.repeats,
                log_dir,
                # Partial results survive an interrupted run.
                on_group=lambda g: (results["groups"].append(g), _write(results, out)),
                xla_flags=args.xla_cpu_flags,
            )
        if not args.no_extras:
            results["extras"] = run_extras(args.quick, log_dir, 300 if args.quick else 600)
    m["loadavg_end"] = os.getloadavg()
    results["meta"]["wall_s"] = time.perf_counter() - t0
    _write(results, out)
    print(report.text_table(results))
    for name, extra in results.get("extras", {}).items():
        print(f"\n{name}: " + (extra.get("skipped") or json.dumps(extra["result"])[:1500]))
    print(
        f"\nwrote {out} ({results['meta']['wall_s']:.0f} s; load avg "
        f"{m['loadavg_start'][0]:.1f} -> {m['loadavg_end'][0]:.1f})"
    )
    if args.plot:
        report.plot(results, args.plot)
        print(f"wrote {args.plot}")
    return results


if __name__ == "__main__":
    main()
