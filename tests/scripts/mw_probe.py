"""Joins the cluster described by DISTRAIN_* / TF_CONFIG and reports what it sees.

Used by tests/test_multi_worker.py for start-up behaviour (device counts, chief,
unreachable coordinator). Prints one line "OK <json>" on success; errors propagate
(non-zero exit status, message on stderr).
"""

import json
import sys


def main() -> int:
    from distrain import MultiWorkerMirroredStrategy

    strategy = MultiWorkerMirroredStrategy()

    import jax

    resolver = strategy.cluster_resolver
    print(
        "OK "
        + json.dumps(
            {
                "process_id": jax.process_index(),
                "num_processes": jax.process_count(),
                "replicas": strategy.num_replicas_in_sync,
                "local_devices": len(jax.local_devices()),
                "is_chief": strategy.is_chief,
                "task_type": resolver.task_type,
                "task_id": resolver.task_id,
                "resolver": type(resolver).__name__,
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
