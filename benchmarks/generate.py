"""Generation speed: ``dt.models.generate`` from its KV cache, by full recompute, and
``transformers``' ``generate`` on PyTorch (CPU), on the same GPT-2-small-shaped weights.

The model has the shapes of ``configs/lm_gpt2_small.yaml`` (12 layers, width 768, 12
heads, vocabulary 50,304, context 1,024, learned positions) in float32, with random
weights (GPT-2's initialisation, ``N(0, 0.02)``), exported to the GPT-2 layout with
``dt.models.save_pretrained``; both libraries read those files. Each row continues a
128-token prompt (random ids, a different prompt per row) by 128 greedy tokens, no stop
token:

* ``kv_cache``: ``dt.models.generate`` (one compiled program: prefill, then a loop of
  one token per row per step over the cache), batch 1 and 32;
* ``recompute``: ``generate(..., use_cache=False)``, the whole window recomputed for
  every token (what the LM example does), batch 1 only, timed once (the first call);
* ``transformers_cpu``: ``AutoModelForCausalLM.generate(do_sample=False)`` on PyTorch,
  batch 1 and 32, where PyTorch and ``transformers`` are installed.

``tokens_per_s`` is new tokens (batch x 128) per second, the best of the first call
less its compile time (``compile_s``: JAX's trace, lowering and compile events) and
``--repeats`` warm calls (``transformers``: of ``--repeats`` calls after a 2-token one).
``greedy_equals_transformers``: every row's 128 tokens equal ``transformers``' (batch 1
and 32); ``recompute_equals_kv_cache``: the same for the two JAX arms at batch 1.
Target: ``kv_cache`` faster than ``transformers_cpu`` at batch 32 on the same CPU.

Usage (run it without XLA_FLAGS, on a quiet machine: ``uptime``):
  python -m benchmarks.generate            # writes benchmarks/results/generate.json
  python -m benchmarks.generate --toy --json /tmp/generate.json   # a tiny model, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
# (vocab, context, width, layers, heads, prompt tokens, new tokens, batches)
FULL = (50304, 1024, 768, 12, 12, 128, 128, (1, 32))
TOY = (256, 64, 32, 2, 2, 16, 16, (1, 4))


def random_checkpoint(directory: str, cfg: Any, seed: int = 0) -> None:
    """GPT-2-initialised random weights for ``cfg``, made in NumPy and exported."""
    import jax
    from flax import nnx

    import distrain as dt

    shapes = nnx.state(nnx.eval_shape(lambda: dt.models.Transformer(cfg, rngs=nnx.Rngs(0))))
    draw = np.random.default_rng(seed)

    def init(path: Any, s: Any) -> np.ndarray:
        name = jax.tree_util.keystr(path)
        if "scale" in name:
            return np.ones(s.shape, np.float32)
        if "bias" in name:
            return np.zeros(s.shape, np.float32)
        return draw.normal(0.0, 0.02, s.shape).astype(np.float32)

    dt.models.save_pretrained(directory, jax.tree_util.tree_map_with_path(init, shapes), cfg)


def _ours(model: Any, prompts: np.ndarray, new: int, repeats: int, use_cache: bool) -> dict:
    """A row for ``dt.models.generate``, and its tokens."""
    import jax

    import distrain as dt

    compile_s = []

    def listen(event: str, duration: float, **kwargs: Any) -> None:
        if event.startswith("/jax/core/compile/"):  # trace, lowering, backend compile
            compile_s.append(duration)

    def call() -> tuple[float, Any]:
        t = time.perf_counter()
        out = dt.models.generate(model, model.params, prompts, new, use_cache=use_cache)
        tokens = np.asarray(jax.block_until_ready(out.tokens))
        return time.perf_counter() - t, tokens

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        first, tokens = call()
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    compiled = sum(compile_s)
    # The first call's run (its compile taken out: JAX's own events), and warm calls.
    times = [first - compiled] + [call()[0] for _ in range(repeats)]
    return _row(
        "kv_cache" if use_cache else "recompute", prompts, new, min(times), compiled
    ), tokens


def _transformers(directory: str, prompts: np.ndarray, new: int, repeats: int) -> tuple:
    """A row for ``transformers``' ``generate`` on PyTorch (CPU), and its tokens."""
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # no stop token, as for distrain's arms
    ids = torch.tensor(prompts, dtype=torch.long)

    def call(n: int) -> tuple[float, np.ndarray]:
        t = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False,
                max_new_tokens=n, min_new_tokens=n, pad_token_id=0,
            )  # fmt: skip
        return time.perf_counter() - t, out[:, prompts.shape[1] :].numpy()

    call(2)  # warm-up: PyTorch's first call allocates and picks its kernels
    runs = [call(new) for _ in range(max(repeats, 1))]
    return _row("transformers_cpu", prompts, new, min(t for t, _ in runs), None), runs[0][1]


