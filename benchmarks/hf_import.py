"""Import of a ~1 GB Llama-layout checkpoint: time and host memory, 1 and 2 processes.

Writes a float32 Llama checkpoint with ``safetensors`` from NumPy (4 files and an index;
random weights), then imports it with ``dt.models.from_pretrained`` in fresh processes:
one process of one device, and two processes of one device each with the parameters
split over both (``{"fsdp": 2}``: each process reads and holds half). Each process
records its resident memory after ``import distrain`` (``baseline_rss_bytes``), its peak
(``peak_rss_bytes``, the kernel's high-water mark), the bytes its devices hold, and the
time to import and to export back (``save_pretrained``). Where PyTorch and transformers
are installed, ``transformers.AutoModelForCausalLM.from_pretrained`` of the same files is
timed beside it.

Target per row: ``peak_rss_bytes - baseline_rss_bytes <= 1.3 x device_bytes`` (no host
holds the whole model; on CPU the devices' memory is the host's, so it counts once).

Usage:
  python -m benchmarks.hf_import              # ~1 GB; writes benchmarks/results/hf_import.json
  python -m benchmarks.hf_import --layers 1 --hidden 256 --vocab 1024 --json /tmp/x.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _rss(field: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process, in bytes (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def write_checkpoint(directory: str, layers: int, hidden: int, vocab: int, files: int) -> int:
    """A Llama checkpoint of random float32 weights in ``files`` files and an index;
    returns its bytes. Tensors are made and written a file at a time."""
    from safetensors.numpy import save_file

    heads, kv, inter = max(hidden // 128, 2), max(hidden // 512, 1), int(hidden * 2.75)
    head_dim = hidden // heads
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        }
    shapes["model.norm.weight"] = (hidden,)
    names = list(shapes)
    total = sum(int(np.prod(s)) * 4 for s in shapes.values())
    per_file, groups, size = total / files, [[]], 0
    for n in names:
        if groups[-1] and size >= per_file * len(groups):
            groups.append([])
        groups[-1].append(n)
        size += int(np.prod(shapes[n])) * 4
    rng = np.random.default_rng(0)
    weight_map = {}
    for k, group in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {n: (rng.standard_normal(shapes[n], np.float32) * 0.02) for n in group}
        save_file(tensors, os.path.join(directory, fname), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(group, fname)
        del tensors
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": head_dim, "vocab_size": vocab,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "hidden_act": "silu",
        "tie_word_embeddings": True, "attention_bias": False, "attention_dropout": 0.0,
        "mlp_bias": False, "pretraining_tp": 1,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "dtype": "float32",
    }  # fmt: skip
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return total


def worker(directory: str, out: str) -> int:
    """One process of a row: import, measure, export; process 0 writes the row."""
    import jax

    import distrain as dt

    n = int(os.environ.get("DISTRAIN_NUM_PROCESSES", "1"))
    # The backend (and jax.distributed) up before the baseline: not the import's memory.
    strategy = (
        dt.OneDeviceStrategy(jax.devices()[0])
        if n == 1
        else dt.MultiWorkerMirroredStrategy(devices_per_replica={"fsdp": n})
    )
    baseline = _rss("VmRSS")
    t0 = time.perf_counter()
    model = dt.models.from_pretrained(directory, strategy=strategy)
    jax.block_until_ready(model.params)
    import_s = time.perf_counter() - t0
    peak = _rss("VmHWM")
    device_bytes = sum(
        s.data.nbytes for x in jax.tree.leaves(model.params) for s in x.addressable_shards
    )
    exported = tempfile.mkdtemp(prefix="hf-export-")
    t1 = time.perf_counter()
    dt.models.save_pretrained(exported, model.params, model)
    export_s = time.perf_counter() - t1
    shutil.rmtree(exported, ignore_errors=True)
    if jax.process_index() == 0:
        row = {
            "processes": n,
            "import_s": round(import_s, 3),
            "peak_rss_bytes": peak,
            "baseline_rss_bytes": baseline,
            "device_bytes": device_bytes,
            "peak_minus_baseline_over_device_bytes": round((peak - baseline) / device_bytes, 3),
            "export_s": round(export_s, 3),
        }
        with open(out, "w") as f:
            json.dump(row, f)
    return 0


def _run_row(directory: str, processes: int) -> dict:
    from distrain._src.cluster.launch import free_port

    out = tempfile.mktemp(suffix=".json")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTRAIN_")}
    env |= {"JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    procs = []
    for i in range(processes):
        extra = (
            {
                "DISTRAIN_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
                "DISTRAIN_NUM_PROCESSES": str(processes),
                "DISTRAIN_PROCESS_ID": str(i),
            }
            if processes > 1
            else {}
        )
        cmd = [sys.executable, "-m", "benchmarks.hf_import", "--worker", directory, out]
        procs.append(subprocess.Popen(cmd, env={**env, **extra}, cwd=ROOT))
    for p in procs:
        if p.wait(timeout=900):
            raise RuntimeError(f"a worker of the {processes}-process row exited {p.returncode}")
    with open(out) as f:
        row = json.load(f)
    os.remove(out)
    return row


def _transformers_s(directory: str) -> float | None:
    code = (
        "import time, torch, transformers; t = time.perf_counter(); "
        "transformers.AutoModelForCausalLM.from_pretrained(__import__('sys').argv[1]); "
        "print(time.perf_counter() - t)"
    )
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return None
    out = subprocess.run(
        [sys.executable, "-c", code, directory], capture_output=True, text=True, check=True
    )
    return round(float(out.stdout.split()[-1]), 3)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", nargs=2, metavar=("DIR", "OUT"), help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--json", default=os.path.join(HERE, "results", "hf_import.json"))
    args = p.parse_args(argv)
    if args.worker:
        return worker(*args.worker)
    directory = tempfile.mkdtemp(prefix="hf-import-")
    try:
        total = write_checkpoint(directory, args.layers, args.hidden, args.vocab, args.files)
        theirs = _transformers_s(directory)
        rows = []
        for processes in (1, 2):
            row = _run_row(directory, processes)
            row["transformers_from_pretrained_s"] = theirs
            row["meets_target"] = row["peak_minus_baseline_over_device_bytes"] <= 1.3
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    result = {
        "command": "python -m benchmarks.hf_import"
        + ("" if argv is None or not argv else " " + " ".join(argv)),
        "checkpoint_bytes": total,
        "layout": f"llama, {args.layers} layers x hidden {args.hidden}, vocab {args.vocab}, "
        f"float32, {args.files} files + index",
        "target": "peak_rss_bytes - baseline_rss_bytes <= 1.3 x device_bytes, per row",
        "rows": rows,
    }
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    return 0  # the target is recorded per row (a toy-sized run cannot meet it)


if __name__ == "__main__":
    sys.exit(main())
