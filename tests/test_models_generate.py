"""``dt.models.generate``: greedy decoding from the KV cache equals the plain forward pass
recomputed for every token (each family, on the checkpoints ``transformers`` wrote in
tests/fixtures/hf) and ``transformers``' own ``generate`` (live, where PyTorch is
installed); stop tokens; sampling reproducible per prompt, on 1 and 8 replicas; the
tensor-parallel and FSDP layouts; one compiled program per call; every wrong input.
"""

import os
import warnings

import jax
import numpy as np
import pytest
from flax import nnx

import distrain as dt
from distrain._src.models import generate as generate_module

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf")
# Prompts of different lengths: each batch is padded, and rows must not see it.
PROMPTS = [[5, 7, 9, 11, 2], [3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [60, 61]]
EIGHT = [*PROMPTS, [4, 4, 4], [9, 8, 7, 6], [2, 3], [70]]
# The fixtures' random weights are tiny: as written, the models with a tied head repeat
# one token whatever the prompt (an equality test that cannot tell positions apart).
# Their kernels x8 (written once per run, read back by from_pretrained) vary (checked).
SHARPEN = 8.0


@pytest.fixture(scope="module")
def load(tmp_path_factory):
    """``load(variant, **from_pretrained_kwargs) -> (model, params)`` of the fixture with
    its kernels sharpened (scaled in NumPy and exported: no program compiled for it)."""
    written = {}

    def load(variant, **kwargs):
        if variant not in written:
            with warnings.catch_warnings():  # the GPT-2 fixture's dropout (named elsewhere)
                warnings.filterwarnings("ignore", "distrain's GPT-2 applies no dropout")
                model = dt.models.from_pretrained(os.path.join(FIXTURES, variant))

            def scale(path, x):
                x = np.asarray(x)
                return x * SHARPEN if "kernel" in jax.tree_util.keystr(path) else x

            params = jax.tree_util.tree_map_with_path(scale, model.params)
            written[variant] = str(tmp_path_factory.mktemp(variant))
            dt.models.save_pretrained(written[variant], params, model)
        model = dt.models.from_pretrained(written[variant], **kwargs)
        return model, model.params

    return load


def _recompute(graphdef, params, prompts, n):
    """Greedy by the plain forward pass (causal attention, no padding or positions given)
    over a right-padded window, one token at a time: what ``generate`` must equal."""
    forward = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))
    ends = np.array([len(p) for p in prompts])
    window = np.zeros((len(prompts), ends.max() + n), np.int32)
    for i, p in enumerate(prompts):
        window[i, : len(p)] = p
    rows = np.arange(len(prompts))
    for _ in range(n):
        logits = np.asarray(forward(params, window))
        window[rows, ends] = logits[rows, ends - 1].argmax(-1)
        ends += 1
    return np.stack([window[i, len(p) : len(p) + n] for i, p in enumerate(prompts)])


# ------------------------------------------------------------------ exactness


@pytest.mark.parametrize("variant", ["gpt2", "llama_gqa_llama3", "mixtral"])
def test_greedy_from_the_cache_equals_recomputing_every_token(variant, load):
    """GPT-2 (learned positions, fused QKV), Llama (grouped-query attention, llama3
    rotary scaling, tied head) and Mixtral (experts)."""
    model, params = load(variant)
    out = dt.models.generate(model, params, PROMPTS, 12)
    want = _recompute(model.graphdef, params, PROMPTS, 12)
    np.testing.assert_array_equal(np.asarray(out.tokens), want)
    np.testing.assert_array_equal(np.asarray(out.lengths), [12] * len(PROMPTS))
    # A test that can tell: the continuations vary, and differ from prompt to prompt.
    assert len(set(want.ravel())) >= 8 and len({tuple(r) for r in want}) == len(PROMPTS)


def test_64_tokens_are_one_compiled_program_that_never_waits_on_the_host():
    """The LM example's rotary LMConfig, built with remat (generate runs its blocks
    without: the same parameters): the first call lowers one program; a call with other
    prompts of the same padded width lowers and traces nothing and runs with
    device-to-host transfers disallowed (no per-token Python loop reading a stop flag),
    and its 64 tokens equal the plain forward pass's."""
    cfg = dt.models.LMConfig(
        vocab_size=64, seq_len=96, d_model=32, n_layers=2, n_heads=4, remat="nothing_saveable"
    )
    graphdef, shapes = nnx.split(
        nnx.eval_shape(lambda: dt.models.Transformer(cfg, rngs=nnx.Rngs(0)))
    )
    draw = np.random.default_rng(3)  # random weights made in NumPy: nothing to compile
    params = jax.tree.map(lambda s: draw.normal(0, 0.2, s.shape).astype(np.float32), shapes)
    events = []

    def listen(event, duration, **kwargs):
        events.append(event.rsplit("/", 1)[-1])

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        jax.block_until_ready(dt.models.generate(cfg, params, [[1, 2, 3], [4], [5], [6]], 64))
        assert events.count("jaxpr_to_mlir_module_duration") == 1, events
        events.clear()
        with jax.transfer_guard_device_to_host("disallow"):
            out = dt.models.generate(cfg, params, PROMPTS, 64)
            jax.block_until_ready(out)
        assert events == []
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    np.testing.assert_array_equal(np.asarray(out.tokens), _recompute(graphdef, params, PROMPTS, 64))
    opts, knobs = generate_module._options(cfg, 64, 0.0, None, None, (), 0, True)
    program = generate_module._program.lower(
        params, np.zeros((4, 16), np.int32), np.ones(4, np.int32), knobs, None, 0, opts=opts
    )
    assert "stablehlo.while" in program.as_text()  # the tokens: a loop inside the program


