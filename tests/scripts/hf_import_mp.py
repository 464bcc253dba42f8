"""One replica {"fsdp": 4, "tensor": 2} over 2 processes of 4 devices: imports the GPT-2
fixture (recording what this process reads of each tensor), computes its logits, and
exports it again (process 0 writes). Used by tests/test_models_hub.py.

Writes --out/reads_<process>.json ({tensor: [elements per read]}) and, on process 0,
--out/logits.npy and the export in --out/export.
"""

import argparse
import json
import os
import sys
import warnings
from collections import defaultdict

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

import distrain as dt
from distrain._src.models import safetensors_io


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--fixture", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    strategy = dt.MultiWorkerMirroredStrategy(
        devices_per_replica={"fsdp": 4, "tensor": 2}, layout=dt.models.TENSOR_PARALLEL_LAYOUT
    )
    reads = defaultdict(list)
    original = safetensors_io.Weights.read

    def read(self, name, index):
        out = original(self, name, index)
        reads[name].append(int(out.size))
        return out

    safetensors_io.Weights.read = read
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "distrain's GPT-2 applies no dropout")
        model = dt.models.from_pretrained(args.fixture, strategy=strategy)
    me = jax.process_index()
    with open(os.path.join(args.out, f"reads_{me}.json"), "w") as f:
        json.dump(reads, f)
    tokens = np.load(os.path.join(args.fixture, "reference.npz"))["tokens"]
    graphdef = model.graphdef
    logits = jax.jit(lambda q, t: nnx.merge(graphdef, q)(t))(model.params, tokens)
    logits = multihost_utils.process_allgather(logits, tiled=True)
    if me == 0:
        np.save(os.path.join(args.out, "logits.npy"), np.asarray(logits))
    dt.models.save_pretrained(os.path.join(args.out, "export"), model.params, model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
