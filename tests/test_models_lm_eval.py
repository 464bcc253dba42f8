"""``dt.models.LMEvalModel``: lm-evaluation-harness through a strategy, on tasks defined in
local files (nothing downloaded): a multiple-choice task (``loglikelihood``), a perplexity
task (``loglikelihood_rolling``) and a generation task (``generate_until``). A
continuation's log-likelihood is the model's own token log-probabilities summed; every
metric and log-likelihood is the same on 1 device, 8 replicas and ``{"fsdp": 4}``; the
``distrain lm-eval`` command runs lm-eval's command line on a run's checkpoint; lm-eval's
own ``hf`` model gives the same answers on the exported checkpoint (where PyTorch is
installed); the callback adds the metrics to ``fit``'s logs; every wrong input is one line.
"""

import json
import os
import re
import subprocess
import sys

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the tasks' data are local files

import jax
import numpy as np
import pytest
from flax import nnx

import distrain as dt
from tests.processes import xla_flags

pytest.importorskip("lm_eval")
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from distrain._src.models.export_command import byte_tokenizer  # noqa: E402

SEQ = 16  # the context: a byte-level model, so some requests are longer (left-truncated)
TASKS = ["dt_choice", "dt_perplexity", "dt_generate"]
CHOICE = [
    {"q": "Sky:", "c": [" blue", " red", " loud"], "a": 0},
    {"q": "2+2=", "c": [" 4", " 5"], "a": 1},
    {"q": "A question longer than the context", "c": [" yes", " no"], "a": 0},
]
PERPLEXITY = [{"text": "Hello world."}, {"text": "To be, or not to be, that is the question."}]
GENERATE = [{"q": "Q: 1+1=\nA:", "a": " 2"}, {"q": "abc", "a": "d"}, {"q": "The end", "a": "."}]
_TASK = """task: {name}
dataset_path: json
dataset_kwargs: {{data_files: {{test: {path}}}}}
test_split: test
output_type: {output_type}
{rest}
"""
_RESTS = {
    "dt_choice": ("multiple_choice", CHOICE, 'doc_to_text: "{{q}}"\ndoc_to_choice: "{{c}}"\n'
                  'doc_to_target: "{{a}}"\nmetric_list: [{metric: acc, aggregation: mean, '
                  "higher_is_better: true}]"),
    "dt_perplexity": ("loglikelihood_rolling", PERPLEXITY, 'doc_to_text: ""\n'
                      'doc_to_target: "{{text}}"\nmetric_list: [{metric: word_perplexity, '
                      "aggregation: weighted_perplexity, higher_is_better: false}, {metric: "
                      "bits_per_byte, aggregation: bits_per_byte, higher_is_better: false}]"),
    "dt_generate": ("generate_until", GENERATE, 'doc_to_text: "{{q}}"\ndoc_to_target: "{{a}}"\n'
                    'generation_kwargs: {until: ["\\n"], max_gen_toks: 6, do_sample: false}\n'
                    "metric_list: [{metric: exact_match, aggregation: mean, "
                    "higher_is_better: true}]"),
}  # fmt: skip
EVAL = {"bootstrap_iters": 0, "log_samples": True}


