"""examples/lm: the byte-level transformer LM, its data, configs, and distribution checks.

Tiny model (2 layers, d_model 32, seq 16) on real stdlib text, 8 virtual CPU devices:
training runs and the held-out loss falls; 8 replicas, 1 replica and sharded state give
the same loss and parameters; resuming from a backup is bit-exact; the download code
checks and caches against a real local HTTP server.
"""

import contextlib
import dataclasses
import functools
import hashlib
import http.server
import json
import math
import pathlib
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import distrain as dt
from distrain._src.cluster.launch import free_port
from distrain.config import load_config, run_config
from distrain.data import ArrayPipeline
from distrain.models import LMConfig, Transformer, count_params, flops_per_token
from examples.lm import data as lm_data
from examples.lm.train import (
    Perplexity,
    Settings,
    generate,
    init_state,
    load_splits,
    make_strategy,
    settings_from_config,
    train_and_evaluate,
    train_step,
)

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = LMConfig(seq_len=16, d_model=32, n_layers=2, n_heads=2)
SETTINGS = Settings(
    model=TINY, global_batch_size=16, eval_batch_size=16, learning_rate=1e-2, log_every=1
)


@pytest.fixture(scope="module")
def splits():
    """Real text: the json and email packages of the stdlib, two files held out."""
    stdlib = pathlib.Path(json.__file__).parent.parent
    docs = lm_data.list_documents([("json", stdlib / "json"), ("email", stdlib / "email")])
    texts = [p.read_bytes() for _, p in docs]
    return {
        "train": {"tokens": lm_data.pack(texts[2:], TINY.seq_len, max_rows=2048)},
        "test": {"tokens": lm_data.pack(texts[:2], TINY.seq_len, max_rows=20)},  # 20: padded
    }


# ------------------------------------------------------------------ data


def test_python_corpus_splits_by_document_deterministically(tmp_path):
    root = tmp_path / "lib"
    (root / "pkg").mkdir(parents=True)
    (root / "site-packages").mkdir()
    for i in range(40):
        (root / "pkg" / f"m{i}.py").write_text(f"x = {i}\n" * 10)
    (root / "notes.txt").write_text("plain docs\n")
    (root / "site-packages" / "user.py").write_text("installed, not shipped\n")
    (root / "binary.py").write_bytes(b"a\x00b")  # NUL: the separator, not text
    (root / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))  # not UTF-8
    (root / "image.png").write_bytes(b"\x89PNG")
    ids = [i for i, _ in lm_data.list_documents([("r", root)])]
    assert "r/notes.txt" in ids and "r/pkg/m0.py" in ids and "r/binary.py" in ids
    assert not any("site-packages" in i or i.endswith(".png") for i in ids)
    corpus = lm_data.python_corpus(0.25, roots=[("r", root)])
    texts = {k: set(v) for k, v in corpus.items()}
    assert texts["train"].isdisjoint(texts["test"])
    assert len(texts["train"]) + len(texts["test"]) == 41  # 40 modules + notes.txt
    assert b"a\x00b" not in texts["train"] | texts["test"]
    expected_test = {
        (root / i.removeprefix("r/")).read_bytes()
        for i in ids
        if lm_data.is_held_out(i, 0.25) and i not in ("r/binary.py", "r/latin1.txt")
    }
    assert texts["test"] == expected_test and 2 <= len(expected_test) <= 20
    # Same split again, whatever the file order on disk.
    assert lm_data.python_corpus(0.25, roots=[("r", root)]) == corpus


