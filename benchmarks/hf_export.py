"""A trained byte-level model, exported, continues a prompt in ``transformers`` exactly
as in distrain (issue 52's live check of the TinyShakespeare recipe).

Takes a run's config and checkpoint (``distrain train --config
configs/shakespeare_char.yaml checkpoint.dir=...``), exports it with ``distrain export
... --tokenizer bytes``, loads the result with ``transformers.AutoModelForCausalLM`` and
``AutoTokenizer`` (PyTorch, CPU), and compares the greedy continuation of an 8-byte
prompt to the full context (``generate(do_sample=False)``) with distrain's own
(``examples.lm.train.generate``, temperature 0), and the logits of the whole window.

Usage (where PyTorch and transformers are installed: the ``bench`` extra):
  python -m benchmarks.hf_export --config configs/shakespeare_char.yaml \\
      --checkpoint /tmp/shakes/ckpt

Writes ``benchmarks/results/hf_export.json``: both continuations, whether they are equal,
the largest logit difference relative to the largest logit, and the versions.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/shakespeare_char.yaml")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--prompt", default="JULIET:\n")
    p.add_argument("--json", default=os.path.join(HERE, "results", "hf_export.json"))
    args = p.parse_args(argv)
    import jax
    import torch
    import transformers

    import distrain as dt
    from examples.lm.train import generate

    exported = tempfile.mkdtemp(prefix="hf-export-")
    t0 = time.time()
    subprocess.run(
        [sys.executable, "-m", "distrain.cli", "export", "--config", args.config,
         "--checkpoint", args.checkpoint, "--to", "hf", exported, "--tokenizer", "bytes"],
        check=True, cwd=ROOT,
    )  # fmt: skip
    export_s = time.time() - t0
    model = dt.models.from_pretrained(exported)
    cfg = model.config
    prompt = args.prompt.encode()
    ours = generate(
        model.apply_fn, model.params, prompt, num_bytes=cfg.seq_len - len(prompt),
        seq_len=cfg.seq_len,
    )  # fmt: skip
    hf = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    assert ids[0].tolist() == list(prompt), "the byte tokenizer does not map bytes to ids"
    with torch.no_grad():
        out = hf.generate(
            ids, do_sample=False, max_length=cfg.seq_len, pad_token_id=0,
            attention_mask=torch.ones_like(ids),
        )  # fmt: skip
        theirs_logits = hf(out).logits.numpy()
    theirs = bytes(out[0].tolist())
    ours_logits = np.asarray(jax.jit(model.apply_fn)(model.params, np.asarray(out)))
    rel = float(np.abs(ours_logits - theirs_logits).max() / np.abs(theirs_logits).max())
    text = tokenizer.decode(out[0])
    result = {
        "command": "python -m benchmarks.hf_export --config "
        f"{args.config} --checkpoint CHECKPOINT_DIR",
        "config": args.config,
        "prompt": args.prompt,
        "distrain_continuation": ours.decode(errors="replace"),
        "transformers_continuation": theirs.decode(errors="replace"),
        "transformers_decoded_text": text,
        "greedy_equal": ours == theirs,
        "logits_max_abs_diff_over_max_logit": rel,
        "export_s": round(export_s, 2),
        "versions": {
            "jax": jax.__version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
    }
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print(json.dumps(result, indent=2))
    return 0 if result["greedy_equal"] and rel < 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