def test_stop_tokens_end_each_row_and_pad_the_rest(load):
    model, params = load("gpt2")
    free = np.asarray(dt.models.generate(model, params, PROMPTS, 12).tokens)
    stop = int(free[0, 4])  # row 0 stops at its 5th token, or earlier if it repeats
    out = dt.models.generate(model, params, PROMPTS, 12, stop_tokens=(stop,), pad_token=-1)
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    for i, row in enumerate(free):
        hits = np.flatnonzero(row == stop)
        assert lengths[i] == (hits[0] + 1 if len(hits) else 12)
        np.testing.assert_array_equal(tokens[i, : lengths[i]], row[: lengths[i]])
        assert (tokens[i, lengths[i] :] == -1).all()
    assert lengths[0] <= 5 and (lengths < 12).any() and (lengths == 12).any()


# ------------------------------------------------------------------ sampling

SAMPLE = dict(temperature=1.0, top_p=0.9, rng=jax.random.key(7))


def test_sampling_is_reproducible_and_the_filters_keep_what_they_say(load):
    model, params = load("gpt2")

    def sample(prompts=EIGHT, **kw):
        return np.asarray(dt.models.generate(model, params, prompts, 12, **SAMPLE | kw).tokens)

    first = sample()
    np.testing.assert_array_equal(first, sample())  # the same key, the same draws
    assert not np.array_equal(first, sample(rng=jax.random.key(8)))
    # A row's draws are its prompt's and its index's, whatever the other rows hold.
    np.testing.assert_array_equal(sample(PROMPTS + [[1]] * 4)[:4], first[:4])
    greedy = np.asarray(dt.models.generate(model, params, EIGHT, 12).tokens)
    np.testing.assert_array_equal(sample(top_k=1, top_p=None), greedy)  # the argmax alone
    np.testing.assert_array_equal(sample(top_p=1e-6), greedy)  # a nucleus of one
    # One prompt, 128 draws of its first token (16 keys x 8 rows): within the top 3, and
    # within the nucleus of 0.5 computed here from the model's logits.
    logits = np.asarray(jax.jit(model.apply_fn)(params, np.array([PROMPTS[0]])))[0, -1]
    order = np.argsort(-logits)
    probs = np.exp(logits[order] - logits.max())
    nucleus = set(order[: np.searchsorted(np.cumsum(probs / probs.sum()), 0.5) + 1].tolist())
    copies, keys = [PROMPTS[0]] * 8, [jax.random.key(k) for k in range(16)]
    top3 = {t for k in keys for t in sample(copies, rng=k, top_k=3, top_p=None)[:, 0]}
    assert top3 <= set(order[:3].tolist()) and len(top3) > 1
    assert {t for k in keys for t in sample(copies, rng=k, top_p=0.5)[:, 0]} <= nucleus


# ------------------------------------------------------------------ strategies


def test_eight_replicas_sample_each_prompt_as_one_device_does(devices, load):
    """Prompts split over 8 replicas (one each): the samples are one device's, through
    ``strategy=`` and through generate called inside the caller's own step."""
    strategy = dt.MirroredStrategy()
    assert strategy.num_replicas_in_sync == len(devices) == 8
    model, params = load("gpt2", strategy=strategy)
    one = dt.models.generate(model, load("gpt2")[1], EIGHT, 12, **SAMPLE)
    split = dt.models.generate(model, params, EIGHT, 12, strategy=strategy, **SAMPLE)
    np.testing.assert_array_equal(np.asarray(split.tokens), np.asarray(one.tokens))
    np.testing.assert_array_equal(np.asarray(split.lengths), np.asarray(one.lengths))

    tokens = np.zeros((8, 16), np.int32)  # arrays whose rows start at column 0, + lengths
    for i, p in enumerate(EIGHT):
        tokens[i, : len(p)] = p
    lengths = np.array([len(p) for p in EIGHT], np.int32)

    def step(params, batch):
        return dt.models.generate(model, params, batch["tokens"], 12, lengths=batch["n"], **SAMPLE)

    batch = strategy.distribute_batch({"tokens": tokens, "n": lengths})
    mine = strategy.gather(strategy.run(step, (params, batch)), axis=0)
    np.testing.assert_array_equal(np.asarray(mine.tokens), np.asarray(one.tokens))


