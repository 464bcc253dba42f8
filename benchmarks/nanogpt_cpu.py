"""nanoGPT's CPU recipe step in distrain, in a bare ``jax.jit`` loop and in PyTorch eager.

The recipe is ``configs/shakespeare_char.yaml`` (karpathy/nanoGPT's "I only have a
macbook" run: 4 layers x 4 heads x 128, block 64, batch 12, AdamW b2 0.99, weight decay
0.1 on matrices, clipping 1.0, warmup + cosine schedule, dropout 0). Three loops train the
same model on the same random byte batches:

* ``trainer_fit``: ``dt.Trainer(OneDeviceStrategy, examples.lm.train.train_step).fit``
  with the optimizer the config builds (``build_optimizer``), timed by
  ``dt.callbacks.Throughput`` between the Trainer's metric syncs (compilation excluded);
* ``jax_jit``: the floor: ``jax.jit(step, donate_argnums=0)`` with the same model,
  optimizer and donation, the token-mean loss written directly;
* ``torch_eager`` (when PyTorch is installed): the same GPT written in PyTorch as nanoGPT
  writes its model (learned positions, pre-LN blocks, ``F.scaled_dot_product_attention``
  causal, GELU MLP 4x, the head tied to the token embedding, biases as distrain's model
  has them), ``torch.optim.AdamW`` with nanoGPT's CPU arguments (not fused: nanoGPT
  fuses on CUDA only), ``clip_grad_norm_`` and the schedule set per step, on the same
  cores (``torch.get_num_threads()``).

Rounds are interleaved (the order rotates), so a slow spell of a shared machine hits each
loop alike; reported: the median ms/step of each and the median of the per-round ratios.
Then a breakdown of the JAX step, each part ``jax.jit``-ed on its own at the recipe's
shapes: forward, forward + backward, the optimizer update; per component (attention,
layer norm, GELU, the MLP's and QKV's matmuls, the tied head with its loss, the
embedding), forward and forward + backward, beside the same component in PyTorch; and
the compiled step's HLO ops by category from ``jax.profiler`` (XLA:CPU's thunks).

With ``--torch-device cuda`` and the GPU recipe's shapes as overrides (docs/performance.md,
"Measuring on a GPU"), JAX runs on the GPU and PyTorch beside it on CUDA, with fused AdamW
and TF32 matmuls as XLA's float32 default.

Usage:
  python -m benchmarks.nanogpt_cpu                 # full: ~3-5 min on 2 cores
  python -m benchmarks.nanogpt_cpu --toy           # a few steps (the smoke test)
  python -m benchmarks.nanogpt_cpu --no-torch      # the JAX loops only

Writes ``benchmarks/results/nanogpt_cpu.json`` (``--out``) with the command, the machine
(CPU model, cores, load average) and the versions.
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import gzip
import json
import math
import os
import platform
import re
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # examples/ is importable from the repository root

import distrain as dt  # noqa: E402
from benchmarks.loops import Forever  # noqa: E402
from distrain._src.train.import_paths import resolve_callable  # noqa: E402
from distrain._src.train.optimizer import build_optimizer  # noqa: E402
from distrain._src.train.run import _init_model  # noqa: E402
from distrain._src.train.state import TrainState  # noqa: E402
from distrain.config import load_config  # noqa: E402

CONFIG = ROOT / "configs" / "shakespeare_char.yaml"
OUT = ROOT / "benchmarks" / "results" / "nanogpt_cpu.json"
NUM_STAGED = 8  # distinct batches cycled through


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch


# ------------------------------------------------------------------------------ recipe


class Recipe:
    """The config's model, optimizer and shapes, and a few random byte batches."""

    def __init__(self, config: Path, overrides: list[str]) -> None:
        self.cfg = load_config(config, overrides)
        kw = self.cfg.model.kwargs
        self.vocab, self.seq_len = int(kw["vocab_size"]), int(kw["seq_len"])
        self.d_model, self.n_layers, self.n_heads = kw["d_model"], kw["n_layers"], kw["n_heads"]
        self.batch = self.cfg.data.global_batch_size
        self.model_fn = resolve_callable(self.cfg.model.fn, "model.fn")
        self.train_fn = resolve_callable(self.cfg.train.train_step, "train.train_step")
        # run_steps: the schedule's checks only (a toy run still builds the full recipe).
        self.tx, self.schedule = build_optimizer(self.cfg.optimizer, run_steps=self.cfg.train.steps)
        rng = np.random.default_rng(0)
        shape = (self.batch, self.seq_len + 1)
        self.batches = [
            {"tokens": rng.integers(0, self.vocab, shape, dtype=np.uint8)}
            for _ in range(NUM_STAGED)
        ]
        self._init: tuple[Callable[..., jax.Array], Any, TrainState] | None = None

    def init(self) -> tuple[Callable[..., jax.Array], Any, TrainState]:
        """``(apply_fn, params, state)`` as ``distrain train`` builds them (built once;
        each call returns fresh copies, as the loops donate theirs)."""
        if self._init is None:
            apply_fn, params = _init_model(
                self.model_fn, jax.random.key(self.cfg.seed), **self.cfg.model.kwargs
            )
            tx = self.tx
            state = jax.jit(lambda p, k: TrainState.create(params=p, tx=tx, rng=k))(
                params, jax.random.PRNGKey(self.cfg.seed + 1)
            )
            self._init = (apply_fn, params, state)
        apply_fn, params, state = self._init
        return apply_fn, jax.tree.map(jnp.copy, params), jax.tree.map(jnp.copy, state)

    def lr(self, step: int) -> float:
        return (
            float(self.schedule(step))
            if self.schedule is not None
            else self.cfg.optimizer.learning_rate
        )