def test_python_corpus_errors(tmp_path):
    with pytest.raises(ValueError, match=r"heldout_fraction must be in \(0, 1\); received .*=1"):
        lm_data.python_corpus(1)
    (tmp_path / "a.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match=r"The 'test' split is empty: 1 documents were found"):
        lm_data.python_corpus(1e-9, roots=[("r", tmp_path)])


def test_default_corpus_is_the_stdlib_and_tens_of_megabytes():
    docs = lm_data.list_documents()
    ids = {i for i, _ in docs}
    assert "stdlib/json/decoder.py" in ids and "stdlib/asyncio/tasks.py" in ids
    assert not any("site-packages" in i for i in ids)
    assert sum(p.stat().st_size for _, p in docs) > 10_000_000


def test_pack_rows_overlap_by_one_byte():
    rows = lm_data.pack([b"abcdef", b"ghij"], 4)
    stream = b"abcdef\x00ghij"
    assert rows.dtype == np.uint8 and rows.shape == (2, 5)
    assert rows[0].tobytes() == stream[0:5] and rows[1].tobytes() == stream[4:9]
    long = lm_data.pack([bytes(range(1, 101))], 4, max_rows=3)  # 24 rows: keep 0, 12, 23
    assert [r[0] for r in long] == [1, 49, 93]
    with pytest.raises(ValueError, match=r"The text has 3 bytes, fewer than one sequence"):
        lm_data.pack([b"abc"], 4)
    with pytest.raises(ValueError, match=r"seq_len must be a positive int; received seq_len=0"):
        lm_data.pack([b"abc"], 0)


# ------------------------------------------------------------- download


@contextlib.contextmanager
def _serve(directory):
    """A real HTTP server on 127.0.0.1 serving ``directory``; yields its base URL."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Quiet, directory=str(directory))
    )
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture
def mirror(tmp_path):
    www = tmp_path / "www"
    www.mkdir()
    text = b"First Citizen:\nBefore we proceed any further, hear me speak.\n" * 20
    (www / "input.txt").write_bytes(text)
    with _serve(www) as url:
        yield f"{url}/input.txt", www, text, hashlib.sha256(text).hexdigest()


def test_tinyshakespeare_downloads_checks_and_caches(mirror, tmp_path):
    url, www, text, sha = mirror
    cache = tmp_path / "cache"
    out = lm_data.load_tinyshakespeare(cache_dir=cache, url=url, sha256=sha)
    cut = round(len(text) * 0.9)
    assert out == {"train": text[:cut], "test": text[cut:]}
    assert [p.name for p in cache.iterdir()] == ["tinyshakespeare.txt"]  # no temp files left
    (www / "input.txt").unlink()  # cached: the server is no longer needed
    assert lm_data.load_tinyshakespeare(cache_dir=cache, url=url, sha256=sha) == out
    rows = lm_data.tinyshakespeare_splits(32, cache_dir=cache, url=url, sha256=sha)
    assert rows["train"]["tokens"].shape[1] == 33


def test_tinyshakespeare_default_cache_dir_from_env(mirror, tmp_path, monkeypatch):
    url, _, _, sha = mirror
    monkeypatch.setenv("DISTRAIN_DATA_DIR", str(tmp_path / "data"))
    lm_data.load_tinyshakespeare(url=url, sha256=sha)
    assert (tmp_path / "data" / "lm" / "tinyshakespeare.txt").exists()


def test_tinyshakespeare_checksum_mismatch_keeps_nothing(mirror, tmp_path):
    url, _, _, _ = mirror
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match=r"Checksum mismatch for http://127\.0\.0\.1:\d+/input"):
        lm_data.load_tinyshakespeare(cache_dir=cache, url=url)  # the real file's checksum
    assert not any(cache.iterdir())


def test_tinyshakespeare_corrupt_cache_is_deleted_then_redownloaded(mirror, tmp_path):
    url, _, text, sha = mirror
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "tinyshakespeare.txt").write_bytes(b"truncated")
    with pytest.raises(ValueError, match=r"tinyshakespeare.txt is corrupt: sha256 .* deleted"):
        lm_data.load_tinyshakespeare(cache_dir=cache, url=url, sha256=sha)
    assert not (cache / "tinyshakespeare.txt").exists()
    out = lm_data.load_tinyshakespeare(cache_dir=cache, url=url, sha256=sha)
    assert out["train"] + out["test"] == text


def test_tinyshakespeare_unreachable_says_where_to_put_the_file(tmp_path):
    url = f"http://127.0.0.1:{free_port()}/input.txt"  # nothing listens there
    with pytest.raises(ConnectionError, match=r"Could not download .* copy it to .*tinyshakespe"):
        lm_data.load_tinyshakespeare(cache_dir=tmp_path, url=url, timeout=5)
    with pytest.raises(ValueError, match=r"heldout_fraction must be in \(0, 1\)"):
        lm_data.load_tinyshakespeare(cache_dir=tmp_path, url=url, heldout_fraction=0)


def test_the_config_error_offline_lists_the_keys_a_config_can_set(tmp_path):
    """Issue 51: offline, `distrain train --config configs/shakespeare_char.yaml` listed
    `data.kwargs.kwargs` as a settable key (it fails) and not `data.kwargs.url` (which
    works). A data function's own **kwargs is never listed."""
    from distrain._src.train.data_from_config import load_data as _load_data

    url = f"http://127.0.0.1:{free_port()}/input.txt"  # nothing listens there
    cfg = load_config(
        str(ROOT / "configs" / "shakespeare_char.yaml"),
        [f"data.kwargs.cache_dir={tmp_path}", f"data.kwargs.url={url}", "data.kwargs.timeout=5"],
    )
    with pytest.raises(dt.config.ConfigError) as offline:
        _load_data(cfg, lm_data.tinyshakespeare_splits)
    text = str(offline.value)
    assert "data.kwargs.seq_len, data.kwargs.whole_test, data.kwargs.cache_dir, " in text
    assert "data.kwargs.url, data.kwargs.sha256, " in text and "kwargs.kwargs" not in text

    def wrapper(seq_len: int = 8, **kwargs: object) -> None:
        raise OSError("offline")

    with pytest.raises(dt.config.ConfigError, match=r"are set as data.kwargs.seq_len;"):
        _load_data(cfg, wrapper)


def test_tinyshakespeare_known_checksum():
    assert lm_data.TINYSHAKESPEARE_SHA256 == (
        "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
    )
    assert lm_data.TINYSHAKESPEARE_URL.endswith("/data/tinyshakespeare/input.txt")


# ------------------------------------------------------------------ model


def test_gpt2_small_config_has_gpt2_small_shapes():
    s = settings_from_config(str(ROOT / "configs/lm_gpt2_small.yaml"))
    assert s.model.dtype == "bfloat16" and s.model.seq_len == 1024
    n = count_params(s.model)
    # nanoGPT's GPT-2 small with the vocabulary padded to 50304: 124,475,904.
    assert n == {"total": 124_475_904, "position": 786_432, "matmul": 123_689_472, "expert": 0}
    assert flops_per_token(s.model) == 6 * 123_689_472 + 12 * 12 * 1024 * 768


def test_tiny_config_is_about_a_million_parameters():
    s = settings_from_config(str(ROOT / "configs/lm_tiny.yaml"))
    assert 0.5e6 < count_params(s.model)["total"] < 1.5e6
    assert s.steps == 300 and s.model.positions == "rope"


def test_settings_need_steps():
    overrides = ["train.steps=null", "train.epochs=1"]
    with pytest.raises(ValueError, match=r"lm_tiny.yaml: .* train.steps is null .* Set train"):
        settings_from_config(str(ROOT / "configs/lm_tiny.yaml"), overrides)


def test_data_seq_len_must_match_the_model():
    s = dataclasses.replace(SETTINGS, data_kwargs={"seq_len": 8})
    with pytest.raises(ValueError, match=r"data seq_len \(8\) differs from the model's seq_len"):
        load_splits(s)


def test_model_config_errors():
    with pytest.raises(ValueError, match=r"d_model \(30\) must be a multiple of n_heads \(4\)"):
        LMConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match=r"Rotary positions need an even head size; .* = 3"):
        LMConfig(d_model=12, n_heads=4)
    with pytest.raises(ValueError, match=r"LMConfig.dtype must be one of .* Received: 'fp8'"):
        LMConfig(dtype="fp8")
    with pytest.raises(ValueError, match=r"LMConfig.n_layers must be a positive int"):
        LMConfig(n_layers=0)
    with pytest.raises(ValueError, match=r"LMConfig.pipeline_microbatches must be a positive"):
        LMConfig(pipeline_microbatches=0)
    with pytest.raises(ValueError, match=r"LMConfig.pipeline_repeats must be a positive int"):
        LMConfig(pipeline_repeats=0)
    with pytest.raises(ValueError, match=r"at most seq_len=16 tokens; received a sequence of 17"):
        jax.eval_shape(lambda: Transformer(TINY, rngs=nnx.Rngs(0))(jnp.zeros((1, 17), jnp.int32)))