def _params():
    """A tiny byte-level GPT-2's parameters, random (NumPy: nothing compiled), with
    kernels large enough that the continuations vary, and only printable ASCII and
    newline in the (tied) token table, so that generations are text that newline stops."""
    cfg = dt.models.LMConfig(vocab_size=256, seq_len=SEQ, d_model=32, n_layers=2,
                             n_heads=4, positions="learned", norm_eps=1e-5)  # fmt: skip
    abstract = nnx.eval_shape(lambda: dt.models.Transformer(cfg, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(0)

    def init(path, x):
        name = jax.tree_util.keystr(path)
        if "scale" in name:
            return np.ones(x.shape, np.float32)
        std = 0.16 if "kernel" in name else 0.02 if "embedding" in name else 0.0
        return (rng.standard_normal(x.shape) * std).astype(np.float32)

    params = jax.tree_util.tree_map_with_path(init, nnx.to_pure_dict(nnx.state(abstract)))
    keep = np.zeros((256, 1), np.float32)
    keep[32:127], keep[10] = 1, 2.5  # newline likelier: some generations stop early
    params["embed"]["embedding"] = params["embed"]["embedding"] * keep
    return cfg, params


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """``(hf_dir, tasks_dir, cfg, params)``: the model exported to the GPT-2 layout with
    a byte-level tokenizer whose end of text is byte 0 (for transformers too), and the
    three tasks' YAML and JSON-lines files."""
    root = tmp_path_factory.mktemp("lm_eval")
    cfg, params = _params()
    hf = root / "hf"
    dt.models.save_pretrained(str(hf), params, cfg, tokenizer=byte_tokenizer())
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps(config | {"eos_token_id": 0}))
    special = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "\u0100"}
    (hf / "tokenizer_config.json").write_text(json.dumps(special))  # byte 0's character
    tasks = root / "tasks"
    tasks.mkdir()
    for name, (output_type, rows, rest) in _RESTS.items():
        data = tasks / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        text = _TASK.format(name=name, path=data, output_type=output_type, rest=rest)
        (tasks / f"{name}.yaml").write_text(text)
    return str(hf), str(tasks), cfg, params


@pytest.fixture(scope="module")
def tasks(files):
    """lm-eval's TaskManager of the three tasks only: indexing lm-eval's own 14,683 task
    files takes 18 s of CPU, which an `include_path=` alone would add to every call."""
    return TaskManager(include_path=files[1], include_defaults=False)


@pytest.fixture(scope="module")
def one_device(files, tasks):
    """The model on one device, and its results on the three tasks."""
    lm = dt.models.LMEvalModel.from_pretrained(files[0], strategy=dt.get_strategy())
    return lm, lm.evaluate(TASKS, task_manager=tasks, **EVAL)


def _answers(results):
    """Per task: the metrics, and every response (log-likelihoods, generated texts)."""
    out = {}
    for task in TASKS:
        metrics = {k: v for k, v in results["results"][task].items() if ",none" in k}
        metrics = {k: v for k, v in metrics.items() if "_stderr" not in k}
        out[task] = metrics, [s["resps"] for s in results["samples"][task]]
    return out


def _assert_same(got, want, rtol=1e-6):
    """Equal metrics (counts exactly, perplexities within ``rtol``), log-likelihoods
    within ``rtol`` and the same greedy flags and generated texts."""
    for task in TASKS:
        (m1, r1), (m2, r2) = got[task], want[task]
        assert m1.keys() == m2.keys()
        for k in m1:
            exact = k.startswith(("acc", "exact_match"))
            assert m1[k] == m2[k] if exact else np.isclose(m1[k], m2[k], rtol=rtol), (task, k)
        for a, b in zip(jax.tree.leaves(r1), jax.tree.leaves(r2), strict=True):
            if isinstance(a, float) and not isinstance(a, bool):
                np.testing.assert_allclose(a, b, rtol=rtol, err_msg=task)
            else:
                assert a == b, (task, a, b)


def _direct(cfg, params, sequences):
    """For each token sequence: log p(token i + 1 | tokens up to i) (float64 from the
    float32 logits) and whether it is the argmax, by the plain forward pass (one batch,
    padded on the right: a causal model never reads it)."""
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: dt.models.Transformer(cfg, rngs=nnx.Rngs(0))))
    tokens = np.zeros((len(sequences), SEQ), np.int32)
    for i, s in enumerate(sequences):
        tokens[i, : len(s) - 1] = s[:-1]
    out = np.asarray(jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, tokens), np.float64)
    top = out.max(-1, keepdims=True)
    logp = out - top - np.log(np.exp(out - top).sum(-1, keepdims=True))
    rows = [np.arange(len(s) - 1) for s in sequences]
    return [(logp[i, r, s[1:]], out[i, r].argmax(-1) == np.asarray(s[1:]))
            for i, (r, s) in enumerate(zip(rows, sequences, strict=True))]  # fmt: skip