def _loss(apply_fn: Callable[..., jax.Array], params: Any, tokens: jax.Array) -> jax.Array:
    tokens = tokens.astype(jnp.int32)
    logits = apply_fn(params, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


class JaxJit:
    """The floor: one ``jax.jit`` step, parameters and optimizer state donated."""

    name = "jax_jit"

    def __init__(self, r: Recipe) -> None:
        apply_fn, params, _ = r.init()
        tx = r.tx

        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def step(params: Any, opt_state: Any, tokens: jax.Array) -> tuple[Any, Any, jax.Array]:
            loss, grads = jax.value_and_grad(functools.partial(_loss, apply_fn))(params, tokens)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        self.step = step
        self.params, self.opt_state = params, jax.jit(tx.init)(params)
        self.batches = [b["tokens"] for b in r.batches]

    def time(self, steps: int) -> float:
        p, s, step, batches = self.params, self.opt_state, self.step, self.batches
        jax.block_until_ready((p, s))
        start = time.perf_counter()
        for i in range(steps):
            p, s, _ = step(p, s, batches[i % NUM_STAGED])
        jax.block_until_ready((p, s))
        self.params, self.opt_state = p, s
        return time.perf_counter() - start


class TrainerFit:
    """``Trainer.fit`` on ``OneDeviceStrategy`` with the config's step and optimizer."""

    name = "trainer_fit"

    def __init__(self, r: Recipe) -> None:
        apply_fn, _, state = r.init()
        self.r = r
        self.strategy = dt.OneDeviceStrategy(jax.devices()[0])
        self.step = functools.partial(r.train_fn, apply_fn=apply_fn)
        self.state = state
        self.data = Forever(r.batches)

    def time(self, steps: int) -> float:
        # The first window (fit's start-up) only starts Throughput's clock; the next
        # `steps` steps, in 4 windows (3 host syncs inside), are timed.
        k = max(1, steps // 4)
        steps -= steps % k
        tp = dt.callbacks.Throughput(self.r.batch)
        trainer = dt.Trainer(self.strategy, self.step, log_every=k, callbacks=[tp])
        self.state, _ = trainer.fit(self.state, self.data, steps=k + steps)
        summary = tp.summary()
        assert summary is not None and summary["steps"] == steps, summary
        return summary["seconds"] * steps / summary["steps"]


# ----------------------------------------------------------------------------- PyTorch


def torch_gpt(r: Recipe, torch: Any) -> Any:
    """nanoGPT's architecture at the recipe's shapes, in PyTorch (written here)."""
    nn, F = torch.nn, torch.nn.functional
    d, h, L, V, T = r.d_model, r.n_heads, r.n_layers, r.vocab, r.seq_len

    class SelfAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(d, 3 * d)
            self.out = nn.Linear(d, d)

        def forward(self, x: Any) -> Any:
            b, t, _ = x.shape
            q, k, v = self.qkv(x).view(b, t, 3, h, d // h).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, D]
            return self.out(y.transpose(1, 2).reshape(b, t, d))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1, self.attn = nn.LayerNorm(d), SelfAttention()
            self.norm2 = nn.LayerNorm(d)
            self.fc, self.act, self.proj = nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)

        def forward(self, x: Any) -> Any:
            x = x + self.attn(self.norm1(x))
            return x + self.proj(self.act(self.fc(self.norm2(x))))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(V, d)
            self.pos = nn.Embedding(T, d)
            self.blocks = nn.ModuleList([Block() for _ in range(L)])
            self.norm = nn.LayerNorm(d)
            self.head = nn.Linear(d, V, bias=False)
            self.head.weight = self.tok.weight  # tied, as GPT-2
            for name, p in self.named_parameters():
                if name.endswith("bias"):
                    nn.init.zeros_(p)
                elif p.dim() >= 2:
                    std = (
                        0.02 / math.sqrt(2 * L)
                        if name.endswith(("out.weight", "proj.weight"))
                        else 0.02
                    )
                    nn.init.normal_(p, 0.0, std)

        def forward(self, idx: Any, targets: Any) -> Any:
            t = idx.shape[1]
            x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
            for block in self.blocks:
                x = block(x)
            logits = self.head(self.norm(x))
            return F.cross_entropy(logits.view(-1, V), targets.reshape(-1))

    torch.manual_seed(0)
    return GPT()


class TorchEager:
    """nanoGPT's training loop on CPU: eager, float32, AdamW (not fused), clipping."""

    name = "torch_eager"

    def __init__(self, r: Recipe, torch: Any, device: str = "cpu") -> None:
        self.torch, self.r, self.device = torch, r, device
        torch.set_num_threads(_cores())  # the cores this process may run on, as XLA:CPU
        if device != "cpu":
            # XLA multiplies float32 on GPUs in TF32 by default; PyTorch does not: same maths.
            torch.set_float32_matmul_precision("high")
        self.model = torch_gpt(r, torch).to(device)
        kw = dict(r.cfg.optimizer.kwargs)
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        self.opt = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": kw.get("weight_decay", 1e-4)},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=r.lr(0),
            betas=(kw.get("b1", 0.9), kw.get("b2", 0.999)),
            eps=kw.get("eps", 1e-8),
            fused=device != "cpu",  # nanoGPT fuses AdamW on CUDA
        )
        self.clip = r.cfg.optimizer.clip_global_norm
        self.batches = [
            torch.from_numpy(b["tokens"].astype(np.int64)).to(device) for b in r.batches
        ]
        self.it = 0

    def train_step(self, tokens: Any) -> Any:
        for group in self.opt.param_groups:
            group["lr"] = self.r.lr(self.it)
        loss = self.model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        if self.clip is not None:
            self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.it += 1
        return loss

    def time(self, steps: int) -> float:
        start = time.perf_counter()
        for i in range(steps):
            loss = self.train_step(self.batches[i % NUM_STAGED])
        loss.item()  # waits for the device (eager on CPU is synchronous); nanoGPT logs it
        return time.perf_counter() - start


# ------------------------------------------------------------------------ interleaving


def interleave(
    loops: list[Any], steps: int, rounds: int, log: Callable[[str], None]
) -> dict[str, Any]:
    for loop in loops:
        t0 = time.perf_counter()
        loop.time(max(4, steps // 4))  # compile and warm up
        log(f"{loop.name}: compiled and warmed up in {time.perf_counter() - t0:.1f} s")
    if steps >= 4:
        steps -= steps % (steps // 4)  # what TrainerFit times: a multiple of its sync interval
    ms: dict[str, list[float]] = {loop.name: [] for loop in loops}
    for i in range(rounds):
        order = loops[i % len(loops) :] + loops[: i % len(loops)]
        for loop in order:
            ms[loop.name].append(1e3 * loop.time(steps) / steps)
        log(
            f"round {i + 1}/{rounds}: "
            + ", ".join(f"{n} {v[-1]:.1f}" for n, v in ms.items())
            + " ms/step"
        )
    names = list(ms)
    ratios = {}
    for a in names:
        for b in names:
            if a != b and (a, b) in RATIOS:
                ratios[f"{a} / {b}"] = statistics.median(
                    x / y for x, y in zip(ms[a], ms[b], strict=True)
                )
    return {
        "steps_per_round": steps,
        "rounds": rounds,
        "ms_per_step": {n: statistics.median(v) for n, v in ms.items()},
        "ms_per_step_rounds": ms,
        "ratios": ratios,
    }


RATIOS = {
    ("trainer_fit", "jax_jit"),
    ("trainer_fit", "torch_eager"),
    ("jax_jit", "torch_eager"),
}


# --------------------------------------------------------------------------- breakdown


def _time_calls(
    fn: Callable[[], Any], calls: int, repeats: int, sync: Callable[[Any], Any]
) -> float:
    """Median over ``repeats`` of the mean ms per call of ``calls`` calls."""
    sync(fn())
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            res = fn()
        sync(res)
        out.append(1e3 * (time.perf_counter() - t0) / calls)
    return statistics.median(out)


def _jt(fn: Callable[[], Any], calls: int, repeats: int) -> float:
    return _time_calls(fn, calls, repeats, jax.block_until_ready)


def step_parts(r: Recipe, calls: int, repeats: int) -> dict[str, float]:
    """The whole model's forward, forward + backward, optimizer update, each ``jax.jit``."""
    apply_fn, params, _ = r.init()
    tx = r.tx
    tokens = jnp.asarray(r.batches[0]["tokens"])
    loss = functools.partial(_loss, apply_fn)
    fwd = jax.jit(loss)
    grad = jax.jit(jax.grad(loss))
    grads = grad(params, tokens)
    opt_state = jax.jit(tx.init)(params)

    @jax.jit
    def update(grads: Any, opt_state: Any, params: Any) -> Any:
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    out = {
        "forward (loss)": _jt(lambda: fwd(params, tokens), calls, repeats),
        "forward + backward": _jt(lambda: grad(params, tokens), calls, repeats),
        "optimizer update (clip + adamw)": _jt(
            lambda: update(grads, opt_state, params), calls, repeats
        ),
    }
    out["backward (difference)"] = out["forward + backward"] - out["forward (loss)"]
    return out


def components(r: Recipe, torch: Any, calls: int, repeats: int) -> list[dict[str, Any]]:
    """Each part of one block (and the head, the embedding) at the recipe's shapes:
    forward and forward + backward (``jax.grad`` of the output's sum against the inputs
    and weights; ``.sum().backward()`` in PyTorch), times how often the step runs it."""
    B, T, D, H, V, L = r.batch, r.seq_len, r.d_model, r.n_heads, r.vocab, r.n_layers
    Dh = D // H
    rng = np.random.default_rng(1)

    def arr(*shape: int, scale: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    x = arr(B, T, D, scale=1.0)
    q, k, v = arr(B, T, H, Dh, scale=1.0), arr(B, T, H, Dh, scale=1.0), arr(B, T, H, Dh, scale=1.0)
    h4 = arr(B, T, 4 * D, scale=1.0)
    w_qkv, w_fc, w_proj, emb = arr(D, 3 * D), arr(D, 4 * D), arr(4 * D, D), arr(V, D)
    gamma, beta = np.ones(D, np.float32), np.zeros(D, np.float32)
    ids = rng.integers(0, V, (B, T)).astype(np.int32)

    def layer_norm(x: jax.Array, g: jax.Array, b: jax.Array) -> jax.Array:
        mean = x.mean(-1, keepdims=True)
        var = jnp.square(x - mean).mean(-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + 1e-6) * g + b

    def head(x: jax.Array, e: jax.Array) -> jax.Array:
        logits = x @ e.T
        return optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(ids)).mean()

    jax_parts: dict[str, tuple[Callable[..., jax.Array], tuple[np.ndarray, ...], int]] = {
        "attention (jax.nn.dot_product_attention, causal)": (
            lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
            (q, k, v),
            L,
        ),
        "layer norm": (layer_norm, (x, gamma, beta), 2 * L + 1),
        "GELU (tanh) [B,T,4D]": (jax.nn.gelu, (h4,), L),
        "QKV matmul [BT,D]x[D,3D]": (lambda x, w: x @ w, (x, w_qkv), L),
        "MLP fc matmul [BT,D]x[D,4D]": (lambda x, w: x @ w, (x, w_fc), L),
        "MLP proj matmul [BT,4D]x[4D,D]": (lambda h, w: h @ w, (h4, w_proj), L),
        "tied head matmul + cross-entropy": (head, (x, emb), 1),
        "embedding gather": (lambda e: e[jnp.asarray(ids)], (emb,), 1),
    }
    rows = []
    for name, (fn, args, times) in jax_parts.items():
        jargs = tuple(jnp.asarray(a) for a in args)
        f = jax.jit(fn)
        n_in = len(jargs)
        g = jax.jit(jax.grad(lambda *a, fn=fn: fn(*a).sum(), argnums=tuple(range(n_in))))
        row = {
            "part": name,
            "per_step": times,
            "jax_fwd_ms": _jt(lambda f=f, a=jargs: f(*a), calls, repeats),
            "jax_fwd_bwd_ms": _jt(lambda g=g, a=jargs: g(*a), calls, repeats),
        }
        rows.append(row)
    if torch is not None:
        F = torch.nn.functional

        def t(a: np.ndarray) -> Any:
            return torch.from_numpy(a.copy()).requires_grad_(a.dtype == np.float32)

        tids = torch.from_numpy(ids.astype(np.int64))
        torch_parts = {
            "attention (jax.nn.dot_product_attention, causal)": (
                lambda q, k, v: F.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
                ),
                (q, k, v),
            ),
            "layer norm": (lambda x, g, b: F.layer_norm(x, (D,), g, b), (x, gamma, beta)),
            "GELU (tanh) [B,T,4D]": (lambda h: F.gelu(h, approximate="tanh"), (h4,)),
            "QKV matmul [BT,D]x[D,3D]": (lambda x, w: x @ w, (x, w_qkv)),
            "MLP fc matmul [BT,D]x[D,4D]": (lambda x, w: x @ w, (x, w_fc)),
            "MLP proj matmul [BT,4D]x[4D,D]": (lambda h, w: h @ w, (h4, w_proj)),
            "tied head matmul + cross-entropy": (
                lambda x, e: F.cross_entropy((x @ e.T).view(-1, V), tids.view(-1)),
                (x, emb),
            ),
            "embedding gather": (lambda e: F.embedding(tids, e), (emb,)),
        }
        for row in rows:
            fn, args = torch_parts[row["part"]]
            targs = tuple(t(a) for a in args)

            def fwd(fn: Any = fn, a: tuple[Any, ...] = targs) -> Any:
                with torch.no_grad():
                    return fn(*a)

            def fwd_bwd(fn: Any = fn, a: tuple[Any, ...] = targs) -> Any:
                for p in a:
                    p.grad = None
                fn(*a).sum().backward()
                return a[0].grad

            row["torch_fwd_ms"] = _time_calls(fwd, calls, repeats, lambda _: None)
            row["torch_fwd_bwd_ms"] = _time_calls(fwd_bwd, calls, repeats, lambda _: None)
    return rows


def torch_parts(r: Recipe, torch: Any, calls: int, repeats: int) -> dict[str, float]:
    """PyTorch's forward, forward + backward, optimizer step (clip + AdamW), on their own."""
    loop = TorchEager(r, torch)
    tokens = loop.batches[0]
    model = loop.model

    def fwd() -> Any:
        with torch.no_grad():
            return model(tokens[:, :-1], tokens[:, 1:])

    def fwd_bwd() -> Any:
        model.zero_grad(set_to_none=True)
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        return loss

    fwd_bwd()

    def update() -> Any:
        torch.nn.utils.clip_grad_norm_(model.parameters(), loop.clip or 1.0)
        loop.opt.step()

    out = {
        "forward (loss)": _time_calls(fwd, calls, repeats, lambda _: None),
        "forward + backward": _time_calls(fwd_bwd, calls, repeats, lambda _: None),
        "optimizer update (clip + adamw)": _time_calls(update, calls, repeats, lambda _: None),
    }
    out["backward (difference)"] = out["forward + backward"] - out["forward (loss)"]
    return out


_CATEGORIES = (  # (category, pattern over the HLO op's name), first match wins
    ("matmul (dot)", r"^dot|custom-call|matmul|gemm"),
    ("YNNPACK fusion", r"^ynn_fusion"),
    ("XNNPACK fusion", r"^xnn_fusion"),
    ("oneDNN fusion", r"onednn"),
    ("reduction fusion", r"reduce"),
    ("transpose / copy", r"transpose|copy|bitcast_fusion"),
    ("broadcast", r"broadcast"),
    ("scatter / gather", r"scatter|gather|dynamic"),
    ("elementwise fusion", r"fusion|exponential|multiply|add|tanh|select|divide"),
)


def profile_ops(loop: JaxJit, steps: int) -> dict[str, Any]:
    """The bare loop's compiled step under ``jax.profiler``: XLA:CPU's thunks (one per
    HLO op or fusion) summed per op and per category, per step."""
    p, s, step = loop.params, loop.opt_state, loop.step
    tokens = jnp.asarray(loop.batches[0])
    jax.block_until_ready((p, s))
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d, create_perfetto_trace=True)
        t0 = time.perf_counter()
        for _ in range(steps):
            p, s, _ = step(p, s, tokens)
        jax.block_until_ready(p)
        wall = time.perf_counter() - t0
        loop.params, loop.opt_state = p, s
        jax.profiler.stop_trace()
        files = sorted(glob.glob(os.path.join(d, "**", "*.trace.json.gz"), recursive=True))
        if not files:
            return {"error": "jax.profiler wrote no perfetto trace"}
        with gzip.open(files[-1]) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    skip = re.compile(r"^\$|ThunkExecutor|ThreadPool|PjRt|Pjit|Await|Execute", re.I)
    per_op: collections.Counter[str] = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and not skip.search(e.get("name", "")):
            per_op[e["name"]] += e.get("dur", 0) / 1e3 / steps
    per_cat: collections.Counter[str] = collections.Counter()
    for name, ms in per_op.items():
        cat = next((c for c, pat in _CATEGORIES if re.search(pat, name)), "other")
        per_cat[cat] += ms
    return {
        "steps": steps,
        "wall_ms_per_step_under_profiler": 1e3 * wall / steps,
        "ops_ms_per_step": sum(per_op.values()),
        "by_category_ms": dict(per_cat.most_common()),
        "top_ops_ms": dict((k, round(v, 3)) for k, v in per_op.most_common(15)),
    }


# -------------------------------------------------------------------------------- main


def _cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))  # taskset -c 0 python -m ...: 1
    return os.cpu_count() or 1