@pytest.mark.parametrize("positions", ["rope", "learned"])
@pytest.mark.split_ends  # a slow test: see tests/conftest.py
def test_bf16_model_is_causal_and_returns_float32_logits(positions):
    cfg = dataclasses.replace(TINY, dtype="bfloat16", positions=positions)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 256)
    forward = jax.jit(lambda t: model(t))
    logits = forward(tokens)
    assert logits.dtype == jnp.float32 and logits.shape == (2, 16, 256)
    assert model.blocks[0].attn.qkv.kernel[...].dtype == jnp.float32  # params stay f32
    changed = forward(tokens.at[:, 10].set(7))  # a later token must not change earlier outputs
    np.testing.assert_array_equal(logits[:, :10], changed[:, :10])


def test_perplexity_is_exp_of_the_mean_token_loss():
    losses, mask = jnp.array([[1.0, 2.0], [3.0, 9.0]]), jnp.array([[1, 1], [1, 0]])
    p = Perplexity.from_values(losses, mask=mask)
    assert p.compute() == pytest.approx(math.exp(2.0))


def test_generate_greedy_equals_the_full_recompute_and_checks_lengths(model):
    step, state = model
    apply_fn = step.keywords["apply_fn"]
    out = generate(TINY, state.params, b"def ", num_bytes=6)
    assert out.startswith(b"def ") and len(out) <= 10
    # Greedy from the KV cache: each byte is the argmax of the whole window recomputed.
    ids = list(out)
    for t in range(4, len(ids)):
        window = jnp.zeros((1, 16), jnp.int32).at[0, :t].set(jnp.array(ids[:t]))
        assert int(jnp.argmax(apply_fn(state.params, window)[0, t - 1])) == ids[t]
    with pytest.raises(ValueError, match=r"len\(prompt\) \+ num_bytes <= seq_len \(16\)"):
        generate(TINY, state.params, b"def ", num_bytes=13)


