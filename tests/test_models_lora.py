"""LoRA adapters (``dt.models.add_lora``) and PEFT's adapter format, against adapters and
logits ``peft`` itself wrote (tests/fixtures/peft, made by its ``make_fixtures.py`` on the
``transformers`` bases of tests/fixtures/hf; no PyTorch needed): the first output is the
base's, only adapters train, the adapters' layout on ``{"fsdp": 4, "tensor": 2}`` gives the
values and gradients of one device, PEFT's logits after ``load_adapter``, save -> load
byte for byte, the merged export; the live ``peft`` comparison where PyTorch and ``peft``
are installed; every refused input, by its message.
"""

import functools
import json
import os
import shutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import distrain as dt
from distrain._src.models import lora as lora_lib
from distrain._src.models import peft_format
from tests.test_models_hub import _tensors  # every tensor of a directory's files

HF = os.path.join(os.path.dirname(__file__), "fixtures", "hf")
PEFT = os.path.join(os.path.dirname(__file__), "fixtures", "peft")
ALL_LLAMA = r"attn/(q|k|v|o)$|mlp/(gate|up|down)$"
ALL_GPT2 = r"attn/(qkv|out)$|mlp/(fc|proj)$"
VARIANTS = ["llama_gqa_llama3", "gpt2"]  # the peft fixtures (r=4, lora_alpha=8, all layers)
# The GPT-2 fixture's config asks for dropout, which distrain's GPT-2 warns it does not apply.
pytestmark = pytest.mark.filterwarnings("ignore:distrain's GPT-2 applies no dropout")


def _close(got, want):
    """Equal within 1e-5 of the largest magnitude of ``want`` (float32's reach)."""
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-5 * np.abs(want).max())


def _reference(directory):
    return dict(np.load(os.path.join(directory, "reference.npz")))


# Each family's transformers-written base (tests/fixtures/hf), the targets adapting all
# its projections (Mixtral: its attention; experts are no nnx.Linear), how many layers.
FAMILIES = {
    "llama": ("llama_gqa_llama3", ALL_LLAMA, 14),
    "mixtral": ("mixtral", r"attn/(q|k|v|o)$", 8),
    "gpt2": ("gpt2", ALL_GPT2, 8),
}


def _tokens(shape=(2, 8), seed=0):
    return np.random.default_rng(seed).integers(0, 96, shape).astype(np.int32)


def _adapted(module):
    return {
        p: m
        for p, m in lora_lib.linear_paths(module).items()
        if isinstance(m, dt.models.LoraLinear)
    }


def _leaves(params):
    return {
        lora_lib.leaf_path(p): np.asarray(x)
        for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
    }


@functools.partial(jax.jit, static_argnums=2)
def _apply(state, tokens, graphdef):
    return nnx.merge(graphdef, state)(tokens)


def _logits(module, tokens):
    """``module(tokens)`` compiled, as a function of its state (one compilation per model
    structure, shared by the tests; eager NNX calls compile every operation)."""
    graphdef, state = nnx.split(module)
    return np.asarray(_apply(state, tokens, graphdef))


