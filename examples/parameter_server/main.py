"""Asynchronous parameter-server training on the 8x8 digits, from the command line.

Intentionally kept short: the logic is in ``train.py``.

Example:
    python -m examples.parameter_server.main                      # 4 threads, 2 servers
    python -m examples.parameter_server.main --backend ray        # Ray actors, local Ray
    python -m examples.parameter_server.main --max-staleness 0    # synchronous rounds
"""

from __future__ import annotations

import argparse
import json
import sys

from examples.parameter_server.train import Config, train_and_evaluate


def parse(argv: list[str] | None = None) -> Config:
    defaults = Config()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", choices=("inprocess", "ray"), default=defaults.backend)
    p.add_argument("--ray-address", default=None)
    p.add_argument("--num-workers", type=int, default=defaults.num_workers)
    p.add_argument("--num-ps", type=int, default=defaults.num_ps)
    p.add_argument("--max-staleness", type=int, default=None)
    p.add_argument("--steps", type=int, default=defaults.steps)
    p.add_argument("--batch-size", type=int, default=defaults.batch_size)
    p.add_argument("--learning-rate", type=float, default=defaults.learning_rate)
    p.add_argument("--eval-every", type=int, default=defaults.eval_every)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--checkpoint-dir", default=None)
    return Config(**{k: v for k, v in vars(p.parse_args(argv)).items()})


def main(argv: list[str] | None = None) -> int:
    result = train_and_evaluate(parse(argv))
    summary = {k: result[k] for k in ("test_accuracy", "seconds", "worker_steps_per_s")}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