# ------------------------------------------------------------------ exactness


def test_loglikelihood_is_the_sum_of_the_models_token_log_probabilities(files, one_device):
    """Of the continuation's tokens only; an empty context conditions on the end-of-text
    byte (lm-eval's prefix token); a request longer than the context is left-truncated
    to its last ``SEQ + 1`` tokens, as lm-eval's hf model does; a rolling log-likelihood
    within the context is the text's, conditioned on byte 0."""
    _, _, cfg, params = files
    lm = one_device[0]
    cases = [("Sky:", " blue"), ("", "Hello"), ("x" * 30 + ":", " abc")]
    got = lm.loglikelihood([Instance("loglikelihood", {}, c, i) for i, c in enumerate(cases)])
    text = "Hello world."
    (rolling,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    sequences = [list((c or "\0").encode() + x.encode())[-(SEQ + 1) :] for c, x in cases]
    direct = _direct(cfg, params, [*sequences, [0, *text.encode()]])
    for (_, continuation), (logp, greedy), (want, argmax) in zip(cases, got, direct, strict=False):
        n = len(continuation.encode())
        np.testing.assert_allclose(logp, want[-n:].sum(), rtol=1e-6)
        assert greedy == bool(argmax[-n:].all())
    np.testing.assert_allclose(rolling, direct[-1][0].sum(), rtol=1e-6)


# One device against each layout; the two variants run on alternate ends of the jax range
# (each compiles a scoring and a generation program: see tests/conftest.py).
@pytest.mark.split_ends
@pytest.mark.parametrize("layout", ["eight replicas", "fsdp"])
def test_tasks_score_the_same_on_one_device_eight_replicas_and_fsdp(
    layout, files, tasks, one_device, devices
):
    want = _answers(one_device[1])
    texts = [r[0][0] for r in want["dt_generate"][1]]
    assert all(t.isprintable() for t in texts), texts  # text, cut before a newline
    assert min(map(len, texts)) < 6 == max(map(len, texts)), texts  # stopped; max_gen_toks
    mesh = {"fsdp": 4} if layout == "fsdp" else None
    strategy = dt.MirroredStrategy(devices_per_replica=mesh, min_shard_bytes=0) if mesh else (
        dt.MirroredStrategy())  # fmt: skip
    lm = dt.models.LMEvalModel.from_pretrained(files[0], strategy=strategy)
    assert lm.batches.rows == 16 and strategy.num_replicas_in_sync == (2 if mesh else 8)
    if mesh:
        kernel = lm.params["blocks"][0]["mlp"]["fc"]["kernel"][...]
        assert "fsdp" in str(kernel.sharding.spec), kernel.sharding
    _assert_same(_answers(lm.evaluate(TASKS, task_manager=tasks, **EVAL)), want)


# ------------------------------------------------------------------ during fit


def test_the_callback_adds_the_tasks_metrics_to_the_epochs_logs(files, tasks, one_device):
    import optax

    lm = one_device[0]
    want = one_device[1]["results"]["dt_choice"]["acc,none"]
    cb = dt.models.LMEvalCallback(lm, ["dt_choice"], task_manager=tasks, bootstrap_iters=0)
    seen = []
    after = dt.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: seen.append(dict(logs)))
    state = dt.TrainState.create(apply_fn=None, params=files[3], tx=optax.sgd(0.0))
    trainer = dt.Trainer(train_step=lambda state, batch: (state, {"loss": batch["x"].sum()}))
    trainer.fit(state, [{"x": np.zeros((2, 1), np.float32)}], epochs=1, callbacks=[cb, after])
    assert seen[0]["lm_eval/dt_choice/acc"] == want
    assert cb.results == [(0, {"lm_eval/dt_choice/acc": want})]