def _loss(params, tokens, graphdef):
    logits = nnx.merge(graphdef, params)(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


# The loss and gradients of every parameter on one device (compiled once per model
# structure: the training test and the layout test share it).
_loss_and_grads = jax.jit(jax.value_and_grad(_loss), static_argnums=2)


def _split_on_device_0(module):
    """``nnx.split(module)`` with every leaf committed to device 0, as a jitted step's
    outputs are: the steps after the first reuse its compilation (and the training and
    layout tests share ``_loss_and_grads``'s)."""
    graphdef, params = nnx.split(module)
    return graphdef, jax.device_put(params, jax.devices()[0])


def _fixture_module(variant, adapter=True):
    """The transformers-written base (float32) as a module, with the peft fixture's
    adapter loaded onto it."""
    pretrained = dt.models.from_pretrained(os.path.join(HF, variant), dtype=np.float32)
    module = pretrained.module
    lora = dt.models.load_adapter(os.path.join(PEFT, variant), module) if adapter else None
    return pretrained, module, lora


# ----------------------------------------------------------------------------- adapters


@pytest.mark.parametrize("family", ["llama", "mixtral", "gpt2"])
def test_the_first_output_is_the_base_models(family):
    variant, targets, n = FAMILIES[family]
    _, model, _ = _fixture_module(variant, adapter=False)
    ref = _reference(os.path.join(HF, variant))
    tokens = ref["tokens"]
    # Mixtral: transformers' logits of the base stand for its own (one MoE compilation less).
    before = ref["logits"] if family == "mixtral" else _logits(model, tokens)
    kernels = {p: np.asarray(m.kernel[...]) for p, m in lora_lib.linear_paths(model).items()}
    dt.models.add_lora(model, dt.models.LoraConfig(4, 8, targets=targets), rngs=nnx.Rngs(1))
    adapted = _adapted(model)
    assert len(adapted) == n
    for path, layer in adapted.items():
        assert np.array_equal(layer.kernel[...], kernels[path])  # the layer's own kernel
        a, b = np.asarray(layer.lora_a[...]), np.asarray(layer.lora_b[...])
        d_in, d_out = kernels[path].shape
        assert a.shape == (d_in, 4) and b.shape == (4, d_out) and not b.any()
        # PEFT's kaiming_uniform(a=sqrt(5)) on its [r, in] weight: uniform within 1/sqrt(in).
        assert 0.75 / np.sqrt(d_in) < np.abs(a).max() <= 1 / np.sqrt(d_in)
    if family == "mixtral":
        _close(_logits(model, tokens), before)
    else:
        assert np.array_equal(_logits(model, tokens), before)


def test_only_the_adapters_train():
    """``TrainState.create(trainable=r"lora_")``: optimizer state for the adapters only;
    after three steps every adapter has moved and every base leaf is bit for bit the same."""
    _, model, _ = _fixture_module("llama_gqa_llama3", adapter=False)
    dt.models.add_lora(model, dt.models.LoraConfig(4, 8, targets=ALL_LLAMA), rngs=nnx.Rngs(1))
    graphdef, params = _split_on_device_0(model)
    state = dt.TrainState.create(params=params, tx=optax.adam(1e-2), trainable=r"lora_")
    state = jax.device_put(state, jax.devices()[0])
    adapters = {p for p in _leaves(params) if p.endswith(("/lora_a", "/lora_b"))}
    assert len(adapters) == 28
    # adam's count, and mu and nu of each adapter: nothing for the base.
    assert len(jax.tree.leaves(state.opt_state)) == 1 + 2 * len(adapters)

    apply_gradients = jax.jit(lambda state, grads: state.apply_gradients(grads=grads))
    losses = []
    for i in range(3):  # lora_a has no gradient while lora_b is zero: it moves from step 2
        loss, grads = _loss_and_grads(state.params, _tokens(seed=i), graphdef)
        state = apply_gradients(state, grads)
        losses.append(float(loss))
    before, after = _leaves(params), _leaves(state.params)
    for path, x in before.items():
        assert (not np.array_equal(after[path], x)) == (path in adapters), path
    assert np.isfinite(losses).all()


def test_dropout_applies_inside_lora_dropout_only():
    _, gpt2, _ = _fixture_module("gpt2", adapter=False)
    lora = dt.models.LoraConfig(4, 8, dropout=0.5, targets="")  # "": the layer itself
    layer = dt.models.add_lora(gpt2.blocks[0].attn.qkv, lora, rngs=nnx.Rngs(1))  # with bias
    rng = np.random.default_rng(0)
    layer.lora_b[...] = rng.standard_normal((4, 96), np.float32)
    x = rng.standard_normal((3, 32), np.float32)
    kernel, bias, a, b = (
        np.asarray(v[...]) for v in (layer.kernel, layer.bias, layer.lora_a, layer.lora_b)
    )
    _close(_logits(layer, x), x @ kernel + bias + x @ a @ b * lora.scale)  # no dropout

    @jax.jit
    def dropped(x, key):
        with dt.models.lora_dropout(key):
            return layer(x)

    key = jax.random.key(4)
    keep = np.asarray(jax.random.bernoulli(jax.random.fold_in(key, layer.lora_seed), 0.5, x.shape))
    _close(dropped(x, key), x @ kernel + bias + np.where(keep, 2 * x, 0) @ a @ b * lora.scale)
    assert 0.3 < keep.mean() < 0.7
    assert not np.allclose(dropped(x, jax.random.key(5)), dropped(x, key))  # new masks


# ----------------------------------------------------------------------------- layouts


def test_adapters_laid_out_on_fsdp_and_tensor_give_one_devices_values_and_gradients(devices):
    """The peft fixture's adapters (B not zero) on the transformers-written Llama:
    ``layout_for`` splits lora_a like its kernel's input and lora_b like its output;
    on ``{"fsdp": 4, "tensor": 2}`` the loss and every gradient equal one device's, and
    ``load_adapter`` onto the placed model keeps the placement."""
    mesh = {"fsdp": 4, "tensor": 2}
    _, module, lora = _fixture_module("llama_gqa_llama3")
    graphdef, params = _split_on_device_0(module)
    tokens = _reference(os.path.join(PEFT, "llama_gqa_llama3"))["tokens"]

    want_loss, want_grads = _loss_and_grads(params, tokens, graphdef)

    def loss_and_grads(params, tokens):  # the gradients in one vector: one output to gather
        loss, grads = jax.value_and_grad(_loss)(params, tokens, graphdef)
        return loss, jnp.concatenate([g.ravel() for g in jax.tree.leaves(grads)])

    layout, rules = dt.models.layout_for(module, mesh)
    abstract = nnx.eval_shape(  # the layout before any weight is read: the same
        lambda: dt.models.add_lora(
            dt.models.Llama(module.cfg, rngs=nnx.Rngs(0)), lora, rngs=nnx.Rngs(0)
        )
    )
    abstract_layout, abstract_rules = dt.models.layout_for(abstract, mesh)
    assert abstract_layout == layout and abstract_rules.table == rules.table
    strategy = dt.MirroredStrategy(
        devices, devices_per_replica=mesh, layout=layout, logical_axis_rules=rules
    )
    placed = strategy.put_replicated(jax.device_get(params))  # from the host: no slicing
    attn, mlp = placed["blocks"][0]["attn"], placed["blocks"][0]["mlp"]
    specs = {
        "q": (attn["q"], P("fsdp", None), P(None, "tensor")),
        "k": (attn["k"], P("fsdp", None), P(None, "tensor")),
        "o": (attn["o"], P("tensor", None), P(None, "fsdp")),
        "up": (mlp["up"], P("fsdp", None), P(None, "tensor")),
        "down": (mlp["down"], P("tensor", None), P(None, "fsdp")),
    }
    for name, (layer, a_spec, b_spec) in specs.items():
        assert layer["lora_a"][...].sharding.spec == a_spec, name
        assert layer["lora_b"][...].sharding.spec == b_spec, name
    assert attn["q"]["lora_a"][...].addressable_shards[0].data.shape == (32 // 4, 4)
    assert attn["q"]["lora_b"][...].addressable_shards[0].data.shape == (4, 32 // 2)
    out = strategy.run(loss_and_grads, (placed, tokens))
    ((loss, grads),) = [jax.device_get(r) for r in strategy.experimental_local_results(out)]
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-6)
    want = _leaves(want_grads)
    assert sum(p.endswith("lora_a") for p in want) == 14 and grads.size == sum(
        g.size for g in want.values()
    )
    start = 0
    for g in want.values():  # the tree's order, as jax.tree.leaves gave the vector
        _close(grads[start : start + g.size].reshape(g.shape), g)
        start += g.size
    # Loading onto the placed model: the adapters keep their layout, with the file's values.
    nnx.update(module, placed)
    dt.models.load_adapter(os.path.join(PEFT, "llama_gqa_llama3"), module)
    q = module.blocks[0].attn.q
    assert q.lora_b[...].sharding.spec == P(None, "tensor")
    assert np.array_equal(q.lora_b[...], params["blocks"][0]["attn"]["q"]["lora_b"][...])


# ----------------------------------------------------------------------------- PEFT files


@pytest.mark.parametrize("variant", VARIANTS)
def test_peft_written_adapter_gives_peft_logits(variant):
    """``load_adapter`` adds the adapters of the files' layers (r=4, lora_alpha=8) and
    gives ``PeftModel``'s logits; they differ from the base's, so a dropped or transposed
    tensor fails."""
    _, module, lora = _fixture_module(variant)
    ref = _reference(os.path.join(PEFT, variant))
    assert (lora.rank, lora.alpha, lora.dropout) == (4, 8, 0.0)
    assert len(_adapted(module)) == (14 if variant.startswith("llama") else 8)
    logits = _logits(module, ref["tokens"])
    _close(logits, ref["logits"])
    base = _reference(os.path.join(HF, variant))["logits"]
    assert np.abs(base - ref["logits"]).max() > 0.01 * np.abs(base).max()
    # The same onto a model that has adapters already (the adapters are replaced).
    _, again, _ = _fixture_module(variant, adapter=False)
    dt.models.add_lora(again, lora, rngs=nnx.Rngs(5))
    dt.models.load_adapter(os.path.join(PEFT, variant), again)
    _close(_logits(again, ref["tokens"]), ref["logits"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_save_adapter_writes_peft_names_and_loads_back_byte_for_byte(variant, tmp_path):
    pretrained, module, lora = _fixture_module(variant)
    # distrain's own values, not the fixture's: noise on every adapter.
    graphdef, params = nnx.split(module)
    params = _perturbed(params)
    out = str(tmp_path / "adapter")
    dt.models.save_adapter(out, params, lora, pretrained)
    config = _config(out)
    theirs = _config(os.path.join(PEFT, variant))
    for key in ("peft_type", "task_type", "r", "lora_alpha", "lora_dropout", "bias"):
        assert config[key] == theirs[key], key
    assert sorted(config["target_modules"]) == sorted(theirs["target_modules"])
    assert config["fan_in_fan_out"] == theirs["fan_in_fan_out"]  # GPT-2's Conv1D: True
    assert config["base_model_name_or_path"] == os.path.join(HF, variant)
    assert "distrain_base_sha256" not in config  # PEFT would warn about an unknown key
    assert peft_format._read_base_hash(out) == peft_format.base_sha256(pretrained.params)
    # The names, shapes and dtypes peft writes for the same adapters.
    ours, peft_written = _tensors(out), _tensors(os.path.join(PEFT, variant))
    assert {k: (v.shape, v.dtype) for k, v in ours.items()} == {
        k: (v.shape, v.dtype) for k, v in peft_written.items()
    }
    _, fresh, _ = _fixture_module(variant, adapter=False)
    loaded = dt.models.load_adapter(out, fresh)
    assert (loaded.rank, loaded.alpha) == (lora.rank, lora.alpha)
    want, got = _leaves(params), _leaves(nnx.state(fresh))
    assert sorted(want) == sorted(got)
    for path, x in want.items():
        assert got[path].dtype == x.dtype and got[path].tobytes() == x.tobytes(), path
    again = str(tmp_path / "again")
    dt.models.save_adapter(again, nnx.state(fresh), loaded, pretrained)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        with open(os.path.join(out, name), "rb") as a, open(os.path.join(again, name), "rb") as b:
            assert a.read() == b.read(), name


def _config(directory):
    with open(os.path.join(directory, "adapter_config.json")) as f:
        return json.load(f)


def _perturbed(params, seed=0):
    """``params`` with Gaussian noise (0.01) added to every adapter leaf."""
    rng = np.random.default_rng(seed)

    def perturb(path, x):
        if not lora_lib.leaf_path(path).endswith(("lora_a", "lora_b")):
            return x
        return np.asarray(x) + 0.01 * rng.standard_normal(x.shape, np.float32)

    return jax.tree_util.tree_map_with_path(perturb, params)


@pytest.mark.parametrize("variant", VARIANTS)
def test_merged_export_gives_the_adapted_models_logits(variant, tmp_path):
    pretrained, module, lora = _fixture_module(variant)
    _, params = nnx.split(module)
    merged = dt.models.merge_lora(params, lora)
    assert not any(p.endswith(("lora_a", "lora_b")) for p in _leaves(merged))
    with pytest.raises(ValueError, match="unexpected"):  # adapters are no HF tensors
        dt.models.save_pretrained(str(tmp_path / "unmerged"), params, pretrained)
    dt.models.save_pretrained(str(tmp_path / "merged"), merged, pretrained)
    exported = dt.models.from_pretrained(str(tmp_path / "merged"))
    ref = _reference(os.path.join(PEFT, variant))
    adapted = _logits(module, ref["tokens"])
    _close(_logits(exported.module, ref["tokens"]), adapted)
    _close(_logits(exported.module, ref["tokens"]), ref["logits"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_peft_loads_distrains_adapter_with_distrains_logits(variant, tmp_path):
    """Where PyTorch and peft are installed (the bench extra): distrain's adapter loads
    with ``PeftModel.from_pretrained`` onto the transformers base, every LoRA weight in
    place, with distrain's logits; the merged export loads in transformers with them too."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    pretrained, module, lora = _fixture_module(variant)
    graphdef, params = nnx.split(module)
    params = _perturbed(params)  # distrain's values, not the fixture's
    dt.models.save_adapter(str(tmp_path / "adapter"), params, lora, pretrained)
    tokens = _reference(os.path.join(PEFT, variant))["tokens"]
    want = np.asarray(_apply(params, tokens, graphdef))

    def load_base(path):
        return transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager"
        )

    with warnings.catch_warnings():  # peft: "Unexpected keyword arguments [distrain_...]"
        warnings.simplefilter("ignore")
        model = peft.PeftModel.from_pretrained(
            load_base(os.path.join(HF, variant)), str(tmp_path / "adapter")
        ).eval()
        merged = dt.models.merge_lora(params, lora)
        dt.models.save_pretrained(str(tmp_path / "merged"), merged, pretrained)
        exported = load_base(str(tmp_path / "merged")).eval()
    ours = _tensors(str(tmp_path / "adapter"))
    theirs = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert len(theirs) == len(ours)
    for key, x in ours.items():  # peft's state dict names them with the adapter's name
        loaded = theirs[key.replace(".weight", ".default.weight")].numpy()
        assert np.array_equal(loaded, x), key
    ids = torch.tensor(np.asarray(tokens), dtype=torch.long)
    with torch.no_grad():
        _close(model(ids).logits.numpy(), want)
        _close(exported(ids).logits.numpy(), want)


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"rank": 0, "alpha": 8}, r"rank must be an int >= 1\. Received: 0"),
        ({"rank": 4.0, "alpha": 8}, "rank must be an int >= 1"),
        ({"rank": 4, "alpha": 0}, r"alpha must be a number > 0\. Received: 0"),
        ({"rank": 4, "alpha": 8, "dropout": 1.0}, r"dropout must be a number in \[0, 1\)"),
        ({"rank": 4, "alpha": 8, "targets": "attn/(q"}, "targets must be a regular expression"),
    ],
)
def test_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dt.models.LoraConfig(**kwargs)


def test_add_lora_errors():
    _, llama, _ = _fixture_module("llama_gqa_llama3", adapter=False)
    rngs = nnx.Rngs(1)
    with pytest.raises(
        ValueError, match=r"matches no nnx.Linear of the Llama; .*'blocks/0/attn/k'"
    ):
        dt.models.add_lora(llama, dt.models.LoraConfig(4, 8, targets="attention/q"), rngs=rngs)
    # k is [32, 2 heads * 8 = 16]: rank 17 is no low-rank update.
    with pytest.raises(ValueError, match=r"rank=17 is above the width of 'blocks/0/attn/k'"):
        dt.models.add_lora(llama, dt.models.LoraConfig(17, 8, targets="attn/k$"), rngs=rngs)
    assert not _adapted(llama)  # checked before anything changed
    with pytest.raises(TypeError, match="takes a dt.models.LoraConfig"):
        dt.models.add_lora(llama, {"rank": 4}, rngs=rngs)
    dt.models.add_lora(llama, dt.models.LoraConfig(4, 8), rngs=rngs)
    with pytest.raises(ValueError, match="'blocks/0/attn/k' already has adapters"):
        dt.models.add_lora(llama, dt.models.LoraConfig(4, 8), rngs=rngs)
    cfg = dt.models.LMConfig(d_model=32, n_layers=2, n_heads=4, pipeline_microbatches=2)
    stacked = nnx.eval_shape(lambda: dt.models.Transformer(cfg, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"kernel of shape \(2, 32, \d+\), not \[in, out\]"):
        dt.models.add_lora(stacked, dt.models.LoraConfig(4, 8), rngs=rngs)


def test_dropout_key_outside_the_traced_step_is_refused():
    _, gpt2, _ = _fixture_module("gpt2", adapter=False)
    lora = dt.models.LoraConfig(4, 8, dropout=0.1, targets="")
    layer = dt.models.add_lora(gpt2.blocks[0].attn.qkv, lora, rngs=nnx.Rngs(1))
    with dt.models.lora_dropout(jax.random.key(0)):
        with pytest.raises(ValueError, match="entered outside the traced function"):
            jax.jit(lambda x: layer(x))(np.ones((2, 32), np.float32))


def test_merge_and_save_errors(tmp_path):
    pretrained, module, lora = _fixture_module("llama_gqa_llama3")
    _, params = nnx.split(module)
    with pytest.raises(ValueError, match="merge_lora found no adapters"):
        dt.models.merge_lora(pretrained.params, lora)
    with pytest.raises(ValueError, match="has rank 4; the LoraConfig says 2"):
        dt.models.merge_lora(params, dt.models.LoraConfig(2, 4))
    with pytest.raises(ValueError, match="save_adapter found no adapters"):
        dt.models.save_adapter(str(tmp_path), pretrained.params, lora, pretrained)
    with pytest.raises(ValueError, match=r"LoraConfig's rank is 2"):
        dt.models.save_adapter(str(tmp_path), params, dt.models.LoraConfig(2, 4), pretrained)
    # An adapter on a layer of the user's own, which the files have no module for.
    module.value_head = nnx.Linear(32, 1, rngs=nnx.Rngs(0))
    dt.models.add_lora(module, dt.models.LoraConfig(1, 2, targets="value_head"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"\['value_head'\] adapt layers the llama family's"):
        dt.models.save_adapter(str(tmp_path), nnx.state(module), lora, pretrained)
    rotary = dt.models.LMConfig(d_model=32, n_layers=1, n_heads=4)
    with pytest.raises(ValueError, match=r"positions='rope'\) has no Hugging Face family"):
        dt.models.save_adapter(str(tmp_path), params, lora, rotary)
    assert not os.listdir(tmp_path)  # nothing written


def _edited(tmp_path, variant="llama_gqa_llama3", config=None, tensors=None):
    """A copy of a peft fixture with ``config`` merged into adapter_config.json and
    ``tensors`` (name -> array, or None to drop it) into its safetensors."""
    from safetensors.numpy import save_file

    out = tmp_path / "edited"
    shutil.copytree(os.path.join(PEFT, variant), out)
    if config:
        (out / "adapter_config.json").write_text(json.dumps({**_config(out), **config}))
    if tensors:
        data = {k: x for k, x in {**_tensors(str(out)), **tensors}.items() if x is not None}
        save_file(data, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return str(out)


_Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.mark.parametrize(
    "edit, match",
    [
        ({"config": {"use_dora": True}}, r"use_dora=True is not implemented by distrain's LoRA"),
        ({"config": {"bias": "all"}}, r"bias='all' is not implemented"),
        ({"config": {"rank_pattern": {"q_proj": 8}}}, r"rank_pattern=\{'q_proj': 8\}"),
        ({"config": {"peft_type": "IA3"}}, r"a 'IA3' adapter for 'CAUSAL_LM'"),
        ({"config": {"task_type": "SEQ_CLS"}}, r"a 'LORA' adapter for 'SEQ_CLS'"),
        ({"config": {"r": 0}}, r"rank must be an int >= 1"),
        (
            {"tensors": {_Q_A.replace("lora_A", "lora_E"): np.zeros((4, 32), np.float32)}},
            r"holds '.*q_proj.lora_E.weight', which is no LoRA weight of a module of the llama",
        ),
        ({"tensors": {_Q_A: None}}, "do not pair up with its target_modules"),
        ({"config": {"target_modules": ["q_proj"]}}, "do not pair up with its target_modules"),
        ({"tensors": {_Q_A: np.zeros((4, 31), np.float32)}}, r"q_proj.lora_A.weight is \(4, 31\)"),
    ],
)
def test_refused_adapters(tmp_path, edit, match):
    path = _edited(tmp_path, **edit)
    _, module, _ = _fixture_module("llama_gqa_llama3", adapter=False)
    with pytest.raises(ValueError, match=match):
        dt.models.load_adapter(path, module)
    assert not _adapted(module)  # refused before the model changed


def test_load_adapter_errors(tmp_path):
    pretrained, module, lora = _fixture_module("llama_gqa_llama3")
    with pytest.raises(FileNotFoundError, match="has no adapter_config.json"):
        dt.models.load_adapter(str(tmp_path), module)
    only_config = tmp_path / "only_config"
    only_config.mkdir()
    shutil.copy(os.path.join(PEFT, "llama_gqa_llama3", "adapter_config.json"), only_config)
    with pytest.raises(FileNotFoundError, match="has no adapter_model.safetensors"):
        dt.models.load_adapter(str(only_config), module)
    garbled = tmp_path / "garbled"
    shutil.copytree(os.path.join(PEFT, "llama_gqa_llama3"), garbled)
    (garbled / "adapter_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="adapter_config.json is not valid JSON"):
        dt.models.load_adapter(str(garbled), module)
    (garbled / "adapter_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="holds a list; expected a JSON object"):
        dt.models.load_adapter(str(garbled), module)
    shutil.copy(os.path.join(PEFT, "llama_gqa_llama3", "adapter_config.json"), garbled)
    weights = garbled / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated
    with pytest.raises(ValueError, match="is not a readable safetensors file"):
        dt.models.load_adapter(str(garbled), module)
    with pytest.raises(TypeError, match="needs a model family's module"):
        dt.models.load_adapter(
            os.path.join(PEFT, "llama_gqa_llama3"), nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        )
    # The model's adapters differ from the file's: other layers, another scale.
    _, other, _ = _fixture_module("llama_gqa_llama3", adapter=False)
    dt.models.add_lora(other, dt.models.LoraConfig(4, 8, targets="attn/q$"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="are not on the layers of the adapter"):
        dt.models.load_adapter(os.path.join(PEFT, "llama_gqa_llama3"), other)
    _, other, _ = _fixture_module("llama_gqa_llama3", adapter=False)
    dt.models.add_lora(other, dt.models.LoraConfig(4, 4, targets=lora.targets), rngs=nnx.Rngs(0))
    with pytest.raises(
        ValueError, match=r"rank 4 and scale 1.0 \(alpha / rank\); .* r=4 and scale 2"
    ):
        dt.models.load_adapter(os.path.join(PEFT, "llama_gqa_llama3"), other)
    # An adapter distrain saved on this base, loaded onto another base: both hashes named.
    saved = str(tmp_path / "saved")
    dt.models.save_adapter(saved, nnx.state(module), lora, pretrained)
    _, other, _ = _fixture_module("llama_gqa_llama3", adapter=False)
    other.norm.scale[...] = other.norm.scale[...] * 1.5  # the same shapes, other values
    want = peft_format.base_sha256(pretrained.params)
    got = peft_format.base_sha256(other)
    with pytest.raises(ValueError, match=f"its distrain_base_sha256 is {want} .* has {got}"):
        dt.models.load_adapter(saved, other)
    dt.models.load_adapter(saved, module)  # onto its own base: accepted
