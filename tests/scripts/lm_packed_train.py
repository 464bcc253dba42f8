"""The LM example on packed documents, a sequence split over "context": killed and resumed.

tests/test_lm_packed.py runs this to completion (the reference), then runs it again,
SIGKILLs it after a backup, and starts it once more with the same command: the final
parameters and every step's batch (a checksum per step, logged) must be those of the
reference, bit for bit.

2 replicas x {"context": 4} on 8 CPU devices; rows packed by
examples/lm/data.py:pack_documents and load-balanced for 4 context devices in the input
path; ring attention inside the step; BackupAndRestore every 2 steps.

Markers on stdout: ``STEP <n> <checksum>`` after each step; ``DONE`` after --out.
"""

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: examples/


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--step-sleep", type=float, default=0.0)
    args = p.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()

    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    import distrain as dt
    from distrain.models import LMConfig
    from examples.lm.data import stdlib_packed_splits
    from examples.lm.train import Settings, init_state, train_step

    seq = 32
    s = Settings(
        model=LMConfig(seq_len=seq, d_model=32, n_layers=2, n_heads=2),
        optimizer="adam",
        learning_rate=1e-2,
    )
    rows = stdlib_packed_splits(seq, heldout_fraction=0.3, max_documents=40, load_balance=4)
    strategy = dt.MirroredStrategy(
        devices_per_replica={"context": 4},
        batch_layout={"inputs|targets|segment_ids|positions": P(None, "context")},
    )
    apply_fn, state = init_state(s)
    base = functools.partial(train_step, apply_fn=apply_fn)

    def step(state, batch):  # + a checksum of the batch: the batches are compared too
        state, metrics = base(state, batch)
        weights = 1 + jnp.arange(seq, dtype=jnp.float32)  # order within a row counts
        total = (batch["inputs"].astype(jnp.float32) * weights).sum()
        return state, {**metrics, "checksum": dt.metrics.Sum.from_values(total)}

    def on_step(info):
        print(f"STEP {info.step} {info.logs['checksum']:.1f}", flush=True)
        time.sleep(args.step_sleep)

    trainer = dt.Trainer(strategy, step, log_every=1)
    data = dt.data.ArrayPipeline(rows["train"], global_batch_size=8, seed=0, num_epochs=None)
    callbacks = [
        dt.callbacks.BackupAndRestore(args.dir, save_freq=2, delete_checkpoint=False),
        dt.callbacks.LambdaCallback(on_train_batch_end=on_step),
    ]
    state, _ = trainer.fit(state, data, steps=args.steps, callbacks=callbacks)
    flat = jax.tree_util.tree_flatten_with_path(jax.device_get(state.params))[0]
    np.savez(args.out, **{jax.tree_util.keystr(k): np.asarray(v) for k, v in flat})
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
