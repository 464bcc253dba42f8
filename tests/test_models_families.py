"""The Llama (Llama, Mistral, Qwen3) and Mixtral (Mixtral, Qwen3-MoE) families against the
files and outputs ``transformers`` wrote (tests/fixtures/hf, made by its
``make_fixtures.py``; no PyTorch needed): logits, router logits and the balancing loss
within float32's reach, on one device and on replica meshes laid out by the families'
logical axis names; ``config.json`` round trips; every refused field, by name.
"""

import json
import os

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import distrain as dt
from distrain._src.models import llama, mixtral
from distrain._src.models.family import family_for, family_of
from tests.test_models_hub import _tensors

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf")

# What each fixture exercises (checked on its config, so a fixture that stopped
# exercising it fails here rather than passing silently).
FEATURES = {
    "llama_gqa_llama3": {
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
        "rope_scaling": llama.RopeScaling("llama3", 8.0, 1.0, 4.0, 16),
    },
    "llama_llama3_bands": {  # frequencies in all three of llama3's bands
        "num_key_value_heads": 1,
        "head_dim": 32,
        "rope_scaling": llama.RopeScaling("llama3", 8.0, 1.0, 4.0, 48),
    },
    "llama_linear_untied": {
        "tie_word_embeddings": False,
        "rope_scaling": llama.RopeScaling("linear", 2.0),
    },
    "llama_bf16_sharded": {"rope_scaling": llama.RopeScaling("linear", 2.0)},
    "qwen3": {"model_type": "qwen3", "head_dim": 16, "hidden_size": 32, "num_key_value_heads": 2},
    "mixtral": {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe_norm": {"model_type": "qwen3_moe", "norm_topk_prob": True, "head_dim": 16},
    "qwen3_moe_nonorm": {"model_type": "qwen3_moe", "norm_topk_prob": False},
}
VARIANTS = list(FEATURES)


def _hf(variant):
    with open(os.path.join(FIXTURES, variant, "config.json")) as f:
        return json.load(f)


def _reference(variant):
    return dict(np.load(os.path.join(FIXTURES, variant, "reference.npz")))


def _close(got, want):
    """Equal within 1e-5 of the largest magnitude of ``want`` (float32's reach)."""
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-5 * np.abs(want).max())