def _row(arm: str, prompts: np.ndarray, new: int, seconds: float, compile_s: Any) -> dict:
    batch = len(prompts)
    row = {"arm": arm, "batch": batch, "seconds": round(seconds, 3)}
    row["tokens_per_s"] = round(batch * new / seconds, 2)
    if compile_s is not None:
        row["compile_s"] = round(compile_s, 2)
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--toy", action="store_true", help="a tiny model (the test's size)")
    p.add_argument("--repeats", type=int, default=1, help="timed warm calls per row")
    p.add_argument("--no-transformers", action="store_true", help="skip the PyTorch arm")
    p.add_argument("--json", default=os.path.join(HERE, "results", "generate.json"))
    args = p.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    import distrain as dt

    vocab, context, width, layers, heads, prompt, new, batches = TOY if args.toy else FULL
    cfg = dt.models.LMConfig(
        vocab_size=vocab, seq_len=context, d_model=width, n_layers=layers, n_heads=heads,
        positions="learned", norm_eps=1e-5,
    )  # fmt: skip
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401

        live = not args.no_transformers
    except ImportError:
        live = False
    load = os.getloadavg()
    directory = tempfile.mkdtemp(prefix="generate-bench-")
    rows, tokens = [], {}
    try:
        random_checkpoint(directory, cfg)
        model = dt.models.from_pretrained(directory)
        draw = np.random.default_rng(1)
        prompts = draw.integers(0, min(vocab, 50257), (max(batches), prompt)).astype(np.int32)
        for b in batches:
            row, tokens["kv_cache", b] = _ours(model, prompts[:b], new, args.repeats, True)
            rows.append(row)
        row, tokens["recompute", 1] = _ours(model, prompts[:1], new, 0, False)
        rows.append(row)
        if live:
            for b in batches:
                row, tokens["transformers_cpu", b] = _transformers(
                    directory, prompts[:b], new, args.repeats
                )
                rows.append(row)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    speed = {(r["arm"], r["batch"]): r["tokens_per_s"] for r in rows}
    big = max(batches)
    result = {
        "command": "python -m benchmarks.generate" + (" " + " ".join(argv) if argv else ""),
        "model": f"GPT-2 layout, {layers} layers x width {width}, {heads} heads, vocabulary "
        f"{vocab}, context {context}, float32, random N(0, 0.02) weights",
        "prompt_tokens": prompt,
        "new_tokens": new,
        "rows": rows,
        "greedy_equals_transformers": (
            all(
                np.array_equal(tokens["kv_cache", b], tokens["transformers_cpu", b])
                for b in batches
            )
            if live
            else None
        ),  # fmt: skip
        "recompute_equals_kv_cache": bool(
            np.array_equal(tokens["recompute", 1], tokens["kv_cache", 1])
        ),
        "kv_cache_over_recompute_batch_1": round(speed["kv_cache", 1] / speed["recompute", 1], 2),
        f"kv_cache_over_transformers_batch_{big}": (
            round(speed["kv_cache", big] / speed["transformers_cpu", big], 2) if live else None
        ),
        "cpu": {"count": os.cpu_count(), "machine": platform.machine()},
        "load_average_before_after": [round(load[0], 2), round(os.getloadavg()[0], 2)],
        "versions": _versions(live),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    return result


def _versions(live: bool) -> dict:
    import jax

    out = {"jax": jax.__version__, "python": platform.python_version()}
    if live:
        import torch
        import transformers

        out |= {"torch": torch.__version__, "transformers": transformers.__version__}
    return out


if __name__ == "__main__":
    main()
    sys.exit(0)
