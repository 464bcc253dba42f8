"""Generation with a KV cache: :func:`generate` for the GPT-2, Llama and Mixtral families.

One call is one compiled program (after its first call, one dispatch): the prompts'
first ``P - 1`` columns fill a preallocated key/value cache in one forward pass (the
prefill; its logits are never used, so XLA drops the output head), then a
``lax.while_loop`` feeds one token per row per step, from the last prompt token on, and
samples the next. The loop stops after ``max_new_tokens`` steps, or as soon as every row
has emitted one of ``stop_tokens``. The model runs its own ``__call__``; its attention
layers attend over the cache while ``kv_cache.decoding`` is active (``kv_cache.py``).

**Padding.** Prompts are a list of token lists, or an int array whose rows start at
column 0 (right padding) with ``lengths``. Inside, every row is *left*-aligned (its
prompt ends at the same column), so every row writes the same cache slot at each step;
padding is its own segment, masked as ``dt.nn.dot_product_attention`` masks packed
documents, and positions restart at 0 at each prompt's first token: a row generates
what it generates alone. The output holds the new tokens only.

**Sampling.** ``temperature=0`` is greedy (``argmax``); above 0 the logits are divided
by it, cut to the ``top_k`` largest, then to the smallest set whose probability reaches
``top_p`` (nucleus), as ``transformers`` applies them. Row ``r`` at step ``i`` draws with
``fold_in(fold_in(rng, r), i)``, ``r`` the row's index in the *global* batch: a prompt's
sample does not depend on the batch around it, nor on how many replicas share it.

**Under a strategy.** ``strategy=`` splits the prompts over the replicas, generates in
each (``strategy.run``) with the parameters in the strategy's layout (XLA partitions a
replica's program: FSDP gathers, tensor-parallel heads) and gathers the rows back. In
your own ``strategy.run`` step, an array of prompts is that replica's rows (global row
``replica_id * B + r``). Example: :func:`generate`'s; ``docs/evaluation.md``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from distrain._src import context
from distrain._src.models import kv_cache
from distrain._src.models.hub import Pretrained
from distrain._src.models.llama import Llama, _DecoderConfig
from distrain._src.models.mixtral import Mixtral, MixtralConfig
from distrain._src.models.transformer import Transformer
from distrain._src.models.transformer_config import LMConfig

__all__ = ["Generation", "generate"]

#: Prompt widths are rounded up to a multiple of this (within the context): prompts of
#: nearby lengths share one compiled program. Extra columns are masked padding.
WIDTH_MULTIPLE = 16


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Generation:
    """What :func:`generate` returns.

    Attributes:
      tokens: ``[B, max_new_tokens]`` int32, the new tokens of each prompt; after a row's
        stop token, ``pad_token``.
      lengths: ``[B]`` int32, the new tokens of each row, its stop token included.
    """

    tokens: jax.Array
    lengths: jax.Array


@dataclasses.dataclass(frozen=True)
class _Options:
    """What shapes the program (hashable: it keys the compiled programs)."""

    graphdef: Any
    cfg: Any
    max_new_tokens: int
    greedy: bool
    use_cache: bool


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Knobs:
    """What the program reads as values (arrays: changing them compiles nothing)."""

    temperature: Any  # float32 []
    top_k: Any  # int32 []: the vocabulary size when not given
    top_p: Any  # float32 []: 1 when not given
    stop_tokens: Any  # int32 [S], padded with -1
    pad_token: Any  # int32 []


def generate(model: Any, params: Any, prompts: Any, max_new_tokens: int, *,
             lengths: Any = None, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, stop_tokens: Sequence[int] = (),
             rng: jax.Array | None = None, pad_token: int = 0, strategy: Any = None,
             use_cache: bool = True) -> Generation:  # fmt: skip
    """Continues each prompt by up to ``max_new_tokens`` tokens (see the module docstring).

    Args:
      model: a ``dt.models.Pretrained``, a module (``dt.models.Transformer``, ``Llama``,
        ``Mixtral``, possibly with LoRA adapters), or a family config (``LMConfig``,
        ``LlamaConfig``, ``MixtralConfig``).
      params: its parameters (``nnx.State`` or pure dict), in any layout.
      prompts: a list of token-id lists, or an int array ``[B, W]`` whose rows start at
        column 0 (``lengths`` says how many ids of each row are the prompt).
      max_new_tokens: steps at most; the longest prompt plus this must fit the model's
        context (``seq_len``, ``max_position_embeddings``).
      lengths: ``[B]`` prompt lengths for an array of prompts (default: ``W`` each).
      temperature: 0: greedy; above 0: sample from ``softmax(logits / temperature)``.
      top_k: sample among the ``top_k`` likeliest tokens only (``None``: all).
      top_p: sample within the smallest set of likeliest tokens whose probability
        reaches ``top_p``, in ``(0, 1]`` (``None`` or 1: all).
      stop_tokens: ids that end a row (kept in its output; ``pad_token`` after).
      rng: a ``jax.random.key``; needed to sample, unused when greedy.
      pad_token: fills each row's output after it stopped.
      strategy: a ``dt.Strategy`` to split the prompts over its replicas (their number
        must divide the batch); ``None``: one program, here or in the caller's step.
      use_cache: ``False`` recomputes the whole window for every token instead of using
        the cache (the slow reference the cache is measured against).

    Returns:
      A :class:`Generation` (``tokens`` ``[B, max_new_tokens]``, ``lengths`` ``[B]``).

    Raises:
      ValueError: an empty prompt, a prompt longer than the context (or with
        ``max_new_tokens``, past it), ``max_new_tokens < 1``, ``top_p`` outside ``(0, 1]``,
        ``top_k < 1``, a negative temperature, sampling without ``rng``, token ids outside
        the vocabulary, a batch the strategy's replicas do not divide, a pipelined model.
      TypeError: a ``model`` that is none of the above.

    Example:
      >>> out = dt.models.generate(model, params, [[1, 2, 3], [4]], 8, temperature=0.8,
      ...                          top_p=0.95, rng=jax.random.key(0), strategy=strategy)
    """
    opts, knobs = _options(
        model, max_new_tokens, temperature, top_k, top_p, stop_tokens, pad_token, use_cache
    )
    if not opts.greedy and rng is None:
        raise ValueError(
            f"Sampling (temperature={temperature}) needs rng=jax.random.key(seed); "
            "received rng=None. Pass a key, or temperature=0 for greedy decoding."
        )
    tokens, lengths = _prompts(prompts, lengths, opts)
    if strategy is not None:
        return _on_replicas(strategy, params, tokens, lengths, knobs, rng, opts)
    return _program(params, tokens, lengths, knobs, rng, _first_row(tokens.shape[0]), opts)


# ------------------------------------------------------------------- checks (host)


def _options(model: Any, n: Any, temperature: Any, top_k: Any, top_p: Any, stops: Any,
             pad: Any, use_cache: bool) -> tuple[_Options, _Knobs]:  # fmt: skip
    graphdef, cfg = _model(model)
    vocab = cfg.vocab_size
    if not _is_int(n) or n < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1. Received: {n!r}.")
    bad = isinstance(temperature, bool) or not isinstance(temperature, int | float)
    if bad or not temperature >= 0:
        raise ValueError(
            f"temperature must be a number >= 0 (0: greedy). Received: {temperature!r}."
        )
    if top_k is not None and (not _is_int(top_k) or top_k < 1):
        raise ValueError(f"top_k must be an int >= 1, or None. Received: {top_k!r}.")
    if top_p is not None and (isinstance(top_p, bool) or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1], or None. Received: top_p={top_p!r}.")
    stops = tuple(stops)
    if not all(_is_int(s) and 0 <= s < vocab for s in stops):
        raise ValueError(
            f"stop_tokens must be token ids in [0, {vocab}) (the vocabulary). Received: {stops!r}."
        )
    if not _is_int(pad):
        raise ValueError(f"pad_token must be an int. Received: {pad!r}.")
    # Stop ids padded with -1 (no token) to a multiple of 8: a new list compiles nothing.
    stop_ids = np.full(max(8, -(-len(stops) // 8) * 8), -1, np.int32)
    stop_ids[: len(stops)] = stops
    knobs = _Knobs(
        np.asarray(max(temperature, 1e-6), np.float32),
        np.asarray(vocab if top_k is None else min(top_k, vocab), np.int32),
        np.asarray(1.0 if top_p is None else top_p, np.float32),
        stop_ids,
        np.asarray(pad, np.int32),
    )
    return _Options(graphdef, cfg, int(n), temperature == 0, bool(use_cache)), knobs


def _is_int(x: Any) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


def _model(model: Any) -> tuple[Any, Any]:
    """``(graphdef, config)`` of what ``generate`` was given."""
    if isinstance(model, Pretrained):
        graphdef, cfg = model.graphdef, model.config
    elif isinstance(model, nnx.Module):
        graphdef, cfg = nnx.graphdef(model), getattr(model, "cfg", None)
    else:
        graphdef, cfg = None, model
    if not isinstance(cfg, LMConfig | _DecoderConfig):
        raise TypeError(
            "generate's model must be a dt.models.Pretrained, a dt.models.Transformer / "
            "Llama / Mixtral module, or an LMConfig / LlamaConfig / MixtralConfig. "
            f"Received: {type(model).__name__}."
        )
    if isinstance(cfg, LMConfig) and cfg.pipeline_microbatches is not None:
        raise ValueError(
            f"generate runs a model whose blocks are a list; this LMConfig stacks them for "
            f"dt.nn.pipeline (pipeline_microbatches={cfg.pipeline_microbatches}). Export it "
            "(dt.models.save_pretrained) and import it back, which unstacks the layers."
        )
    if isinstance(cfg, LMConfig) and cfg.remat != "none":
        # Remat traces each block apart, which the cache's per-layer writes cannot cross;
        # inference keeps no activations anyway. Same parameters, another graph.
        graphdef, cfg = None, dataclasses.replace(cfg, remat="none")
    return (_graphdef(cfg) if graphdef is None else graphdef), cfg


@functools.lru_cache(maxsize=16)
def _graphdef(cfg: Any) -> Any:
    build = {LMConfig: Transformer, MixtralConfig: Mixtral}.get(type(cfg), Llama)
    return nnx.graphdef(nnx.eval_shape(lambda: build(cfg, rngs=nnx.Rngs(0))))


def _shapes(cfg: Any) -> tuple[int, int, int, int]:
    """``(layers, key/value heads, head size, context)``."""
    if isinstance(cfg, LMConfig):
        return cfg.n_layers, cfg.n_heads, cfg.head_dim, cfg.seq_len
    c = cfg
    return c.num_hidden_layers, c.num_key_value_heads, c.head_dim, c.max_position_embeddings


def _prompts(prompts: Any, lengths: Any, opts: _Options) -> tuple[Any, Any]:
    """``(tokens [B, P], lengths [B])`` int32, rows starting at column 0, checked; on the
    host also cut to the longest prompt and widened to a multiple of ``WIDTH_MULTIPLE``."""
    ctx, n = _shapes(opts.cfg)[3], opts.max_new_tokens
    if isinstance(prompts, jax.core.Tracer) or isinstance(lengths, jax.core.Tracer):
        # Inside jit or strategy.run: only the shapes can be checked.
        b, w = prompts.shape
        if w + n > ctx:
            raise ValueError(
                f"A prompt array of width {w} and max_new_tokens={n} go past the model's "
                f"context of {ctx} tokens. Narrow the array or generate fewer tokens."
            )
        full = jnp.full((b,), w, jnp.int32)
        return prompts.astype(jnp.int32), full if lengths is None else lengths.astype(jnp.int32)
    if isinstance(prompts, list | tuple):
        if lengths is not None:
            raise ValueError("lengths= goes with an array of prompts, not a list of lists.")
        rows = [np.asarray(p).reshape(-1) for p in prompts]
        lens = np.array([len(r) for r in rows], np.int64)
        tokens = np.zeros((len(rows), max(lens, default=0)), np.int64)
        for i, r in enumerate(rows):
            tokens[i, : len(r)] = r
        kinds = [r.dtype.kind for r in rows if len(r)]
    else:
        tokens = np.asarray(prompts)
        if tokens.ndim != 2:
            raise ValueError(
                "prompts must be a list of token lists or an int array [batch, width]. "
                f"Received an array of shape {tokens.shape}."
            )
        w = tokens.shape[1]
        lens = np.full(len(tokens), w) if lengths is None else np.asarray(lengths)
        if lens.shape != (len(tokens),) or lens.dtype.kind not in "iu" or (lens > w).any():
            raise ValueError(
                f"lengths must be {len(tokens)} ints <= the prompts' width {w}. Received: "
                f"{lengths!r}."
            )
        kinds = [tokens.dtype.kind]
    if not len(lens):
        raise ValueError("generate received no prompts. Pass at least one.")
    if (lens < 1).any():
        raise ValueError(
            f"Prompt(s) {np.flatnonzero(lens < 1).tolist()} are empty: every prompt needs at "
            "least one token (a BOS token, for example) to condition on."
        )
    vocab = opts.cfg.vocab_size
    real = np.arange(tokens.shape[1])[None] < lens[:, None]
    if any(k not in "iu" for k in kinds) or (real & ((tokens < 0) | (tokens >= vocab))).any():
        raise ValueError(f"Prompts must hold integer token ids in [0, {vocab}).")
    longest = int(np.max(lens))
    if longest > ctx:
        raise ValueError(
            f"A prompt of {longest} tokens is longer than the model's context of {ctx}. "
            "Crop the prompt (keep its last tokens)."
        )
    if longest + n > ctx:
        raise ValueError(
            f"The longest prompt ({longest} tokens) plus max_new_tokens={n} is more than the "
            f"model's context of {ctx} tokens. Generate at most {ctx - longest} tokens, or "
            "crop the prompt."
        )
    width = min(-(-longest // WIDTH_MULTIPLE) * WIDTH_MULTIPLE, ctx - n + 1)
    out = np.zeros((len(tokens), width), np.int32)
    out[:, :longest] = np.where(real, tokens, 0)[:, :longest]
    return out, lens.astype(np.int32)


# ------------------------------------------------------------------- placement


def _first_row(batch: int) -> Any:
    """The call's first global row: ``replica_id * batch`` inside ``strategy.run``, else 0."""
    replica = context.get_replica_context()
    return 0 if replica is None else replica.replica_id_in_sync_group * batch