def _forward(model, moe):
    graphdef = model.graphdef

    def apply(params, tokens):
        m = nnx.merge(graphdef, params)
        return m(tokens, return_aux=True, return_router_logits=True) if moe else m(tokens)

    return apply


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_equal_transformers(variant):
    model = dt.models.from_pretrained(os.path.join(FIXTURES, variant), dtype=np.float32)
    ref = _reference(variant)
    moe = "router_logits" in ref
    assert model.family.name == ("mixtral" if moe else "llama")
    for field, value in FEATURES[variant].items():
        assert getattr(model.config, field) == value, field
    forward = jax.jit(_forward(model, moe))
    out = forward(model.params, ref["tokens"])
    if moe:
        logits, aux, router_logits = out
        _close(router_logits, ref["router_logits"])  # [layers, B * T, E]
        assert float(aux["aux_loss"]) == pytest.approx(float(ref["aux_loss"]), rel=1e-5)
        coef = model.config.router_aux_loss_coef
        assert float(aux["moe_loss"]) == pytest.approx(coef * float(ref["aux_loss"]), rel=1e-5)
    else:
        logits = out
    assert logits.dtype == np.float32
    _close(logits, ref["logits"])
    if "tokens_long" in ref:  # past the rotary scaling's original context
        _close(forward(model.params, ref["tokens_long"]), ref["logits_long"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_config_json_round_trips(variant):
    hf = _hf(variant)
    family = family_for(hf)
    cfg = family.config_from_hf(hf)
    written = family.config_to_hf(cfg)
    assert family_for(written) is family and family_of(cfg) is family
    assert family.config_from_hf(written) == cfg
    # What both spell the same way agrees (transformers 5 spells rotary as rope_parameters,
    # export as transformers 4's rope_theta / rope_scaling, which both versions read).
    same = {k for k in set(hf) & set(written) if hf[k] is not None}
    assert {k: written[k] for k in same} == {k: hf[k] for k in same}
    assert written["rope_theta"] == hf["rope_parameters"]["rope_theta"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_import_then_export_writes_the_same_tensors(variant, tmp_path):
    """The tensor table read both ways: every tensor (stacked experts, transposed
    kernels, bfloat16 shards) comes back byte for byte under its own name."""
    model = dt.models.from_pretrained(os.path.join(FIXTURES, variant))
    dt.models.save_pretrained(str(tmp_path), model.params, model)
    before, after = _tensors(os.path.join(FIXTURES, variant)), _tensors(tmp_path)
    assert sorted(before) == sorted(after)
    for name, x in before.items():
        assert after[name].dtype == x.dtype and after[name].tobytes() == x.tobytes(), name


def _changed(variant, **changes):
    hf = _hf(variant)
    for key, value in changes.items():
        if value is _DELETE:
            hf.pop(key)
        else:
            hf[key] = value
    return hf


_DELETE = object()
_LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
    "rope_theta": 500000.0,
}
REFUSED = {
    "yarn": (
        "llama_gqa_llama3",
        {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
        r"rope_parameters\.rope_type='yarn'",
    ),
    "yarn_transformers4": (
        "llama_gqa_llama3",
        {
            "rope_parameters": _DELETE,
            "rope_theta": 1e4,
            "rope_scaling": {"type": "yarn", "factor": 4.0},
        },
        r"rope_scaling\.rope_type='yarn'",
    ),
    "llama3_unknown_field": (
        "llama_gqa_llama3",
        {"rope_parameters": {**_LLAMA3, "beta_fast": 32}},
        r"rope_parameters\.beta_fast=32",
    ),
    "partial_rotary": (
        "llama_linear_untied",
        {"partial_rotary_factor": 0.5},
        "partial_rotary_factor=0.5",
    ),
    "mistral_window": (
        "llama_linear_untied",
        {"model_type": "mistral", "sliding_window": 4096, "mlp_bias": _DELETE},
        "sliding_window=4096",
    ),
    # transformers' MistralConfig defaults to a 4096-token window: a file without the field has one.
    "mistral_default_window": (
        "llama_linear_untied",
        {"model_type": "mistral", "mlp_bias": _DELETE},
        "sliding_window=4096",
    ),
    "attention_bias": ("llama_linear_untied", {"attention_bias": True}, "attention_bias=True"),
    "mlp_bias": ("llama_linear_untied", {"mlp_bias": True}, "mlp_bias=True"),
    "unknown_field": ("llama_linear_untied", {"foo_scale": 3}, "foo_scale=3"),
    "gelu": ("llama_linear_untied", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    "attention_dropout": ("qwen3", {"attention_dropout": 0.1}, "attention_dropout=0.1"),
    "pretraining_tp": ("llama_linear_untied", {"pretraining_tp": 2}, "pretraining_tp=2"),
    "qwen3_window": ("qwen3", {"use_sliding_window": True}, "use_sliding_window=True"),
    "qwen3_layer_types": (
        "qwen3",
        {"layer_types": ["full_attention", "sliding_attention"]},
        r"layer_types=\['full_attention', 'sliding_attention'\]",
    ),
    "mixtral_window": ("mixtral", {"sliding_window": 4096}, "sliding_window=4096"),
    "mixtral_jitter": ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
    "dense_layers": ("qwen3_moe_norm", {"mlp_only_layers": [1]}, r"mlp_only_layers=\[1\]"),
    "sparse_step": ("qwen3_moe_norm", {"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
    "experts_disagree": ("qwen3_moe_norm", {"num_experts": 8}, "num_experts=8"),
    "missing_width": ("llama_linear_untied", {"hidden_size": _DELETE}, "lacks 'hidden_size'"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unimplemented_fields_are_refused_by_name(case):
    variant, changes, match = REFUSED[case]
    hf = _changed(variant, **changes)
    with pytest.raises(ValueError, match=match):
        family_for(hf).config_from_hf(hf)


@pytest.mark.parametrize(
    "make, kwargs, match",
    [
        (llama.LlamaConfig, {"num_key_value_heads": 3}, r"multiple of num_key_value_heads \(3\)"),
        (llama.LlamaConfig, {"model_type": "mixtral"}, "model_type must be one of"),
        (llama.LlamaConfig, {"head_dim": 7}, "head_dim must be even"),
        (llama.LlamaConfig, {"vocab_size": 0}, "vocab_size must be a positive int"),
        (llama.LlamaConfig, {"rms_norm_eps": 0.0}, "rms_norm_eps must be a number > 0"),
        (llama.LlamaConfig, {"dtype": "float16"}, "dtype must be one of"),
        (
            llama.LlamaConfig,
            {"rope_scaling": {"factor": 2.0}},
            "rope_scaling must be a RopeScaling",
        ),
        (llama.RopeScaling, {"rope_type": "yarn", "factor": 2.0}, "rope_type must be 'linear'"),
        (llama.RopeScaling, {"rope_type": "llama3", "factor": 8.0}, "needs 0 < low_freq_factor"),
        (llama.RopeScaling, {"rope_type": "linear", "factor": 0}, "factor must be > 0"),
        (mixtral.MixtralConfig, {"num_experts_per_tok": 5}, r"from 1 to num_local_experts \(4\)"),
        (mixtral.MixtralConfig, {"num_local_experts": 0}, "num_local_experts must be a positive"),
        (mixtral.MixtralConfig, {"norm_topk_prob": False}, "always renormalizes"),
        (mixtral.MixtralConfig, {"router_aux_loss_coef": -1.0}, "router_aux_loss_coef must be"),
        (
            mixtral.MixtralConfig,
            {"model_type": "qwen3_moe", "dense_intermediate_size": 0},
            "dense_",
        ),
    ],
)
def test_config_errors(make, kwargs, match):
    with pytest.raises(ValueError, match=match):
        make(**kwargs)


LAYOUTS = {
    # Megatron over "tensor" (q/k/v and gate/up by columns, o and down by rows), the
    # other dimension FSDP; the experts split over "expert", 4 experts on 4 devices.
    "llama_gqa_llama3": (8, {"fsdp": 4, "tensor": 2}),
    "mixtral": (4, {"expert": 4}),
}


@pytest.mark.parametrize("variant", list(LAYOUTS))
def test_replica_layouts_give_the_same_logits(variant, devices):
    n, mesh = LAYOUTS[variant]
    cfg = family_for(_hf(variant)).config_from_hf(_hf(variant))
    layout, rules = llama.layout_for(cfg, mesh)
    strategy = dt.MirroredStrategy(
        devices[:n], devices_per_replica=mesh, layout=layout, logical_axis_rules=rules
    )
    model = dt.models.from_pretrained(
        os.path.join(FIXTURES, variant), strategy=strategy, dtype=np.float32
    )
    block = model.params["blocks"][0]
    spec = lambda leaf: leaf[...].sharding.spec  # noqa: E731
    if "tensor" in mesh:
        assert spec(block["attn"]["q"]["kernel"]) == P("fsdp", "tensor")
        assert spec(block["attn"]["k"]["kernel"]) == P("fsdp", "tensor")
        assert spec(block["attn"]["o"]["kernel"]) == P("tensor", "fsdp")
        assert spec(block["mlp"]["down"]["kernel"]) == P("tensor", "fsdp")
        assert spec(model.params["embed"]["embedding"]) == P("tensor", "fsdp")
        q = block["attn"]["q"]["kernel"][...]
        assert q.addressable_shards[0].data.shape == (32 // 4, 32 // 2)  # 2 of 4 heads
    else:
        for leaf in ("w_gate", "w_in", "w_out"):
            w = block["mlp"][leaf][...]
            assert spec(block["mlp"][leaf]) == P("expert", None, None)
            assert {s.data.shape[0] for s in w.addressable_shards} == {1}  # 1 expert each
    ref = _reference(variant)
    moe = "router_logits" in ref
    meshes = []
    forward = _forward(model, moe)

    def step(params, tokens):
        meshes.append(dict(jax.sharding.get_abstract_mesh().shape))  # at trace time
        return forward(params, tokens)

    out = strategy.run(step, (model.params, ref["tokens"]))
    (out,) = [jax.device_get(r) for r in strategy.experimental_local_results(out)]
    assert meshes and all(m[a] == k for m in meshes for a, k in mesh.items())  # on the replica
    if moe:
        out, _, router_logits = out
        _close(router_logits, ref["router_logits"])
    _close(out, ref["logits"])


def test_layout_for_leaves_whole_what_a_mesh_axis_does_not_divide(devices):
    """A vocabulary of 95 and one K/V head over "tensor": 2 stay whole (the default rules
    would fail the strategy's check on the vocabulary, and split the K/V head in two);
    the query heads are split as usual."""
    cfg = llama.LlamaConfig(
        vocab_size=95, hidden_size=32, num_attention_heads=4, num_key_value_heads=1
    )
    mesh = {"fsdp": 4, "tensor": 2}
    shapes = _abstract_params(cfg)
    layout, rules = llama.layout_for(cfg)
    strict = dt.MirroredStrategy(devices_per_replica=mesh, layout=layout, logical_axis_rules=rules)
    with pytest.raises(ValueError, match="not divisible by 2"):
        strict.put_replicated(shapes)
    layout, rules = llama.layout_for(cfg, mesh)
    strategy = dt.MirroredStrategy(
        devices_per_replica=mesh, layout=layout, logical_axis_rules=rules
    )
    placed = strategy.put_replicated(shapes)
    attn = placed["blocks"][0]["attn"]
    assert placed["embed"]["embedding"].sharding.spec == P(None, "fsdp")
    assert placed["head"]["kernel"].sharding.spec == P("fsdp", None)
    assert attn["k"]["kernel"].sharding.spec == P("fsdp", None)  # [32, 1 * 8]
    assert attn["q"]["kernel"].sharding.spec == P("fsdp", "tensor")  # [32, 4 * 8]
    assert attn["o"]["kernel"].sharding.spec == P("tensor", "fsdp")


def _abstract_params(cfg):
    module = nnx.eval_shape(lambda: llama.Llama(cfg, rngs=nnx.Rngs(0)))
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.to_pure_dict(nnx.state(module))
    )


@pytest.mark.parametrize("variant", VARIANTS)
def test_transformers_loads_each_export_with_the_reference_logits(variant, tmp_path):
    """Where PyTorch and transformers are installed (the bench extra): each family's
    export loads with no missing, unexpected or mismatched weight and gives the logits
    transformers gave for the files it wrote."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = dt.models.from_pretrained(os.path.join(FIXTURES, variant))
    dt.models.save_pretrained(str(tmp_path), model.params, model)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), output_loading_info=True, torch_dtype=torch.float32
    )
    assert not any(info.values()), info
    ref = _reference(variant)
    with torch.no_grad():
        logits = hf.eval()(torch.tensor(ref["tokens"], dtype=torch.long)).logits.numpy()
    _close(logits, ref["logits"])