# ------------------------------------------------------------------ the command

_RUN = """
name: lm_eval_test
strategy: {name: mirrored}
model:
  fn: distrain.models:transformer
  kwargs: {vocab_size: 256, seq_len: 16, d_model: 32, n_layers: 2, n_heads: 4,
           positions: learned, norm_eps: 1.0e-5}
data:
  fn: examples.lm.data:tinyshakespeare_splits
  kwargs: {seq_len: 16}
  global_batch_size: 8
optimizer: {name: adamw, learning_rate: 0.001}
train:
  train_step: examples.lm.train:train_step
  steps: 1
"""


def _run(tmp_path, params, save=True):
    """A run config and a checkpoint of a TrainState holding ``params`` at step 3."""
    import optax

    (tmp_path / "run.yaml").write_text(_RUN)
    state = dt.TrainState.create(apply_fn=None, params=params, tx=optax.adamw(1e-3))
    with dt.checkpoint.CheckpointManager(tmp_path / "ckpt", async_save=False) as manager:
        if save:
            manager.save(3, state)
    return str(tmp_path / "run.yaml"), str(tmp_path / "ckpt")


@pytest.mark.one_end("newest")  # real processes on loopback (tests/conftest.py)
def test_on_two_processes_both_evaluate_and_process_0_alone_returns(files, one_device,
                                                                   tmp_path):  # fmt: skip
    """docs/evaluation.md: on N processes every process runs the same requests through
    the strategy and only process 0 gets (and writes) the results: they are one device's."""
    from distrain._src.cluster.launch import free_port
    from tests.processes import run_together
    from tests.test_multi_worker import clean_env

    script = os.path.join(os.path.dirname(__file__), "scripts", "lm_eval_mp.py")
    port = free_port()
    argv = [sys.executable, script, "--hf", files[0], "--tasks-dir", files[1],
            "--task", "dt_choice", "--out", str(tmp_path)]  # fmt: skip
    env = dict(DISTRAIN_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", DISTRAIN_NUM_PROCESSES="2",
               DISTRAIN_TIMEOUT_SECONDS="60", HF_DATASETS_OFFLINE="1",
               PYTHONPATH=os.path.dirname(os.path.dirname(__file__)))  # fmt: skip
    jobs = [(argv, clean_env(2, DISTRAIN_PROCESS_ID=str(i), **env)) for i in range(2)]
    for code, log, _ in run_together(jobs, 300):
        assert code == 0, log[-3000:]
    assert json.loads((tmp_path / "result_1.json").read_text()) is None
    got = json.loads((tmp_path / "result_0.json").read_text())
    metrics, resps = _answers(one_device[1])["dt_choice"]
    assert {k: v for k, v in got["results"]["dt_choice"].items() if k in metrics} == metrics
    for a, b in zip(jax.tree.leaves(got["resps"]), jax.tree.leaves(resps), strict=True):
        assert np.isclose(a, b, rtol=1e-6) if isinstance(b, float) else a == b


# A process of its own, and lm-eval's command line reads its 14,683 task files at every
# start (18 s of CPU): on one end of the jax range (tests/conftest.py).
@pytest.mark.one_end("newest")
def test_distrain_lm_eval_runs_lm_evals_command_line_on_a_runs_checkpoint(files, one_device,
                                                                          tmp_path):  # fmt: skip
    """On the config's strategy (8 replicas), the byte tokenizer of a vocabulary of 256;
    lm-eval's own flags pass through; the results it writes are one device's."""
    config, ckpt = _run(tmp_path, files[3])
    out = tmp_path / "results"
    env = dict(os.environ, XLA_FLAGS=xla_flags(8), JAX_PLATFORMS="cpu", HF_DATASETS_OFFLINE="1")
    argv = [sys.executable, "-m", "distrain.cli", "lm-eval", "--config", config,
            "--checkpoint", ckpt, "--tasks", "dt_choice", "dt_generate", "--include_path",
            files[1], "--output_path", str(out), "--batch_size", "16"]  # fmt: skip
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (written,) = out.rglob("results_*.json")
    results = json.loads(written.read_text())["results"]
    for task, metric in (("dt_choice", "acc,none"), ("dt_generate", "exact_match,none")):
        assert results[task][metric] == one_device[1]["results"][task][metric]
    assert "|dt_choice" in done.stdout  # lm-eval's own table


