"""A GAN on a ring of 8 Gaussians under MirroredStrategy, with checkpoints and resumption.

Kept short on purpose: the logic is in ``train.py``, which the smoke test imports.

    python -m examples.gan.main --devices 8 --workdir /tmp/gan_run --out examples/gan

Run it again with the same ``--workdir`` after an interruption and it resumes from the
last checkpoint (state, data position and loss history).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from examples.cpu_devices import use_cpu_devices


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8, help="virtual CPU devices (replicas)")
    p.add_argument("--steps", type=int, default=None, help="generator steps (default: config)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None, help="checkpoint directory (resumes if present)")
    p.add_argument("--save-every", type=int, default=500)
    p.add_argument("--stop-after", type=int, default=None, help="stop early (to try resuming)")
    p.add_argument("--out", default=None, help="directory for gan.png and result.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    use_cpu_devices(args.devices)  # before JAX initialises its CPU backend
    import distrain as dt

    from . import train

    cfg = train.GANConfig(seed=args.seed)
    if args.steps is not None:
        cfg = dataclasses.replace(cfg, steps=args.steps)
    strategy = dt.MirroredStrategy(list(range(args.devices)))
    result = train.train(
        cfg,
        strategy,
        workdir=args.workdir,
        save_every=args.save_every,
        stop_after=args.stop_after,
        verbose=True,
    )
    q = result.quality
    summary = {
        "replicas": result.num_replicas,
        "steps": result.steps,
        "resumed_from": result.resumed_from,
        "modes_covered": q.modes_covered,
        "high_quality_fraction": round(q.high_quality_fraction, 4),
        "per_mode_fraction": [round(f, 4) for f in q.per_mode_fraction],
        "wall_time_s_this_process": round(result.wall_time_s, 1),
    }
    print(json.dumps(summary, indent=2))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        train.plot(result, os.path.join(args.out, "gan.png"))
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