# ------------------------------------------------------- training on replicas


@pytest.fixture(scope="module")
def model():
    """``(train_step, initial state)``: one step function, so each strategy compiles once.

    Plain SGD: its update is proportional to the gradient, so a gradient that is summed
    or scaled wrongly across replicas shows in the parameters (Adam's update would
    hide a constant factor).
    """
    apply_fn, state = init_state(dataclasses.replace(SETTINGS, optimizer="sgd", learning_rate=0.5))
    return functools.partial(train_step, apply_fn=apply_fn), state


@pytest.fixture(scope="module")
def strategy8(devices):
    return dt.MirroredStrategy(devices)


def _fit(strategy, model, train_rows, steps, callbacks=()):
    step, state = model  # fit copies the state it is given: `state` stays valid
    trainer = dt.Trainer(strategy, step, log_every=1)
    data = ArrayPipeline(train_rows, global_batch_size=16, seed=0, num_epochs=None)
    state, history = trainer.fit(state, data, steps=steps, callbacks=callbacks)
    return jax.device_get(state.params), history.history["loss"][-1]


@pytest.mark.one_end("newest")  # a slow test: see tests/conftest.py
def test_one_eight_and_sharded_replicas_agree_after_two_steps(devices, strategy8, model, splits):
    one = _fit(dt.MirroredStrategy(devices[:1]), model, splits["train"], 2)
    eight = _fit(strategy8, model, splits["train"], 2)
    sharded_strategy = dt.MirroredStrategy(devices, shard_state=True, min_shard_bytes=0)
    sharded = _fit(sharded_strategy, model, splits["train"], 2)
    assert np.isfinite(one[1])

    def close(a, b):  # only the summation order differs
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    for other in (eight, sharded):
        assert other[1] == pytest.approx(one[1], rel=1e-5)
        jax.tree.map(close, other[0], one[0])