# ------------------------------------------------------------------ live, with PyTorch


def test_lm_evals_own_hf_model_gives_the_same_answers_on_the_export(files, tasks, one_device):
    """Where PyTorch and transformers are installed: lm-eval's ``hf`` model reads the
    exported directory (config.json, safetensors, tokenizer.json); log-likelihoods within
    1e-5 relative (PyTorch's float32 kernels are not XLA's), the same greedy flags,
    generated texts and counts, and perplexities within 1e-5."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import lm_eval

    theirs = lm_eval.simple_evaluate(
        model="hf", model_args={"pretrained": files[0], "dtype": "float32"}, tasks=TASKS,
        task_manager=tasks, device="cpu", batch_size=1, **EVAL,
    )  # fmt: skip
    got, want = _answers(theirs), _answers(one_device[1])
    _assert_same(got, want, rtol=1e-5)
    pairs = [(a, b) for t in TASKS for a, b in zip(jax.tree.leaves(got[t][1]),
             jax.tree.leaves(want[t][1]), strict=True) if type(a) is float]  # fmt: skip
    worst = max(abs(a - b) / abs(b) for a, b in pairs)
    print(f"lm-eval hf vs distrain: {len(pairs)} log-likelihoods, max relative gap {worst:.2e}")


# ------------------------------------------------------------------ wrong input


def _module(**kw):
    cfg = dt.models.LMConfig(**{"vocab_size": 96, "seq_len": 16, "d_model": 16, "n_layers": 1,
                                "n_heads": 2} | kw)  # fmt: skip
    return nnx.eval_shape(lambda: dt.models.Transformer(cfg, rngs=nnx.Rngs(0)))


def _tokenizer96():
    from tokenizers import Tokenizer, models

    return Tokenizer(models.WordLevel({chr(65 + i): i for i in range(96)}, unk_token="A"))


def _lm(**kw):
    return lambda files, one_device: dt.models.LMEvalModel(_module(), **kw)


def _built(model_args):
    """lm-eval's constructor on the model ``distrain lm-eval`` built (handle 0)."""

    def call(files, one_device):
        from distrain._src.models import lm_eval as adapter

        adapter._BUILT[0] = one_device[0]
        try:
            return dt.models.LMEvalModel.create_from_arg_obj(model_args, {"batch_size": "8"})
        finally:
            adapter._BUILT.pop(0)

    return call


def _request(kind, *args):
    def call(files, one_device):
        return getattr(one_device[0], kind)([Instance(kind, {}, args, 0)])

    return call


def _checkpoint(case, params, tmp_path):
    """``from_checkpoint`` on a missing directory, an empty one, a checkpoint without
    parameters, and the parameters of another model."""
    (tmp_path / "run.yaml").write_text(_RUN)
    ckpt = tmp_path / "ckpt"
    if case == "empty":
        ckpt.mkdir()
    elif case in ("no params", "other model"):
        other = nnx.to_pure_dict(nnx.state(_module(vocab_size=256)))
        state = {"weights": np.zeros(3)} if case == "no params" else {
            "params": jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), other)}  # fmt: skip
        with dt.checkpoint.CheckpointManager(ckpt, async_save=False) as manager:
            manager.save(1, state)
    return dt.models.LMEvalModel.from_checkpoint(str(tmp_path / "run.yaml"), str(ckpt))


