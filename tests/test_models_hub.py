"""Hugging Face checkpoints in and out (``dt.models``): the GPT-2 family against the
files and logits ``transformers`` wrote (tests/fixtures/hf, no PyTorch needed), the
layout of an import, what each device's import reads, export byte for byte, and every
wrong input. The live comparison with ``transformers`` runs where PyTorch is installed.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import warnings

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import distrain as dt
from distrain._src.models import safetensors_io

HERE = os.path.dirname(__file__)
FIXTURES = os.path.join(HERE, "fixtures", "hf")
GPT2 = os.path.join(FIXTURES, "gpt2")


def _load(path, **kwargs):
    # The fixture's config asks for GPT-2's dropout of 0.1, which distrain's GPT-2 says
    # it does not apply (one warning, checked below).
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "distrain's GPT-2 applies no dropout")
        return dt.models.from_pretrained(path, **kwargs)


def _tensors(directory):
    """Every tensor of a checkpoint directory as NumPy, by name."""
    from safetensors import safe_open

    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(directory, name), framework="np") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _logits(model, tokens):
    graphdef = model.graphdef
    return np.asarray(jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(model.params, tokens))


TENSOR_PARALLEL = {"devices_per_replica": {"fsdp": 4, "tensor": 2}}


@pytest.mark.parametrize("layout", ["one_device", "fsdp4_tensor2"])
def test_gpt2_logits_equal_transformers(layout, devices):
    strategy = (
        dt.OneDeviceStrategy(devices[0])
        if layout == "one_device"
        else dt.MirroredStrategy(**TENSOR_PARALLEL, layout=dt.models.TENSOR_PARALLEL_LAYOUT)
    )
    model = _load(GPT2, strategy=strategy)
    ref = np.load(os.path.join(GPT2, "reference.npz"))
    logits = _logits(model, ref["tokens"])
    scale = np.abs(ref["logits"]).max()
    np.testing.assert_allclose(logits, ref["logits"], rtol=0, atol=1e-5 * scale)
    assert model.family.name == "gpt2" and model.config.norm_eps == 1e-5
    kernel = model.params["blocks"][0]["attn"]["qkv"]["kernel"][...]
    if layout == "fsdp4_tensor2":  # laid out as the rules say, not replicated
        assert kernel.sharding.spec == P("fsdp", "tensor")
        assert kernel.addressable_shards[0].data.shape == (32 // 4, 96 // 2)


def test_gpt2_dropout_is_named_in_a_warning():
    with pytest.warns(UserWarning, match=r"applies no dropout.*'resid_pdrop': 0.1"):
        dt.models.from_pretrained(GPT2)


def test_each_device_reads_only_its_slice(monkeypatch, devices):
    """No device's read is more than the slice it holds: on {"fsdp": 4, "tensor": 2} a
    kernel split 8 ways is read in 8 slices of 1/8, never whole."""
    reads = []
    original = safetensors_io.Weights.read

    def read(self, name, index):
        out = original(self, name, index)
        reads.append((name, out.size))
        return out

    monkeypatch.setattr(safetensors_io.Weights, "read", read)
    strategy = dt.MirroredStrategy(**TENSOR_PARALLEL, layout=dt.models.TENSOR_PARALLEL_LAYOUT)
    model = _load(GPT2, strategy=strategy)
    shapes = {k: v.shape for k, v in _tensors(GPT2).items()}
    leaves = {
        "transformer.h.0.attn.c_attn.weight": model.params["blocks"][0]["attn"]["qkv"]["kernel"],
        "transformer.wte.weight": model.params["embed"]["embedding"],
    }
    for name, leaf in leaves.items():
        per_device = {s.data.size for s in leaf[...].addressable_shards}
        sizes = [n for k, n in reads if k == name]
        assert len(sizes) == len(devices) and set(sizes) == per_device, (name, sizes)
        assert max(sizes) * 8 == np.prod(shapes[name])  # each device an eighth
    assert {k for k, _ in reads} == set(shapes)  # every tensor read, none twice as a whole


@pytest.mark.parametrize("layout", ["one_device", "fsdp4_tensor2"])
def test_import_then_export_is_the_identity_byte_for_byte(layout, tmp_path, devices):
    strategy = (
        None
        if layout == "one_device"
        else dt.MirroredStrategy(**TENSOR_PARALLEL, layout=dt.models.TENSOR_PARALLEL_LAYOUT)
    )
    model = _load(GPT2, strategy=strategy)
    out = tmp_path / "out"
    files = dt.models.save_pretrained(str(out), model.params, model)
    assert files == ["model.safetensors"]
    before, after = _tensors(GPT2), _tensors(out)
    assert sorted(before) == sorted(after)
    for name in before:
        assert before[name].dtype == after[name].dtype, name
        assert before[name].tobytes() == after[name].tobytes(), name
    hf = json.loads((out / "config.json").read_text())
    assert hf["model_type"] == "gpt2" and hf["architectures"] == ["GPT2LMHeadModel"]
    assert hf["layer_norm_epsilon"] == 1e-5 and hf["torch_dtype"] == "float32"


def test_a_bfloat16_sharded_checkpoint_round_trips_through_float32(tmp_path):
    """Written as bfloat16 in 4+ files with an index, read as float32, written back:
    the same bytes, in bfloat16, from a TrainState."""
    model = _load(GPT2)
    bf16 = tmp_path / "bf16"
    files = dt.models.save_pretrained(
        str(bf16), model.params, model.config, dtype="bfloat16", max_shard_bytes=16_000
    )
    assert len(files) >= 4 and (bf16 / "model.safetensors.index.json").exists()
    index = json.loads((bf16 / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    wide = dt.models.from_pretrained(str(bf16), dtype="float32")
    assert {x.dtype for x in jax.tree.leaves(wide.params)} == {np.dtype("float32")}
    state = dt.TrainState.create(apply_fn=wide.apply_fn, params=wide.params, tx=_sgd())
    again = tmp_path / "again"
    dt.models.save_pretrained(str(again), state, wide)
    a, b = _tensors(bf16), _tensors(again)
    assert sorted(a) == sorted(b)
    assert all(a[k].dtype == b[k].dtype == "bfloat16" and a[k].tobytes() == b[k].tobytes()
               for k in a)  # fmt: skip
    assert json.loads((again / "config.json").read_text())["torch_dtype"] == "bfloat16"


def _sgd():
    import optax

    return optax.sgd(0.1)


def test_a_pipelined_model_exports_its_stacked_layers_as_gpt2(tmp_path):
    """A pipelined LMConfig stacks its blocks (one leading layer axis): each layer is its
    own tensor in the files, and the file reads back into the list layout."""
    cfg = dt.models.LMConfig(
        vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4, positions="learned",
        pipeline_microbatches=2,
    )  # fmt: skip

    def build():
        return dt.models.Transformer(cfg, rngs=nnx.Rngs(0))

    graphdef, _ = nnx.split(nnx.eval_shape(build))
    params = jax.jit(lambda: nnx.split(build())[1])()  # eagerly, nnx.vmap's init takes ~9 s
    assert params["blocks"]["attn"]["qkv"]["kernel"][...].shape == (2, 32, 96)  # stacked
    dt.models.save_pretrained(str(tmp_path), params, cfg)
    back = dt.models.from_pretrained(str(tmp_path))
    tokens = np.arange(32).reshape(2, 16) % 64
    stacked = dt.models.Pretrained(back.family, cfg, graphdef, params, {}, {})
    np.testing.assert_allclose(_logits(back, tokens), _logits(stacked, tokens), atol=1e-5)


def test_a_tokenizer_is_read_and_carried_to_the_export(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    src = tmp_path / "src"
    shutil.copytree(GPT2, src)
    vocab = {chr(i): i for i in range(32, 128)}  # 96 printable bytes = the fixture's vocab
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({k: v - 32 for k, v in vocab.items()}))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    tok.save(str(src / "tokenizer.json"))
    model = _load(str(src))
    assert model.tokenizer.encode("ab").ids == [ord("a") - 32, ord("b") - 32]
    dt.models.save_pretrained(str(tmp_path / "out"), model.params, model)
    assert (tmp_path / "out" / "tokenizer.json").read_text() == (src / "tokenizer.json").read_text()


# ------------------------------------------------------------------ wrong input


def _copy(tmp_path, edit_config=None, edit_tensors=None):
    """The GPT-2 fixture copied, its config.json and tensors edited."""
    out = tmp_path / "ckpt"
    shutil.copytree(GPT2, out)
    if edit_config is not None:
        hf = json.loads((out / "config.json").read_text())
        edit_config(hf)
        (out / "config.json").write_text(json.dumps(hf))
    if edit_tensors is not None:
        tensors = _tensors(GPT2)
        edit_tensors(tensors)
        from safetensors.numpy import save_file

        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


def _truncate(tmp_path):
    path = _copy(tmp_path)
    f = os.path.join(path, "model.safetensors")
    data = open(f, "rb").read()
    open(f, "wb").write(data[: len(data) // 2])
    return path


def _only_pickle(tmp_path):
    path = _copy(tmp_path)
    os.remove(os.path.join(path, "model.safetensors"))
    open(os.path.join(path, "pytorch_model.bin"), "wb").write(b"\x80\x04")
    return path


def _no_config(tmp_path):
    path = _copy(tmp_path)
    os.remove(os.path.join(path, "config.json"))
    return path


def _set(key, value):
    return lambda hf: hf.__setitem__(key, value)


WRONG = {
    "no directory": (lambda t: str(t / "nowhere"), FileNotFoundError, "No checkpoint directory"),
    "no config.json": (_no_config, FileNotFoundError, "has no config.json"),
    "a pickle only": (_only_pickle, FileNotFoundError, r"pytorch_model.bin.*pickle"),
    "truncated file": (_truncate, ValueError, "not a readable safetensors file"),
    "unknown architecture": (
        lambda t: _copy(t, _set("model_type", "bert")),
        ValueError,
        r"model_type='bert'.*distrain reads .*gpt2",
    ),
    "remote code": (
        lambda t: _copy(t, _set("auto_map", {"AutoModel": "x.Y"})),
        ValueError,
        "trust_remote_code",
    ),
    "unknown field": (
        lambda t: _copy(t, _set("rotary_dim", 8)),
        ValueError,
        r"does not implement: rotary_dim=8",
    ),
    "refused value": (
        lambda t: _copy(t, _set("activation_function", "relu")),
        ValueError,
        r"activation_function='relu' is not implemented .* gelu_new",
    ),
    "missing tensor": (
        lambda t: _copy(t, edit_tensors=lambda d: d.pop("transformer.h.1.ln_2.bias")),
        ValueError,
        r"lacks 1 tensors .*transformer.h.1.ln_2.bias",
    ),
    "unexpected tensor": (
        lambda t: _copy(t, edit_tensors=lambda d: d.update(extra=np.zeros(3, np.float32))),
        ValueError,
        r"no place for, e.g. \['extra'\]",
    ),
    "wrong shape": (
        lambda t: _copy(t, _set("n_positions", 64)),
        ValueError,
        r"transformer.wpe.weight.* shape \(32, 32\) in the files; config.json gives \(64, 32\)",
    ),
}


@pytest.mark.parametrize("case", sorted(WRONG))
def test_wrong_input_is_one_line_naming_it(case, tmp_path):
    make, error, match = WRONG[case]
    path = make(tmp_path)
    with pytest.raises(error, match=match) as info:
        _load(path)
    assert "\n" not in str(info.value)


def test_a_model_without_a_family_is_refused_on_export(tmp_path):
    cfg = dt.models.LMConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=1, n_heads=4)
    # Refused before any value is read: abstract parameters are enough.
    _, params = nnx.split(nnx.eval_shape(lambda: dt.models.Transformer(cfg, rngs=nnx.Rngs(0))))
    with pytest.raises(ValueError, match=r"positions='rope'\) has no Hugging Face family"):
        dt.models.save_pretrained(str(tmp_path), params, cfg)
    with pytest.raises(TypeError, match="No model family exports a dict"):
        dt.models.save_pretrained(str(tmp_path), params, {"d_model": 32})


_HUB = """
import os, sys, warnings
warnings.simplefilter("ignore")
import distrain as dt
try:
    dt.models.from_pretrained("acme/absent")