def _on_replicas(strategy: Any, params: Any, tokens: Any, lengths: Any, knobs: _Knobs,
                 rng: Any, opts: _Options) -> Generation:  # fmt: skip
    n = strategy.num_replicas_in_sync
    if len(tokens) % n:
        raise ValueError(
            f"{len(tokens)} prompts do not split over the strategy's {n} replicas. Pass a "
            f"multiple of {n} (repeat a prompt to fill the batch; drop its output)."
        )
    batch = strategy.distribute_batch({"tokens": tokens, "lengths": lengths})
    return strategy.gather(strategy.run(_replica, (params, batch, knobs, rng, opts)), axis=0)


def _replica(params: Any, batch: dict, knobs: _Knobs, rng: Any, opts: _Options) -> Generation:
    tokens = batch["tokens"]
    return _run(params, tokens, batch["lengths"], knobs, rng, _first_row(len(tokens)), opts)


# ------------------------------------------------------------------- the program


@functools.partial(jax.jit, static_argnames="opts")
def _program(params: Any, tokens: Any, lengths: Any, knobs: _Knobs, rng: Any, first_row: Any,
             opts: _Options) -> Generation:  # fmt: skip
    return _run(params, tokens, lengths, knobs, rng, first_row, opts)


def _run(params: Any, tokens: jax.Array, lengths: jax.Array, knobs: _Knobs, rng: Any,
         first_row: Any, opts: _Options) -> Generation:  # fmt: skip
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and dict(mesh.shape).get("context", 1) > 1:
        raise ValueError(
            "generate feeds one token at a time, which cannot split over a replica's "
            "'context' axis. Generate with a strategy without it (the same parameters)."
        )
    b, p = tokens.shape
    n = opts.max_new_tokens
    cols = jnp.arange(p)[None]
    pad = (p - lengths)[:, None]
    # Left-align each row (its prompt ends at column p - 1); padding reads token 0 (any
    # valid id: it is masked) and is segment 0, the prompt segment 1.
    tokens = jnp.take_along_axis(tokens, (cols - pad) % p, axis=1)
    real = cols >= pad
    tokens, segments = jnp.where(real, tokens, 0), real.astype(jnp.int32)
    positions = jnp.maximum(cols - pad, 0)
    module = nnx.merge(opts.graphdef, params)
    make = _cached if opts.use_cache else _recompute
    state, step = make(module, opts, tokens, segments, positions, lengths)
    rng = jax.random.key(0) if rng is None else rng
    row_keys = jax.vmap(jax.random.fold_in, (None, 0))(rng, first_row + jnp.arange(b))

    def cond(carry: tuple) -> jax.Array:
        i, _, _, _, done, _ = carry
        return (i < n) & ~jnp.all(done)

    def body(carry: tuple) -> tuple:
        i, token, state, out, done, length = carry
        logits, state = step(state, i, token)
        new = jnp.where(done, knobs.pad_token, _sample(logits, row_keys, i, knobs, opts))
        out = jax.lax.dynamic_update_slice(out, new[:, None], (0, i))
        length = length + (~done).astype(jnp.int32)
        done = done | jnp.isin(new, knobs.stop_tokens)
        return i + 1, jnp.where(done, 0, new), state, out, done, length

    out = jnp.full((b, n), knobs.pad_token, jnp.int32)
    zeros = jnp.zeros((b,), jnp.int32)
    # The last prompt token is the first one fed.
    init = (jnp.int32(0), tokens[:, -1], state, out, zeros.astype(bool), zeros)
    _, _, _, out, _, length = jax.lax.while_loop(cond, body, init)
    return Generation(out, length)


