"""XLA's temporaries of the LM's gradient by block count: unrolled or scanned blocks.

The figures behind docs/scaling.md's "Why the scan": with the blocks unrolled and
rematerialised, jax 0.10.2's XLA:CPU keeps every recomputed block's temporaries alive at
once; with ``scan_layers`` only each block's input and its gradient slice stay between
blocks. Each figure is ``temp_size_in_bytes`` of the compiled ``jax.grad`` of the
cross-entropy (XLA's memory analysis: nothing runs), on one device.

    python -m benchmarks.scan_temporaries --json benchmarks/results/scan_temporaries.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from benchmarks.portable import command
from distrain.models import LMConfig, Transformer

#: (arm, LMConfig overrides) measured at each block count.
ARMS = {
    "moe_unrolled_nothing_saveable": dict(moe_experts=4, remat="nothing_saveable"),
    "moe_unrolled_no_remat": dict(moe_experts=4, remat="none"),
    "moe_scanned_nothing_saveable": dict(moe_experts=4, remat="nothing_saveable", scan_layers=True),
    "dense_unrolled_nothing_saveable": dict(remat="nothing_saveable"),
    "dense_unrolled_no_remat": dict(remat="none"),
}


def temporaries(n_layers: int, seq_len: int = 512, d_model: int = 256, **kwargs) -> int:
    """Bytes of XLA temporaries of one gradient of a 2-row batch."""
    cfg = LMConfig(
        vocab_size=256, seq_len=seq_len, d_model=d_model, n_heads=4, n_layers=n_layers,
        d_ff=2 * d_model, **kwargs,
    )  # fmt: skip
    graph, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))

    def loss(p, tokens):
        logits = nnx.merge(graph, p)(tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()

    tokens = jnp.zeros((2, seq_len), jnp.int32)
    compiled = jax.jit(jax.grad(loss)).lower(nnx.to_pure_dict(params), tokens).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", default="1,2,4", help="block counts (default 1,2,4)")
    parser.add_argument("--json", default=None, help="write the result here")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.blocks.split(",")]
    rows = []
    for arm, kwargs in ARMS.items():
        mib = [round(temporaries(n, **kwargs) / 2**20, 1) for n in counts]
        rows.append({"arm": arm, "n_layers": counts, "temp_mib": mib})
        print(
            f"{arm:34s} " + "  ".join(f"{n}: {m} MiB" for n, m in zip(counts, mib, strict=True)),
            flush=True,
        )
    result = {
        "command": command(
            [sys.executable, "-m", "benchmarks.scan_temporaries", *(argv or sys.argv[1:])]
        ),
        "jax": jax.__version__,
        "model": "LMConfig(vocab 256, seq_len 512, d_model 256, 4 heads, d_ff 512), batch 2 x 512",
        "load_average": list(os.getloadavg()),
        "rows": rows,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    return result


if __name__ == "__main__":
    main()