@pytest.mark.parametrize("variant, prompts", [("gpt2", EIGHT), ("llama_gqa_llama3", PROMPTS)])
def test_fsdp_and_tensor_parallel_layouts_give_one_devices_tokens(variant, prompts, load):
    mesh = {"fsdp": 4, "tensor": 2}
    if variant == "gpt2":
        layout = {"layout": dt.models.TENSOR_PARALLEL_LAYOUT}
    else:
        cfg = dt.models.from_pretrained(os.path.join(FIXTURES, variant)).config
        spec, rules = dt.models.layout_for(cfg, mesh)
        layout = {"layout": spec, "logical_axis_rules": rules}
    strategy = dt.MirroredStrategy(devices_per_replica=mesh, **layout)
    model, params = load(variant, strategy=strategy)
    kernel = params["blocks"][0]["attn"]["qkv" if variant == "gpt2" else "q"]["kernel"][...]
    assert kernel.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
    out = dt.models.generate(model, params, prompts, 12, strategy=strategy)
    want = dt.models.generate(model, load(variant)[1], prompts, 12)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(want.tokens))


# ------------------------------------------------------------------ wrong input


def _wrong(**kw):
    model = dt.models.LMConfig(vocab_size=64, seq_len=16, d_model=16, n_layers=1, n_heads=2)
    args = dict(model=model, params=None, prompts=[[1, 2, 3]], max_new_tokens=4) | kw
    strategy = args.pop("strategy", None)
    return lambda: dt.models.generate(**args, strategy=strategy)


@pytest.mark.parametrize(
    "call, match",
    [
        (_wrong(prompts=[list(range(17))]), "17 tokens is longer than the model's context of 16"),
        (_wrong(prompts=[[1] * 10], max_new_tokens=7), r"plus max_new_tokens=7 is more than"),
        (_wrong(max_new_tokens=0), r"max_new_tokens must be an int >= 1. Received: 0"),
        (_wrong(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (_wrong(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (_wrong(top_k=0), "top_k must be an int >= 1"),
        (_wrong(temperature=-1.0), "temperature must be a number >= 0"),
        (_wrong(temperature=0.7), r"needs rng=jax.random.key\(seed\)"),
        (_wrong(prompts=[[1, 2], []]), r"Prompt\(s\) \[1\] are empty"),
        (_wrong(prompts=[[1, 64]]), r"integer token ids in \[0, 64\)"),
        (_wrong(stop_tokens=(64,)), r"stop_tokens must be token ids in \[0, 64\)"),
        (_wrong(prompts=np.ones((2, 3), np.int32), lengths=[3, 4]), "lengths must be 2 ints"),
        (_wrong(model="gpt2"), "generate's model must be"),
        (
            _wrong(model=dt.models.LMConfig(n_layers=2, pipeline_microbatches=2)),
            "stacks them for dt.nn.pipeline",
        ),
    ],
)
def test_wrong_input_is_one_line_naming_it(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_a_batch_the_replicas_do_not_divide_is_refused(devices):
    strategy = dt.MirroredStrategy()
    with pytest.raises(ValueError, match="3 prompts do not split over the strategy's 8"):
        _wrong(prompts=[[1], [2], [3]], strategy=strategy)()


# ------------------------------------------------------------------ live, with PyTorch


@pytest.mark.parametrize("variant", ["gpt2", "llama_gqa_llama3", "qwen3", "mixtral"])
def test_greedy_equals_transformers_generate(variant, load):
    """Where PyTorch and transformers are installed: the same (sharpened) checkpoint,
    exported and read by ``AutoModelForCausalLM``, continued by ``generate(do_sample=
    False)`` one prompt at a time, with the fixture's end-of-sequence id (which stops
    our rows as it stops theirs)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model, params = load(variant)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model.directory, dtype=torch.float32)
    eos = model.hf_config.get("eos_token_id")
    stops = (eos,) if eos is not None and eos < model.config.vocab_size else ()
    ours = dt.models.generate(model, params, PROMPTS, 12, stop_tokens=stops, pad_token=0)
    for row, prompt in enumerate(PROMPTS):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf.eval().generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                eos_token_id=eos, pad_token_id=0,
            )  # fmt: skip
        theirs = out[0, len(prompt) :].tolist()
        theirs += [0] * (12 - len(theirs))  # one row: transformers' output ends at eos
        assert np.asarray(ours.tokens)[row].tolist() == theirs, (row, prompt)