except FileNotFoundError as e:
    print("ABSENT", e)
m = dt.models.from_pretrained("acme/tiny-gpt2")
print("LOADED", m.family.name, m.directory.startswith(os.environ["HF_HOME"]))
"""


@pytest.mark.one_end("newest")  # a fresh interpreter (~7 s); nothing here depends on jax
def test_a_hub_name_reads_the_local_cache_offline(tmp_path):
    """The hub's cache layout (models--owner--name/snapshots/<commit>, refs/main),
    HF_HUB_OFFLINE=1: a cached name loads, an absent one is one line saying so."""
    pytest.importorskip("huggingface_hub")
    commit = "0" * 40
    repo = tmp_path / "hf" / "hub" / "models--acme--tiny-gpt2"
    shutil.copytree(GPT2, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", _HUB], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "LOADED gpt2 True" in out.stdout
    assert "ABSENT Could not get 'acme/absent' from the Hugging Face hub (HF_HUB_OFFLINE" in (
        out.stdout
    )


def test_the_lm_examples_old_module_path_warns_and_works():
    from examples.lm import model

    with pytest.warns(DeprecationWarning, match=r"moved to distrain.models.transformer"):
        fn = model.transformer
    assert fn is dt.models.transformer
    with pytest.raises(AttributeError):
        model.not_a_name  # noqa: B018


# ---------------------------------------------------------- live, with PyTorch


def test_transformers_loads_the_export_with_the_same_logits(tmp_path):
    """Where PyTorch and transformers are installed (the bench extra): a GPT-2 trained
    one step by distrain, exported, loads in transformers with no missing or unexpected
    weights, and its logits equal distrain's."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = dt.models.LMConfig(
        vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4, positions="learned",
        norm_eps=1e-5,
    )  # fmt: skip
    module = dt.models.Transformer(cfg, rngs=nnx.Rngs(1))
    _, params = nnx.split(module)
    dt.models.save_pretrained(str(tmp_path), params, cfg)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), output_loading_info=True
    )
    assert not any(info.values()), info  # missing, unexpected, mismatched, errors
    tokens = np.arange(32).reshape(2, 16) % 64
    with torch.no_grad():
        theirs = hf.eval()(torch.tensor(tokens)).logits.numpy()
    ours = np.asarray(module(tokens))
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5 * np.abs(theirs).max())
    # Greedy continuations of a 4-token prompt to the whole context agree token for token.
    from examples.lm.train import generate

    model = dt.models.from_pretrained(str(tmp_path))
    prompt = bytes([3, 1, 4, 1])
    mine = generate(cfg, model.params, prompt, num_bytes=12)  # from the KV cache
    with torch.no_grad():
        ids = torch.tensor([list(prompt)])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_length=16, pad_token_id=0)  # fmt: skip
    theirs_text = bytes(out[0].tolist())
    assert mine == theirs_text[: len(mine)] and (len(mine) == 16 or theirs_text[len(mine)] == 0)