def test_megatron_tensor_parallelism_with_fsdp_equals_one_device(devices, model, splits):
    """One replica of {fsdp: 4, tensor: 2} with the example's Megatron rules and its
    hidden-state constraint: the rules lay out the parameters (and moments) as written,
    and two SGD steps give one device's parameters (summation order aside)."""
    from distrain.models import TENSOR_PARALLEL_LAYOUT

    strategy = dt.MirroredStrategy(
        devices_per_replica={"fsdp": 4, "tensor": 2}, layout=TENSOR_PARALLEL_LAYOUT
    )
    placed = strategy.put_replicated(model[1])
    block = placed.params["blocks"][0]
    assert block["attn"]["qkv"]["kernel"].sharding.spec == P("fsdp", "tensor")
    assert block["mlp"]["proj"]["kernel"].sharding.spec == P("tensor", "fsdp")
    assert placed.params["embed"]["embedding"].sharding.spec == P("tensor", "fsdp")
    one = _fit(dt.MirroredStrategy(devices[:1]), model, splits["train"], 2)
    tp = _fit(strategy, model, splits["train"], 2)
    assert tp[1] == pytest.approx(one[1], rel=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), tp[0], one[0])


def test_resume_from_a_backup_is_exact(strategy8, model, splits, tmp_path):
    straight, _ = _fit(strategy8, model, splits["train"], 4)

    def backup():
        return dt.callbacks.BackupAndRestore(tmp_path, save_freq=2, delete_checkpoint=False)

    _fit(strategy8, model, splits["train"], 2, [backup()])
    cb = backup()
    resumed, _ = _fit(strategy8, model, splits["train"], 4, [cb])
    assert cb.restored_step == 2
    jax.tree.map(np.testing.assert_array_equal, resumed, straight)


def test_example_trains_on_eight_replicas(devices, splits, tmp_path):
    s = dataclasses.replace(SETTINGS, steps=4, eval_every=2, prompts=("def ",), sample_bytes=8)
    lines = []
    result = train_and_evaluate(
        s,
        splits=splits,
        strategy=dt.MirroredStrategy(devices),
        workdir=tmp_path / "work",
        out_dir=tmp_path / "out",
        progress=False,
        log=lines.append,
    )
    assert result["replicas"] == 8 and result["steps"] == 4
    assert result["curve"]["step"] == [2, 4]
    assert result["final_val_loss"] < result["initial_val_loss"] - 0.3  # it learns
    assert result["final_val_perplexity"] == pytest.approx(math.exp(result["final_val_loss"]))
    tp = result["throughput"]
    assert tp["tokens_per_sec"] > 0 and tp["examples_per_sec"] > 0 and "mfu" not in tp
    assert result["samples"]["def "].startswith("def ")
    assert any(line.startswith("throughput: ") and "MFU n/a" in line for line in lines)
    saved = json.loads((tmp_path / "out" / "result.json").read_text())
    assert saved["final_val_loss"] == result["final_val_loss"]
    assert (tmp_path / "out" / "learning_curve.png").stat().st_size > 1000
    assert list((tmp_path / "work" / "checkpoints").iterdir())  # ModelCheckpoint kept one
    assert not (tmp_path / "work" / "backup").exists()  # finished: backups removed


