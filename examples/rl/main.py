"""CartPole in JAX: PPO under MirroredStrategy, or A3C under ParameterServerStrategy.

Kept short on purpose: the logic is in ``train.py`` / ``a3c.py``, which the smoke test imports.

    python -m examples.rl.main --devices 8 --out examples/rl           # PPO, 8 replicas
    python -m examples.rl.main --algo a3c --workers 2 --out examples/rl  # asynchronous
"""

from __future__ import annotations

import argparse
import json
import os


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algo", choices=("ppo", "a3c"), default="ppo")
    p.add_argument("--devices", type=int, default=8, help="virtual CPU devices (PPO replicas)")
    p.add_argument("--workers", type=int, default=2, help="A3C: asynchronous workers")
    p.add_argument("--total-env-steps", type=int, default=None, help="default: the config's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="directory for the PNG curve and JSON result")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # Must happen before JAX initialises its CPU backend.
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        count = args.devices if args.algo == "ppo" else args.workers
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}"
    steps = {} if args.total_env_steps is None else {"total_env_steps": args.total_env_steps}

    if args.algo == "ppo":
        import distrain as dt

        from . import train

        cfg = train.PPOConfig(seed=args.seed, **steps)
        result = train.train(cfg, dt.MirroredStrategy(list(range(args.devices))), log_every=50)
        summary = {
            "algo": "ppo",
            "replicas": result.num_replicas,
            "compile_time_s": round(result.compile_time_s, 1),
        }
        title = f"PPO, {result.num_replicas} replicas (MirroredStrategy)"
    else:
        from . import a3c

        cfg = a3c.A3CConfig(num_workers=args.workers, seed=args.seed, **steps)
        result = a3c.train_a3c(cfg, log_every=200)
        summary = {"algo": "a3c", "workers": cfg.num_workers, "server_stats": result.server_stats}
        title = f"A3C, {cfg.num_workers} async workers (ParameterServerStrategy)"
    summary.update(
        env_steps=result.env_steps,
        first_env_steps_at_475=result.first_env_steps_at_target,
        final_training_return=round(result.history[-1]["return_smoothed"], 1),
        eval_return_sampled=result.eval_return,
        eval_return_greedy=result.eval_return_greedy,
        wall_time_s=round(result.wall_time_s, 1),
    )
    print(json.dumps(summary, indent=2))
    if args.out:
        from . import plots

        os.makedirs(args.out, exist_ok=True)
        suffix = "" if args.algo == "ppo" else "_a3c"
        title += f": eval {result.eval_return:.0f}, {result.wall_time_s:.0f} s"
        plots.plot_learning_curve(
            result.history, os.path.join(args.out, f"learning_curve{suffix}.png"), title
        )
        with open(os.path.join(args.out, f"result{suffix}.json"), "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