@pytest.mark.parametrize(
    "call, match",
    [
        (_lm(tokenizer="bytes"), "A byte tokenizer is for a vocabulary of 256; the model has 96"),
        (_lm(), r"comes without a tokenizer: pass tokenizer="),
        (_lm(tokenizer=object()), "tokenizer must be 'bytes' or a tokenizers.Tokenizer"),
        (_lm(tokenizer=_tokenizer96()), "needs the end-of-text token id.*pass eot_token="),
        (_lm(tokenizer=_tokenizer96(), eot_token=96), "eot_token=96 is outside the model's vo"),
        (_lm(tokenizer=_tokenizer96(), eot_token=1, batch_size=0), "batch_size must be an int"),
        (lambda f, o: dt.models.LMEvalModel("gpt2"), "must be a dt.models.Pretrained or a dt"),
        (lambda f, o: dt.models.LMEvalModel(nnx.eval_shape(lambda: nnx.Linear(2, 2,
         rngs=nnx.Rngs(0)))), "a config with seq_len or max_position_embeddings"),  # fmt: skip
        (lambda f, o: dt.models.LMEvalModel(_module(n_layers=2, pipeline_microbatches=2)),
         "stacks them for dt.nn.pipeline"),  # fmt: skip
        (_request("loglikelihood", "a", "b" * 17), "continuation of 17 tokens is longer than"),
        (_request("generate_until", "a", {"max_gen_toks": 16}), "max_gen_toks=16 leaves no ro"),
        (_request("generate_until", "a", {"num_beams": 2}), r"kwargs \['num_beams'\]; it re"),
        (lambda f, o: dt.models.LMEvalModel.create_from_arg_obj({"model": "x"}),
         r"needs model_args pretrained=HF_DIR, or config=FILE and checkpoint=DIR"),
        (_built({"built": 0, "max_length": 8}), r"--model_args \['max_length'\] would be ign"),
        (lambda f, o: o[0].evaluate(["no_such_task"], task_manager=TaskManager(
         include_defaults=False)), "'no_such_task' is not a registered task"),  # lm-eval's
        (lambda f, o: dt.models.LMEvalCallback("lm", ["t"]), "must be a dt.models.LMEvalModel"),
        (lambda f, o: dt.models.LMEvalCallback(o[0], ["t"], every=0), "every must be an int"),
    ],
)  # fmt: skip
def test_wrong_input_is_one_line_naming_it(call, match, files, one_device):
    with pytest.raises((ValueError, TypeError, KeyError)) as e:
        call(files, one_device)
    assert len(str(e.value).splitlines()) == 1 and re.search(match, str(e.value))


@pytest.mark.parametrize(
    "case, match",
    [
        ("missing", "is not a directory"),
        ("empty", "holds no checkpoint"),
        ("no params", "has no 'params'"),
        ("other model", r"are not those of model.fn 'distrain.models:transformer'"),
    ],
)
def test_a_checkpoint_that_is_not_the_runs_model_is_refused(case, match, files, tmp_path):
    with pytest.raises((FileNotFoundError, ValueError), match=match):
        _checkpoint(case, files[3], tmp_path)


@pytest.mark.parametrize(
    "args, match",
    [
        (["--tasks", "t"], "needs a model: --pretrained HF_DIR, or --config FILE with --chec"),
        (["--pretrained", "P", "--config", "C", "--tasks", "t"], "not both"),
        (["--config", "C", "--tasks", "t"], "--config C needs --checkpoint DIR"),
        (["--pretrained", "P", "--model", "hf", "--tasks", "t"], "sets lm-eval's --model"),
        (["--pretrained", "P", "--devices-per-replica", "fsdp"], "takes AXIS=N pairs"),
    ],
)
def test_distrain_lm_eval_refuses_in_one_line(args, match, files, capsys):
    from distrain.cli import main

    assert main(["lm-eval", *[files[0] if a == "P" else a for a in args]]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("distrain lm-eval: error:") and len(err.splitlines()) == 1, err
    assert match in err, err