def test_a_short_run_counts_its_own_steps_on_one_replica(devices, splits, capfd):
    """Issue 51: `python -m examples.lm.main ... --steps 20` printed `20/50 steps` (one
    evaluation every 50 steps, the bar counting to it) and `1 replicas`."""
    s = dataclasses.replace(SETTINGS, steps=2, devices=1, prompts=())
    lines = []
    result = train_and_evaluate(s, splits=splits, log=lines.append)
    assert result["curve"]["step"] == [2] and result["replicas"] == 1
    assert "epoch 1/1: 2/2 steps" in capfd.readouterr().err
    assert any("; 1 replica on " in line for line in lines), lines


def test_the_curve_command_writes_under_runs_unless_told_otherwise():
    """Issue 51: docs/lm.md's curve command wrote into docs/, over the committed figure."""
    from examples.lm.curve import parser

    assert parser().parse_args([]).out == "runs/shakespeare_char"
    doc = (ROOT / "docs" / "lm.md").read_text()
    commands = [line for line in doc.splitlines() if line.startswith("python -m examples.lm.curve")]
    assert commands and not any("docs/" in c for c in commands), commands
    assert "add\n`--out docs/shakespeare_char` to regenerate the committed figure" in doc


def test_shakespeare_samples_start_from_a_plays_speakers():
    """Issue 51: TinyShakespeare's samples were prompted with Python (`def`, `import`)."""
    recipe = settings_from_config(str(ROOT / "configs" / "shakespeare_char.yaml"))
    assert recipe.prompts == ("First Citizen:\n", "ROMEO:\n", "JULIET:\n")
    assert settings_from_config(str(ROOT / "configs" / "lm_tiny.yaml")).prompts[0] == "def "


@pytest.mark.one_end("newest")  # a slow test: see tests/conftest.py
def test_distrain_train_runs_the_tiny_config(devices):
    overrides = [
        "model.kwargs.seq_len=16", "model.kwargs.d_model=32", "model.kwargs.n_layers=2",
        "model.kwargs.n_heads=2", "data.kwargs.seq_len=16", "data.kwargs.max_documents=40",
        "data.kwargs.heldout_fraction=0.3", "data.kwargs.max_test_rows=24",
        "data.global_batch_size=16", "data.eval_batch_size=16", "train.steps=2",
    ]  # fmt: skip
    lines = []
    result = run_config(
        load_config(ROOT / "configs/lm_tiny.yaml", overrides),
        progress_bar=False,
        print_fn=lines.append,
    )
    assert result.history.history["loss"] and np.isfinite(result.history.history["loss"][-1])
    m = result.test_metrics
    assert m["perplexity"] == pytest.approx(math.exp(m["loss"])) and m["loss"] < 5.6
    assert any(line.startswith("final test: loss=") for line in lines)


