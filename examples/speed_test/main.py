"""Speed test (seed 003): the same model trained normally and with MirroredStrategy.

    python -m examples.speed_test.main --epochs 40

Each run happens in its own fresh Python process, because the number of (virtual)
CPU devices is fixed when JAX starts its backend: XLA reads
``--xla_force_host_platform_device_count`` from ``XLA_FLAGS`` once, at start-up. So
the "normal" run is a process with 1 CPU device, the distributed run a process with
``--devices`` (8) virtual CPU devices, and this command prints both side by side.

Read the numbers honestly: the virtual devices are not extra hardware. All of them
share this machine's cores (2 here), and every distributed step adds an all-reduce
between them, so on a CPU-only machine the distributed run is *expected* to be
slower. On a machine with 8 GPUs the same code gives each replica its own chip.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
from collections.abc import Sequence

_FLAG = "--xla_force_host_platform_device_count"


def xla_flags_with_devices(flags: str, n: int) -> str:
    """``flags`` with the virtual CPU device count set to ``n`` (replacing any given)."""
    flags = re.sub(rf"{_FLAG}=\S+", "", flags).strip()
    return f"{flags} {_FLAG}={n}".strip()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--dataset",
        choices=("digits", "mnist"),
        default="digits",
        help="digits: offline 8x8 digits; mnist: downloads ~11 MB once",
    )
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument(
        "--global-batch-size",
        type=int,
        default=200,
        help="the seed's 25 per replica x 8 replicas; the same for both runs",
    )
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--devices", type=int, default=8, help="replicas of the distributed run")
    p.add_argument(
        "--mode",
        choices=("both", "normal", "distributed"),
        default="both",
        help="both: run each in a subprocess and compare (the default)",
    )
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    return p.parse_args(argv)


def _config_args(args: argparse.Namespace) -> list[str]:
    return [
        "--dataset",
        args.dataset,
        "--epochs",
        str(args.epochs),
        "--global-batch-size",
        str(args.global_batch_size),
        "--learning-rate",
        str(args.learning_rate),
        "--seed",
        str(args.seed),
        "--devices",
        str(args.devices),
    ]


def _run_one(args: argparse.Namespace) -> dict:
    """Runs one mode in this process (whose device count is already fixed)."""
    import jax

    import distrain as dt
    from examples.speed_test import train

    config = train.Config(
        dataset=args.dataset,
        epochs=args.epochs,
        global_batch_size=args.global_batch_size,
        learning_rate=args.learning_rate,
        seed=args.seed,
    )
    if args.mode == "normal":
        timing = train.run_normal(config)
    else:
        if jax.device_count() < args.devices:
            raise ValueError(
                f"--devices {args.devices} asks for more replicas than this process has "
                f"devices ({jax.device_count()}). Run with --mode both, or set XLA_FLAGS="
                f"{_FLAG}={args.devices} before starting Python."
            )
        timing = train.run_distributed(config, dt.MirroredStrategy(jax.devices()[: args.devices]))
    return dataclasses.asdict(timing)


def _spawn(args: argparse.Namespace, mode: str, devices: int) -> dict:
    env = dict(os.environ)
    # Only the CPU platform reads this flag; on a GPU machine both runs use real GPUs.
    env["XLA_FLAGS"] = xla_flags_with_devices(env.get("XLA_FLAGS", ""), devices)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "examples.speed_test.main", "--mode", mode, *_config_args(args)]
    proc = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=args.timeout, start_new_session=True
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"The {mode} run failed (exit code {proc.returncode}). Its output:\n"
            f"{proc.stdout[-2000:]}{proc.stderr[-4000:]}"
        )
    result_lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    return json.loads(result_lines[-1][len("RESULT ") :])


def format_table(normal: dict, dist: dict) -> str:
    """The two runs side by side."""
    rows = [
        ("", "normal", "distributed"),
        ("platform", normal["platform"], dist["platform"]),
        ("devices (replicas)", str(normal["num_devices"]), str(dist["num_devices"])),
        ("steps", str(normal["steps"]), str(dist["steps"])),
        ("time taken, s", f"{normal['total_seconds']:.2f}", f"{dist['total_seconds']:.2f}"),
        (
            "  first step (compile), s",
            f"{normal['first_step_seconds']:.2f}",
            f"{dist['first_step_seconds']:.2f}",
        ),
        (
            "steps/s after the first",
            f"{normal['steps_per_second']:.1f}",
            f"{dist['steps_per_second']:.1f}",
        ),
        ("final train loss", f"{normal['final_loss']:.4f}", f"{dist['final_loss']:.4f}"),
        ("test accuracy", f"{normal['test_accuracy']:.4f}", f"{dist['test_accuracy']:.4f}"),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [f"{a:<{width}}  {b:>12}  {c:>12}" for a, b, c in rows]
    if dist["platform"] == "cpu":
        lines.append(
            f"note: the {dist['num_devices']} virtual devices share this machine's "
            f"{os.cpu_count()} CPU cores; a distributed run on CPU-only hardware pays for its "
            "all-reduce and gains no compute."
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> tuple[dict, dict] | dict:
    args = parse_args(argv)
    if args.mode != "both":
        if _FLAG not in os.environ.get("XLA_FLAGS", ""):  # before JAX starts its backend
            n = 1 if args.mode == "normal" else args.devices
            os.environ["XLA_FLAGS"] = xla_flags_with_devices(os.environ.get("XLA_FLAGS", ""), n)
        result = _run_one(args)
        print("RESULT " + json.dumps(result), flush=True)
        return result
    print(
        f"Time taken by normal training (1 device) and distributed training "
        f"({args.devices} virtual devices), {args.epochs} epochs of {args.dataset}:",
        flush=True,
    )
    normal = _spawn(args, "normal", 1)
    dist = _spawn(args, "distributed", args.devices)
    print(format_table(normal, dist))
    return normal, dist


if __name__ == "__main__":
    main()
