"""One process of a 2-process `dt.models.LMEvalModel.evaluate`, for
tests/test_models_lm_eval.py: the model from --hf on MultiWorkerMirroredStrategy (the
DISTRAIN_* variables), the tasks of --tasks-dir; writes --out/result_<process>.json: the
results on process 0, null on the others."""

import argparse
import json
import os
import sys


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--hf", required=True)
    p.add_argument("--tasks-dir", required=True)
    p.add_argument("--task", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import distrain as dt

    strategy = dt.MultiWorkerMirroredStrategy()  # first: joins the processes
    import jax
    from lm_eval.tasks import TaskManager

    lm = dt.models.LMEvalModel.from_pretrained(args.hf, strategy=strategy)
    manager = TaskManager(include_path=args.tasks_dir, include_defaults=False)
    results = lm.evaluate([args.task], task_manager=manager, bootstrap_iters=0, log_samples=True)
    kept = None if results is None else {
        "results": results["results"],
        "resps": [s["resps"] for s in results["samples"][args.task]],
    }  # fmt: skip
    path = os.path.join(args.out, f"result_{jax.process_index()}.json")
    with open(path, "w") as f:
        json.dump(kept, f, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