@pytest.mark.one_end("newest")  # a slow test: see tests/conftest.py
def test_gpt2_small_trains_with_fsdp_over_eight_devices(devices, splits):
    """GPT-2 small's widths, vocabulary and heads (2 of its 12 blocks and seq 16 to keep
    CPU time low; test_gpt2_small_config_has_gpt2_small_shapes checks the rest) as one
    replica over 8 devices: every large leaf is split 8 ways, the step fits in ~1/8 of
    the state per device, and two steps train (the loss is finite and the parameters
    move)."""
    s = settings_from_config(
        str(ROOT / "configs/lm_gpt2_small.yaml"), ["strategy.devices_per_replica=8"]
    )
    assert s.devices_per_replica == 8
    model = dataclasses.replace(s.model, seq_len=16, dtype="float32", n_layers=2)
    s = dataclasses.replace(s, model=model)
    strategy = make_strategy(s)
    assert strategy.num_replicas_in_sync == 1 and strategy.devices_per_replica == 8
    apply_fn, state = init_state(s)
    step = functools.partial(train_step, apply_fn=apply_fn)
    placed = strategy.put_replicated(state)
    report = strategy.memory_report(placed)
    assert report["bytes_per_device"] < 0.13 * report["bytes_full_copy"]  # ~1/8 + small leaves
    batch = strategy.distribute_batch({"tokens": splits["train"]["tokens"][:8]})
    peak = strategy.memory_analysis(step, args=(placed, batch))["peak_bytes"]
    assert peak < 0.5 * report["bytes_full_copy"]  # a mirrored step holds >= 1 full copy
    trainer = dt.Trainer(strategy, step, log_every=1)
    data = ArrayPipeline(splits["train"], global_batch_size=8, seed=0, num_epochs=None)
    final, history = trainer.fit(state, data, steps=2)
    assert all(np.isfinite(history.history["loss"]))
    before = jax.tree.leaves(state.params)[0]
    after = jax.tree.leaves(final.params)[0]
    assert after.shape == before.shape and not np.array_equal(np.asarray(after), np.asarray(before))


# ------------------------------------------------------------- pipeline stages
PIPED = dataclasses.replace(TINY, n_layers=8, pipeline_microbatches=4)


def test_stacked_blocks_are_the_list_model(splits):
    """The pipelined model's stacked blocks are the list model's blocks, one leading
    layer dimension: the same parameters give the same logits, packed rows included
    (segment ids and positions travel with each microbatch)."""
    from distrain.models import make_apply_fn

    listed = dataclasses.replace(PIPED, pipeline_microbatches=None)
    graphdef, params = nnx.split(Transformer(listed, rngs=nnx.Rngs(0)))
    params = nnx.to_pure_dict(params)
    blocks = [params["blocks"][i] for i in range(listed.n_layers)]
    stacked = dict(params, blocks=jax.tree.map(lambda *xs: jnp.stack(xs), *blocks))
    piped_graph, _ = nnx.split(nnx.eval_shape(lambda: Transformer(PIPED, rngs=nnx.Rngs(0))))
    tokens = jnp.asarray(splits["train"]["tokens"][:8, :16])
    segments = jnp.asarray(np.repeat([[1] * 6 + [2] * 10], 8, 0))
    positions = jnp.asarray(np.repeat([list(range(6)) + list(range(10))], 8, 0))
    for extra in ((), (segments, positions)):
        want = make_apply_fn(graphdef)(params, tokens, *extra)
        got = make_apply_fn(piped_graph)(stacked, tokens, *extra)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def piped_model():
    apply_fn, state = init_state(
        dataclasses.replace(SETTINGS, model=PIPED, optimizer="sgd", learning_rate=0.5)
    )
    return functools.partial(train_step, apply_fn=apply_fn), state


@pytest.fixture(scope="module")
def piped_one_device(devices, piped_model, splits):
    """The same stacked model on one device: dt.nn.pipeline is a scan over the layers."""
    return _fit(dt.MirroredStrategy(devices[:1]), piped_model, splits["train"], 2)