def machine() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    torch = _torch()
    return {
        "cpu": cpu,
        "cores": _cores(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jax.lib.__version__ if hasattr(jax.lib, "__version__") else None,
        "torch": torch.__version__ if torch is not None else None,
        "torch_threads": torch.get_num_threads() if torch is not None else None,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "backend": jax.default_backend(),
    }


def table(result: dict[str, Any]) -> str:
    m = result["machine"]
    t = result["timing"]
    lines = [
        f"nanoGPT's recipe ({result['recipe']}, JAX on {m['backend']}, PyTorch on "
        f"{result.get('torch_device', 'cpu')}), {m['cores']} cores of {m['cpu']}, "
        f"load {m['load_average'][0]:.1f}"
        if m["load_average"]
        else "",
        f"{t['rounds']} interleaved rounds of {t['steps_per_round']} steps",
        f"{'loop':<14} {'ms/step':>9}",
    ]
    for name, ms in t["ms_per_step"].items():
        lines.append(f"{name:<14} {ms:>9.2f}")
    for name, v in t["ratios"].items():
        lines.append(f"{name:<28} {v:.3f}x (median of per-round ratios)")
    if "step_parts" in result:
        lines.append("")
        lines.append(f"{'step part (each jax.jit)':<34} {'JAX ms':>8} {'torch ms':>9}")
        tp = result.get("torch_step_parts") or {}
        for name, ms in result["step_parts"].items():
            tv = f"{tp[name]:>9.2f}" if name in tp else f"{'-':>9}"
            lines.append(f"{name:<34} {ms:>8.2f} {tv}")
    if "components" in result:
        lines.append("")
        lines.append(
            f"{'component (x per step)':<52} {'JAX fwd':>8} {'JAX f+b':>8} "
            f"{'pt fwd':>8} {'pt f+b':>8}"
        )
        for row in result["components"]:
            pt = (
                f"{row['torch_fwd_ms']:>8.3f} {row['torch_fwd_bwd_ms']:>8.3f}"
                if "torch_fwd_ms" in row
                else f"{'-':>8} {'-':>8}"
            )
            lines.append(
                f"{row['part'][:46] + ' x' + str(row['per_step']):<52} "
                f"{row['jax_fwd_ms']:>8.3f} {row['jax_fwd_bwd_ms']:>8.3f} {pt}"
            )
    if "profile" in result and "by_category_ms" in result["profile"]:
        p = result["profile"]
        lines.append("")
        lines.append(
            f"XLA:CPU thunks per step (jax.profiler): {p['ops_ms_per_step']:.2f} ms of "
            f"{p['wall_ms_per_step_under_profiler']:.2f} ms wall"
        )
        for cat, ms in p["by_category_ms"].items():
            lines.append(f"  {cat:<24} {ms:>8.2f} ms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default=str(CONFIG))
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. data.global_batch_size=8")
    p.add_argument("--steps", type=int, default=40, help="timed steps per loop per round")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    p.add_argument("--toy", action="store_true", help="a few steps, no step parts: a smoke run")
    p.add_argument("--no-torch", action="store_true", help="leave PyTorch out")
    p.add_argument("--no-breakdown", action="store_true", help="the loops only")
    p.add_argument(
        "--omp-wait-policy",
        default=None,
        help="OMP_WAIT_POLICY for PyTorch's OpenMP threads (e.g. PASSIVE on a shared machine: "
        "with its default spinning, 2 threads of torch eager ran 10-30x slower under a load "
        "of 3-6 on 2 cores); default: leave it as set",
    )
    p.add_argument(
        "--torch-device",
        default="cpu",
        help="where the PyTorch arm runs (cuda: beside JAX's GPU; the breakdown is CPU only)",
    )
    p.add_argument("--out", default=str(OUT), help="the JSON result ('' to write none)")
    args = p.parse_args(argv)
    if args.omp_wait_policy:
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy  # before torch loads libgomp
    if args.toy:
        args.steps, args.rounds = 4, 1
    calls, repeats = (1, 1) if args.toy else (10, 5)
    torch = None if args.no_torch else _torch()
    r = Recipe(Path(args.config), args.overrides)
    log = functools.partial(print, flush=True)
    bare = JaxJit(r)
    loops: list[Any] = [TrainerFit(r), bare]
    if torch is not None:
        loops.append(TorchEager(r, torch, args.torch_device))
    else:
        log("PyTorch is not installed (pip install -e .[bench]): the torch arm is skipped")
    result: dict[str, Any] = {
        "command": "python -m benchmarks.nanogpt_cpu "
        + shlex.join(sys.argv[1:] if argv is None else argv),
        "recipe": os.path.relpath(args.config, ROOT),
        "shapes": {
            "vocab_size": r.vocab,
            "seq_len": r.seq_len,
            "d_model": r.d_model,
            "n_layers": r.n_layers,
            "n_heads": r.n_heads,
            "batch": r.batch,
        },
        "machine": machine(),
        "torch_device": args.torch_device,
    }
    result["timing"] = interleave(loops, args.steps, args.rounds, log)
    if not args.no_breakdown:
        if not args.toy:  # three more compilations of the model: not in the smoke run
            result["step_parts"] = step_parts(r, calls, repeats)
            if torch is not None:
                result["torch_step_parts"] = torch_parts(r, torch, calls, repeats)
        result["components"] = components(r, torch, calls, repeats)
        result["profile"] = profile_ops(bare, 2 if args.toy else 10)
    result["machine"]["load_average_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(table(result))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        log(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