# ------------------------------------------------------------ two processes


def test_a_replica_over_two_processes_reads_its_half_and_exports_the_same_bytes(tmp_path):
    """{"fsdp": 4, "tensor": 2} over 2 processes of 4 devices: each process reads only
    its own devices' slices of each split tensor (half of it, never the whole), the
    logits equal transformers', and the export from both processes equals the files."""
    from distrain._src.cluster.launch import free_port
    from tests.processes import run_together
    from tests.test_multi_worker import clean_env

    script = os.path.join(HERE, "scripts", "hf_import_mp.py")
    port = free_port()
    jobs = [
        (
            [sys.executable, script, "--fixture", GPT2, "--out", str(tmp_path)],
            clean_env(
                4,
                DISTRAIN_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                DISTRAIN_NUM_PROCESSES="2",
                DISTRAIN_PROCESS_ID=str(i),
                DISTRAIN_TIMEOUT_SECONDS="30",
                PYTHONPATH=os.path.dirname(HERE),
            ),
        )
        for i in range(2)
    ]
    for code, log, _ in run_together(jobs, 120):
        assert code == 0, log[-3000:]
    shapes = {k: v.size for k, v in _tensors(GPT2).items()}
    split = "transformer.h.0.attn.c_attn.weight"  # P("fsdp", "tensor"): 8 ways
    for i in range(2):
        reads = json.loads((tmp_path / f"reads_{i}.json").read_text())
        assert sorted(reads) == sorted(shapes)
        assert reads[split] == [shapes[split] // 8] * 4  # its 4 devices' eighths
        assert all(sum(sizes) <= 4 * shapes[name] for name, sizes in reads.items())
    ref = np.load(os.path.join(GPT2, "reference.npz"))
    logits = np.load(tmp_path / "logits.npy")
    np.testing.assert_allclose(logits, ref["logits"], atol=1e-5 * np.abs(ref["logits"]).max())
    before, after = _tensors(GPT2), _tensors(tmp_path / "export")
    assert sorted(before) == sorted(after)
    assert all(before[k].tobytes() == after[k].tobytes() for k in before)


# --------------------------------------------------------------- distrain export

_RUN = """
name: export_test
strategy: {name: one_device}
model:
  fn: distrain.models:transformer
  kwargs: {vocab_size: 256, seq_len: 16, d_model: 32, n_layers: 2, n_heads: 4,
           positions: learned}
data:
  fn: examples.lm.data:tinyshakespeare_splits
  kwargs: {seq_len: 16}
  global_batch_size: 4
optimizer: {name: adamw, learning_rate: 0.001}
train:
  train_step: examples.lm.train:train_step
  steps: 1
"""


def _run_checkpoint(tmp_path, vocab=256, positions="learned", save=True):
    """A run config and a checkpoint of its TrainState (as `distrain train` saves)."""
    import optax

    config = tmp_path / "run.yaml"
    text = _RUN.replace("vocab_size: 256", f"vocab_size: {vocab}")
    config.write_text(text.replace("positions: learned", f"positions: {positions}"))
    cfg = dt.models.LMConfig(vocab_size=vocab, seq_len=16, d_model=32, n_layers=2,
                             n_heads=4, positions=positions)  # fmt: skip
    model = dt.models.Transformer(cfg, rngs=nnx.Rngs(3))
    params = nnx.to_pure_dict(nnx.state(model))
    state = dt.TrainState.create(apply_fn=None, params=params, tx=optax.adamw(1e-3))
    with dt.checkpoint.CheckpointManager(tmp_path / "ckpt", async_save=False) as manager:
        if save:
            manager.save(7, state)
    return str(config), str(tmp_path / "ckpt"), model


def test_distrain_export_writes_a_runs_checkpoint_that_imports_back(tmp_path, capsys):
    from distrain.cli import main

    config, ckpt, model = _run_checkpoint(tmp_path)
    out = tmp_path / "hf"
    argv = ["export", "--config", config, "--checkpoint", ckpt, "--to", "hf", str(out)]
    assert main([*argv, "--tokenizer", "bytes"]) == 0
    assert f"step 7 of {ckpt} -> {out}" in capsys.readouterr().out
    back = dt.models.from_pretrained(str(out))
    for got, want in zip(jax.tree.leaves(back.params), jax.tree.leaves(nnx.state(model)),
                         strict=True):  # fmt: skip
        np.testing.assert_array_equal(got, want)  # the checkpoint's values, exactly
    text = "JULIET:\n\xe9"  # a byte above 127 too: its UTF-8 bytes are the ids
    assert back.tokenizer.encode(text).ids == list(text.encode())
    assert back.tokenizer.decode(list(text.encode())) == text


@pytest.mark.parametrize(
    "case, extra, match",
    [
        ("format", ["--to", "onnx", "OUT"], r"--to 'onnx': the only format is 'hf'"),
        ("no checkpoint dir", ["--checkpoint", "MISSING"], r"is not a directory"),
        ("empty dir", ["--checkpoint", "EMPTY"], r"holds no checkpoint"),
        ("byte tokenizer", ["--tokenizer", "bytes"], r"for a vocabulary of 256 bytes; the model"),
        ("rotary", [], r"positions='rope'\) has no Hugging Face family"),
    ],
)
def test_distrain_export_refuses_in_one_line(case, extra, match, tmp_path, capsys):
    from distrain.cli import main

    vocab, positions = (96, "learned") if case == "byte tokenizer" else (256, "learned")
    positions = "rope" if case == "rotary" else positions
    # Each is refused before the checkpoint is read: none is written.
    config, ckpt, _ = _run_checkpoint(tmp_path, vocab, positions, save=False)
    (tmp_path / "empty").mkdir()
    places = {"MISSING": str(tmp_path / "missing"), "EMPTY": str(tmp_path / "empty"),
              "OUT": str(tmp_path / "out")}  # fmt: skip
    extra = [places.get(a, a) for a in extra]
    argv = ["export", "--config", config, "--checkpoint", ckpt, "--to", "hf",
            str(tmp_path / "out"), *extra]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("distrain export: error:") and len(err.splitlines()) == 1, err
    assert re.search(match, err), err