@pytest.mark.split_ends  # a slow test: see tests/conftest.py
@pytest.mark.parametrize(
    "n_devices, mesh, accum",
    [(4, {"stage": 4}, 1), (8, {"stage": 4}, 2), (8, {"stage": 2, "fsdp": 2}, 1)],
    ids=["1x{stage:4}", "2x{stage:4}+accum", "2x{stage:2,fsdp:2}"],
)
def test_pipelined_lm_trains_as_the_unpipelined_model(
    devices, piped_model, piped_one_device, splits, n_devices, mesh, accum
):
    """The LM's 8 blocks over pipeline stages (GPipe, 4 microbatches), each stage's
    layers on its devices: two SGD steps give the one-device parameters (summation
    order aside), with gradient accumulation as well."""
    from distrain.models import pipeline_layout

    strategy = dt.MirroredStrategy(
        devices[:n_devices], devices_per_replica=mesh, layout=pipeline_layout(mesh)
    )
    assert strategy.num_replicas_in_sync == n_devices // 4
    placed = strategy.put_replicated(piped_model[1]).params["blocks"]
    want_spec = P("stage", "fsdp") if "fsdp" in mesh else P("stage")
    assert placed["mlp"]["fc"]["kernel"].sharding.spec == want_spec
    assert placed["norm1"]["scale"].sharding.spec == P("stage")
    step, state = piped_model
    trainer = dt.Trainer(strategy, step, log_every=1, grad_accum_steps=accum)
    data = ArrayPipeline(splits["train"], global_batch_size=16, seed=0, num_epochs=None)
    got, history = trainer.fit(state, data, steps=2)
    params, loss = jax.device_get(got.params), history.history["loss"][-1]
    want_params, want_loss = piped_one_device
    assert loss == pytest.approx(want_loss, rel=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), params, want_params
    )


@pytest.mark.one_end("lowest")  # a slow test: see tests/conftest.py
def test_a_pipelined_checkpoint_restores_on_one_device_and_back(
    devices, piped_model, splits, tmp_path
):
    """The state of a pipelined run is the ordinary (stacked) state: its checkpoint
    restores bit for bit on one device, and one device's back onto the stages."""
    from distrain.models import pipeline_layout

    staged = dt.MirroredStrategy(
        devices_per_replica={"stage": 4}, layout=pipeline_layout({"stage": 4})
    )
    one = dt.OneDeviceStrategy(devices[0])
    step, state = piped_model
    backup = dt.callbacks.BackupAndRestore(tmp_path / "b", save_freq=2, delete_checkpoint=False)
    data = ArrayPipeline(splits["train"], global_batch_size=16, seed=0, num_epochs=None)
    trained, _ = dt.Trainer(staged, step).fit(state, data, steps=2, callbacks=[backup])
    saved = jax.device_get(trained.params)
    with dt.checkpoint.CheckpointManager(tmp_path / "b") as mgr:
        on_one = mgr.restore(target=one.put_replicated(state))
    assert on_one.step == 2
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(on_one.state.params), saved)
    with dt.checkpoint.CheckpointManager(tmp_path / "one") as mgr:
        mgr.save(2, on_one.state)
        mgr.wait_until_finished()
        back = mgr.restore(target=staged.put_replicated(state))
    kernel = back.state.params["blocks"]["attn"]["qkv"]["kernel"]
    assert kernel.sharding.spec == P("stage")
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(back.state.params), saved)


@pytest.mark.split_ends  # a slow test: see tests/conftest.py
@pytest.mark.parametrize("microbatches", [None, 2], ids=["blocks", "pipelined"])
def test_every_remat_policy_trains_as_without_remat(devices, splits, microbatches):
    """Remat changes what is kept for the backward pass, never the result: two SGD steps
    under each LMConfig.remat policy give the parameters of no remat (the pipelined
    model's path too; without a stage axis it is a scan over the layers)."""
    from distrain.models import REMAT_POLICIES

    results = {}
    for policy in REMAT_POLICIES:
        settings = dataclasses.replace(
            SETTINGS,
            optimizer="sgd",
            learning_rate=0.5,
            model=dataclasses.replace(
                TINY, n_layers=2, remat=policy, pipeline_microbatches=microbatches
            ),
        )
        apply_fn, state = init_state(settings)
        step = functools.partial(train_step, apply_fn=apply_fn)
        results[policy] = _fit(dt.MirroredStrategy(devices[:1]), (step, state), splits["train"], 2)
    assert set(results) == {"none", "dots_saveable", "nothing_saveable", "offload_dots"}
    for policy, (params, loss) in results.items():
        assert loss == pytest.approx(results["none"][1], rel=1e-6), policy
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
            params,
            results["none"][0],
        )