def _cached(module: Any, opts: _Options, tokens: jax.Array, segments: jax.Array,
            positions: jax.Array, lengths: jax.Array) -> tuple[Any, Any]:  # fmt: skip
    """The cache after the prefill, and ``step(cache, i, token) -> (logits, cache)``."""
    b, p = tokens.shape
    layers, kv_heads, head_dim, _ = _shapes(opts.cfg)
    length = p + opts.max_new_tokens - 1  # the last new token is never fed
    cache = kv_cache.KVCache.zeros(layers=layers, batch=b, length=length, kv_heads=kv_heads,
                                   head_dim=head_dim, dtype=jnp.dtype(opts.cfg.dtype))  # fmt: skip
    if p > 1:  # the prefill: its logits are unused, so XLA drops the head
        s, q = segments[:, :-1], positions[:, :-1]
        with kv_cache.decoding(cache, 0, s, q) as fill:
            module(tokens[:, :-1], segment_ids=s, positions=q)
        cache = fill.result()

    def step(cache: kv_cache.KVCache, i: jax.Array, token: jax.Array) -> tuple[Any, Any]:
        s, q = jnp.ones((b, 1), jnp.int32), (lengths - 1 + i)[:, None]
        with kv_cache.decoding(cache, p - 1 + i, s, q) as one:
            logits = module(token[:, None], segment_ids=s, positions=q)
        return logits[:, 0], one.result()

    return cache, step


def _recompute(module: Any, opts: _Options, tokens: jax.Array, segments: jax.Array,
               positions: jax.Array, lengths: jax.Array) -> tuple[Any, Any]:  # fmt: skip
    """The window of prompt and new tokens, and ``step(window, i, token) -> (logits,
    window)`` that runs the model over all of it (no cache)."""
    b, p = tokens.shape
    extra = opts.max_new_tokens - 1
    window = jnp.concatenate([tokens, jnp.zeros((b, extra), jnp.int32)], axis=1)
    cols = jnp.arange(p + extra)[None]
    pad = (p - lengths)[:, None]
    every = jnp.maximum(cols - pad, 0)
    prompt_segments = jnp.concatenate([segments, jnp.ones((b, extra), jnp.int32)], axis=1)

    def step(window: jax.Array, i: jax.Array, token: jax.Array) -> tuple[Any, Any]:
        at = p - 1 + i
        window = jax.lax.dynamic_update_slice(window, token[:, None], (0, at))
        # Columns not written yet are a segment of their own: no token sees them.
        s = jnp.where(cols <= at, prompt_segments, 2)
        logits = module(window, segment_ids=s, positions=every)
        return jax.lax.dynamic_index_in_dim(logits, at, axis=1, keepdims=False), window

    return window, step


def _sample(logits: jax.Array, row_keys: jax.Array, i: jax.Array, knobs: _Knobs,
            opts: _Options) -> jax.Array:  # fmt: skip
    """The next token of each row from its logits ``[B, V]``: temperature, then top-k,
    then top-p on what top-k kept (``transformers``' order), then a draw."""
    if opts.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / knobs.temperature
    ordered = -jnp.sort(-logits, axis=-1)
    rank = jnp.arange(logits.shape[-1])[None]
    top_k = rank < knobs.top_k
    probs = jax.nn.softmax(jnp.where(top_k, ordered, -jnp.inf), axis=-1)
    above = jnp.cumsum(probs, axis=-1) - probs  # the mass of the likelier tokens
    kept = top_k & ((above < knobs.top_p) | (rank == 0) | (knobs.top_p >= 1))
    # The smallest kept logit; ties with it are kept too, as transformers keeps them.
    cutoff = jnp.min(jnp.where(kept, ordered, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    keys = jax.vmap(jax.random.fold_in, (0, None))(row_keys, i)
    return jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.int32)
