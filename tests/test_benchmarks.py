"""The benchmark runner works end to end with a couple of steps (not a timed test)."""

import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import report
from benchmarks.loops import make_bench
from benchmarks.run import parse_args
from benchmarks.workloads import WORKLOADS
from tests.processes import xla_flags

pytestmark = pytest.mark.one_end("lowest")  # see tests/conftest.py

ROOT = Path(__file__).resolve().parent.parent


def test_runner_smoke_writes_json_table_and_plot(tmp_path):
    out, png = tmp_path / "results.json", tmp_path / "plot.png"
    configs = (
        "jax_shard_map,distrain_run,distrain_run_pipeline,distrain_fit,"
        "distrain_fit_pipeline_host,distrain_fit_auto"
    )
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.run",
        "--steps",
        "2",
        "--repeats",
        "1",
        "--workloads",
        "mlp",
        "--devices",
        "2",
        "--configs",
        configs,
        "--no-peers",
        "--no-extras",
        "--out",
        str(out),
        "--plot",
        str(png),
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        text, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, text[-3000:]
    results = json.loads(out.read_text())
    (group,) = results["groups"]
    assert (group["workload"], group["devices"], group["global_batch_size"]) == ("mlp", 2, 512)
    assert list(group["configs"]) == configs.split(",")
    for name, entry in group["configs"].items():
        assert "skipped" not in entry, (name, entry)
        (sample,) = entry["samples"]
        assert sample["steps_per_sec"] > 0 and sample["host_us_per_step"] > 0
    ratios = {r["name"]: r for r in group["ratios"]}
    run_ratio = ratios["strategy.run / hand-written"]
    assert run_ratio["value"] == pytest.approx(
        group["configs"]["distrain_run"]["median_steps_per_sec"]
        / group["configs"]["jax_shard_map"]["median_steps_per_sec"]
    )
    assert ratios["fit pipeline / Keras 3 JAX fit"]["value"] is None  # not run
    assert "(b) distrain strategy.run" in text and "wrote" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _group(medians):
    configs = {
        n: {"samples": [{"steps_per_sec": v, "host_us_per_step": 1.0}]} for n, v in medians.items()
    }
    return {
        "workload": "mlp",
        "devices": 8,
        "global_batch_size": 512,
        "steps_per_repeat": 2,
        "repeats": 1,
        "configs": configs,
    }


def test_ratios_against_targets_and_markdown():
    group = report.summarize_group(
        _group(
            {
                "jax_shard_map": 100.0,
                "distrain_run": 98.0,
                "distrain_run_pipeline": 80.0,
                "keras_jax_fit": 50.0,
            }
        )
    )
    ratios = {r["name"]: r for r in group["ratios"]}
    assert ratios["strategy.run / hand-written"]["value"] == pytest.approx(0.98)
    assert ratios["strategy.run / hand-written"]["met"] is True
    assert ratios["pipeline / pre-staged (run)"]["met"] is False  # 0.816 < 0.9
    assert ratios["Trainer.fit / hand-written"]["value"] is None  # fit not measured
    md = report.markdown_tables({"groups": [group]})
    row = "| pipeline / pre-staged (run) | 0.816 | 0.816 | >= 0.90 (issue 2) | **not met** |"
    assert f"| mlp | 8 {row}" in md


def test_paired_ratio_compares_samples_of_the_same_round():
    # Round 1 ran in a busy spell for both: per-round ratios stay 0.9; medians would not.
    num = {
        "samples": [
            {"round": 0, "steps_per_sec": 90.0},
            {"round": 1, "steps_per_sec": 9.0},
            {"round": 2, "steps_per_sec": 45.0},
        ]
    }
    den = {
        "samples": [
            {"round": 0, "steps_per_sec": 100.0},
            {"round": 1, "steps_per_sec": 10.0},
            {"round": 2, "steps_per_sec": 50.0},
            {"round": 3, "steps_per_sec": 1.0},
        ]
    }
    assert report.paired_ratio(num, den) == pytest.approx(0.9)
    assert report.paired_ratio({"samples": []}, den) is None


def test_bad_arguments_are_rejected(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--workloads", "resnet"])
    assert "unknown ['resnet']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--steps", "1"])
    assert "--steps must be >= 2" in capsys.readouterr().err


def test_unknown_config_names_the_valid_ones():
    with pytest.raises(ValueError, match="Unknown JAX config 'nope'. Expected one of"):
        make_bench("nope", WORKLOADS["mlp"])


def test_cnn_pool_forms_train_the_same_maths():
    # benchmarks/xla_cpu.py times both forms; the suite's CNN uses the strided-slice one.
    import dataclasses
    import functools

    import jax
    import numpy as np

    from benchmarks.workloads import cnn_apply, synthetic_data
    from benchmarks.xla_cpu import reduce_window_pool

    ours = WORKLOADS["cnn"]
    reference = dataclasses.replace(
        ours, apply=functools.partial(cnn_apply, pool=reduce_window_pool)
    )
    params = ours.init(jax.random.key(0))
    data = synthetic_data(16)
    y = data["y"]
    for x in (data["x"], np.zeros_like(data["x"])):  # all-zero input: every window ties
        a, b = (
            jax.value_and_grad(lambda p, w=w, x=x: w.per_example_loss(p, x, y).mean())(params)
            for w in (ours, reference)
        )
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-7)


def _run_script(
    module: str, args: list[str], out: Path, env: dict | None = None, timeout: float = 240
):
    """Runs ``python -m module *args --json out`` from the repository root (``timeout``
    seconds at most); returns its JSON and what it printed."""
    proc = subprocess.run(
        [sys.executable, "-m", module, *args, "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.parametrize(
    "module, args, expect",
    [
        ("benchmarks.host_overhead", ["--devices", "2", "--quick"], "strategy.run"),
        ("benchmarks.scaling", ["--devices", "2", "--quick", "--workloads", "mlp"], "sharded_bf16"),
        ("benchmarks.input_thread", ["--devices", "2", "--quick"], "prefetch thread"),
        ("benchmarks.fit_vs_run", ["--devices", "2", "--steps", "8", "--rounds", "1"], "fit/run"),
        (
            "benchmarks.replica_spans",
            ["--devices", "2", "--rounds", "1", "--steps", "2", "--workloads", "mlp"],
            "x floor",
        ),
    ],
)
def test_scripts_run_and_write_json(tmp_path, module, args, expect):
    env = {**os.environ, "XLA_FLAGS": ""}
    result, printed = _run_script(module, args, tmp_path / "out.json", env)
    assert expect in printed
    assert result["devices"] == 2


def test_long_context_script_runs(tmp_path):
    """benchmarks/long_context.py at a small length: the ring equals jax's attention."""
    args = ["--only", "equality", "--equality-seq", "256"]
    env = {**os.environ, "XLA_FLAGS": ""}
    result, _ = _run_script("benchmarks.long_context", args, tmp_path / "out.json", env)
    errors = result["equality"]
    assert set(errors) == {"forward", "grad_q", "grad_k", "grad_v"}
    assert max(errors.values()) < 1e-5


# A tiny model of nanoGPT's recipe: the smoke run compiles in seconds.
NANOGPT_TINY = [
    "model.kwargs.n_layers=1",
    "model.kwargs.d_model=32",
    "model.kwargs.n_heads=2",
    "model.kwargs.seq_len=16",
    "data.kwargs.seq_len=16",
    "data.global_batch_size=4",
]


def test_nanogpt_cpu_toy_runs_without_torch(tmp_path, monkeypatch):
    """benchmarks/nanogpt_cpu.py --toy: Trainer.fit, the jax.jit floor, the breakdown and
    the JSON, with the PyTorch arm skipped as where torch (a benchmark-only extra) is
    absent."""
    from benchmarks import nanogpt_cpu

    monkeypatch.setattr(nanogpt_cpu, "_torch", lambda: None)
    out = tmp_path / "nanogpt_cpu.json"
    nanogpt_cpu.main(["--toy", "--out", str(out), *NANOGPT_TINY])
    result = json.loads(out.read_text())
    assert set(result["timing"]["ms_per_step"]) == {"trainer_fit", "jax_jit"}
    assert all(v > 0 for v in result["timing"]["ms_per_step"].values())
    assert list(result["timing"]["ratios"]) == ["trainer_fit / jax_jit"]
    assert result["shapes"]["d_model"] == 32 and result["machine"]["cores"] >= 1
    assert result["command"].startswith("python -m benchmarks.nanogpt_cpu --toy")
    assert {row["part"] for row in result["components"]} >= {"layer norm", "embedding gather"}
    assert "torch_fwd_ms" not in result["components"][0]
    assert result["profile"]["ops_ms_per_step"] > 0


def test_nanogpt_cpu_torch_model_matches_distrain_model():
    """The PyTorch GPT of the benchmark has the LM example's parameters, shape by shape
    (the tied head counted once), and trains: two steps lower the loss on one batch."""
    torch = pytest.importorskip("torch")
    import jax
    import numpy as np

    from benchmarks import nanogpt_cpu

    r = nanogpt_cpu.Recipe(nanogpt_cpu.CONFIG, NANOGPT_TINY)
    _, params, _ = r.init()
    jax_shapes = sorted(tuple(np.shape(x)) for x in jax.tree.leaves(params))
    model = nanogpt_cpu.torch_gpt(r, torch)
    torch_shapes = sorted(tuple(p.shape) for p in model.parameters())
    # nnx.Linear keeps [in, out]; torch [out, in]: compare as sorted dimension sets.
    assert sorted(tuple(sorted(s)) for s in jax_shapes) == sorted(
        tuple(sorted(s)) for s in torch_shapes
    )
    loop = nanogpt_cpu.TorchEager(r, torch)
    batch = loop.batches[0]
    first = loop.train_step(batch).item()
    for _ in range(3):
        last = loop.train_step(batch).item()
    assert last < first


def _some_text(tmp_path: Path) -> Path:
    """A text file for the islands' scripts: any text will do (the shared TinyShakespeare
    may not be beside the checkout), so the docs, concatenated."""
    text = tmp_path / "text.txt"
    text.write_bytes(b"".join(p.read_bytes() for p in sorted((ROOT / "docs").glob("*.md"))))
    return text


def test_islands_toy_runs(tmp_path):
    """benchmarks/islands.py --toy: the compiled programs' collectives (none across
    islands in the inner step; the outer step's bytes per codec) and a short run of
    data parallelism and DiLoCo with the held-out loss."""
    env = {**os.environ, "XLA_FLAGS": xla_flags(8)}
    args = ["--toy", "--data", str(_some_text(tmp_path))]
    result, _ = _run_script("benchmarks.islands", args, tmp_path / "islands.json", env)
    assert result["inner_cross_island_collectives"] == {"float32": 0, "bfloat16": 0, "int4": 0}
    sync = result["bytes_per_sync"]
    assert sync["int4"] < sync["bfloat16"] <= sync["float32"]
    assert result["dp_bytes_per_step"] > 0
    assert set(result["runs"]) == {"data_parallel", "diloco_h5"}
    assert all(math.isfinite(r["final"]) for runs in result["runs"].values() for r in runs)


def test_islands_faults_toy_runs(tmp_path):
    """benchmarks/islands_faults.py --toy: 2 fault-isolated islands under `distrain launch
    --islands`, island 1 SIGKILLed twice mid-round: every row committed once, both kills
    rejoined, and the held-out losses of the arms."""
    # One unkilled seed (the toy's default is two), 1,024 rows (8 rounds an epoch; the
    # docs' text holds 13k), and island 0 waits for each rejoin (--min-islands 2: with so
    # few rounds it could otherwise finish alone while island 1 restarts). Three arms, each
    # a Ray head and its islands; with all the docs' rows this took 256 s beside the rest
    # of the suite. The bound is for a hang, not for speed.
    args = ["--toy", "--seeds", "0", "--rows", "1024", "--min-islands", "2"]
    args += ["--data", str(_some_text(tmp_path))]
    out = tmp_path / "faults.json"
    result, _ = _run_script("benchmarks.islands_faults", args, out, timeout=540)
    killed = next(a for a in result["arms"] if a["killed"])
    assert killed["exit"] == 0 and killed["rows_committed"] == killed["rows_total"] > 0
    assert (killed["rows_lost"], killed["rows_duplicated"]) == (0, 0)
    assert (result["rows_lost"], result["rows_duplicated"]) == (0, 0)
    assert len(result["kills"]) == 2 and len({k["pid"] for k in result["kills"]}) == 2
    assert len(result["rejoin_s"]) == 2 and all(math.isfinite(r) for r in result["rejoin_s"])
    assert all(r["spawn_s"] >= 0 and r["joined_to_first_step_s"] >= 0 for r in result["rejoins"])
    assert math.isfinite(result["cold_start_s"]) and math.isfinite(result["max_stall_s"])
    assert all(math.isfinite(v) for v in result["final_losses"].values())
    assert math.isfinite(result["killed_vs_unkilled_loss_gap"])
    assert math.isfinite(result["seed_spread"])
    assert result["targets"]["rows"]["met"]
    # Issue 50: a rejoined island's optimizer counts go on at round x H (0 before the
    # fix), and the cold start of one island alone.
    counts, expected = result["schedule_count_after_rejoin"], result["schedule_count_expected"]
    assert len(counts) == 2 and all(e > 0 for e in expected)
    assert all(c and set(c) == {e} for c, e in zip(counts, expected, strict=True))
    assert result["targets"]["schedule"]["met"]
    assert result["solo_arm"]["exit"] == 0 and math.isfinite(result["cold_start_solo_s"])


def test_experts_toy_runs(tmp_path):
    """benchmarks/experts.py --toy: expert bytes per device at 1/X of one device, the MoE
    and dense LMs' tokens/s, and the expert load's variation by window with and without
    the load-balancing loss."""
    env = {**os.environ, "XLA_FLAGS": xla_flags(8)}
    result, printed = _run_script("benchmarks.experts", ["--toy"], tmp_path / "e.json", env)
    assert [r["expert_axis"] for r in result["memory"]] == [2, 4, 8]
    assert all(r["fraction"] == pytest.approx(r["target"], rel=0.05) for r in result["memory"])
    speed = result["speed"]
    active = speed["active_matmul_params"]  # equal but for the router and the biases
    assert active["moe"] == pytest.approx(active["dense"], rel=0.02)
    assert all(v > 0 for v in speed["tokens_per_sec"].values())
    runs = result["balance"]["runs"]
    assert set(runs) == {"balance_loss_0.01", "balance_loss_0", "bias"}
    assert all(math.isfinite(r["heldout_loss"]) for r in runs.values())
    assert all(len(r["moe_load_cv_by_window"]) == 2 for r in runs.values())
    assert "expert load CV" in printed


def test_pipeline_script_reports_no_pipeline_all_reduce(tmp_path):
    """benchmarks/pipeline.py at a small width: the pipelined steps all-reduce only the
    gradients (a quarter of mirrored's: the stacked parameters are split over 4 stages)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # its 8 devices
    args = ["--rounds", "1", "--steps", "1", "--width", "64"]
    r, _ = _run_script("benchmarks.pipeline", args, tmp_path / "pipeline.json", env)
    assert r["stage4_M8"]["all_reduce_bytes"] < r["mirrored"]["all_reduce_bytes"] / 3
    assert r["stage4_M4"]["argument_bytes"] < r["mirrored"]["argument_bytes"]


def test_goodput_toy_resumes_from_the_local_tier(tmp_path):
    """benchmarks/goodput.py --toy --arms local: a real 2-process job, one SIGKILL, the
    restart resumes from the local tier and the ledger accounts for the wall time. The
    tier's restore is "peer" when the kill landed after the killed process sent its
    shards to its peer but before its own copy was complete (both are the local tier)."""
    out = tmp_path / "goodput.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.goodput", "--toy", "--arms", "local",
         "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    r = json.loads(out.read_text())
    assert r["failures"] == 1 and len(r["restore_s_by_tier"]) == 1
    assert r["restore_s_by_tier"].keys() <= {"local", "peer"}
    assert 0 <= r["lost_steps_per_failure"][0] <= r["local_freq"]
    assert abs(r["buckets_sum_vs_measured"] - 1) < 0.15  # the launcher's own start and exit
    assert 0 < r["step_fraction_while_killing"] < 1
    assert (tmp_path / "goodput.png").exists()


def test_checkpoint_overhead_toy_runs(tmp_path):
    """benchmarks/checkpoint_overhead.py, a few steps on 2 devices: both loops, one save
    and one restore timed, and the JSON written where --json says (not results/)."""
    env = {**os.environ, "XLA_FLAGS": xla_flags(2)}
    args = ["--devices", "2", "--steps", "4", "--every", "2", "--repeats", "1", "--batch", "16"]
    r, _ = _run_script("benchmarks.checkpoint_overhead", args, tmp_path / "ckpt.json", env)
    assert r["setting"] == "dt.MirroredStrategy, 2 virtual CPU devices"
    assert r["steps_per_s_no_ckpt"] > 0 and r["steps_per_s_async_ckpt"] > 0
    assert r["save_until_committed_ms"] >= r["save_blocking_ms"] > 0 and r["restore_ms"] > 0
    assert r["state_mb"] == pytest.approx(3 * 269322 * 4 / 2**20, abs=0.01)  # params, mu, nu


def test_multi_process_toy_runs(tmp_path):
    """benchmarks/multi_process.py, two steps: one process of 2 devices against two
    processes of one under `distrain launch`, both with 2 replicas."""
    env = {**os.environ, "XLA_FLAGS": os.environ["DISTRAIN_TEST_XLA_COMPILE_FLAGS"]}
    args = ["--steps", "2", "--warmup", "1", "--repeats", "1", "--timeout", "120"]
    r, _ = _run_script("benchmarks.multi_process", args, tmp_path / "mp.json", env)
    one, two = r["results"]["1 process x 2 devices"], r["results"]["2 processes x 1 device"]
    assert (one["processes"], one["replicas"], two["processes"], two["replicas"]) == (1, 2, 2, 2)
    assert r["ratio_two_process_over_one_process"] > 0


def test_parameter_server_toy_runs(tmp_path):
    """benchmarks/parameter_server.py, a few steps on 2 devices: the callback round trips
    and the five configurations' throughput."""
    env = {**os.environ, "XLA_FLAGS": os.environ["DISTRAIN_TEST_XLA_COMPILE_FLAGS"]}
    args = ["--devices", "2", "--steps", "4", "--repeats", "1", "--batch", "8"]
    r, _ = _run_script("benchmarks.parameter_server", args, tmp_path / "ps.json", env)
    assert r["setting"].startswith("2 virtual CPU devices")
    assert set(r["throughput"]) == {
        "mirrored", "ps_async", "ps_sync", "ps_one_worker", "jit_one_device"
    }  # fmt: skip
    assert all(row["examples_per_s"] > 0 for row in r["throughput"].values())
    cb = r["callback"]
    assert cb["plain_jit_us"] > 0 and cb["one_callback_us"] > 0 and cb["params_mb"] == 1.03


def test_lm_benchmark_toy_runs(tmp_path):
    """benchmarks/lm.py with a one-layer model, in this process (8 devices): the three
    loops run and are timed, and the jax.jit floor is its own 1.0x."""
    from benchmarks import lm

    tiny = ["model.kwargs.n_layers=1", "model.kwargs.d_model=32", "model.kwargs.n_heads=2"]
    tiny += ["model.kwargs.seq_len=16", "data.kwargs.seq_len=16", "data.global_batch_size=8"]
    out = tmp_path / "lm.json"
    r = lm.main([*tiny, "--steps", "4", "--repeats", "1", "--json", str(out)])
    assert json.loads(out.read_text())["results"].keys() == set(lm.CONFIGS)
    assert r["devices"] == 8 and r["results"]["jax_jit"]["vs_jax_jit"] == 1.0
    assert all(row["tokens_per_sec"] > 0 for row in r["results"].values())
    assert all(row["mfu"] is None for row in r["results"].values())  # no peak on CPU


def test_xla_cpu_script_runs(tmp_path):
    """benchmarks/xla_cpu.py, one timing each: both XLA settings, every model."""
    r, _ = _run_script("benchmarks.xla_cpu", ["--repeats", "1"], tmp_path / "xla_cpu.json")
    assert set(r["results"]) == {"stock XLA", "YNN fusions off"}
    assert all(set(s["ms"]) == {"mlp", "cnn", "cnn_reduce_window"} for s in r["results"].values())
    assert all(ms > 0 for s in r["results"].values() for ms in s["ms"].values())


def test_every_result_file_the_docs_cite_is_committed():
    """A figure in the docs names its result file; that file is in the repository (not
    ignored, so a fresh clone has it), and every committed result is cited somewhere."""
    texts = {p: p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]}
    cited = {
        name
        for text in texts.values()
        for name in re.findall(r"benchmarks/results/([\w.-]+\.(?:json|png))", text)
    }
    cited.discard("latest.json")  # what `make bench` writes, by design not committed
    tracked = subprocess.run(
        ["git", "ls-files", "benchmarks/results"], cwd=ROOT, capture_output=True, text=True
    ).stdout.split()
    committed = {Path(p).name for p in tracked} - {".gitkeep"}
    assert cited <= committed, f"cited but not committed: {sorted(cited - committed)}"
    everything = "\n".join(texts.values())
    uncited = sorted(name for name in committed if name not in everything)
    assert not uncited, f"committed but cited by no doc: {uncited}"


def test_hf_import_toy_runs(tmp_path):
    """benchmarks/hf_import.py on a tiny Llama checkpoint: both rows (1 process, and 2
    processes over gloo each holding half), with the memory figures they report."""
    args = ["--layers", "1", "--hidden", "256", "--vocab", "1024"]
    r, _ = _run_script("benchmarks.hf_import", args, tmp_path / "hf.json")
    one, two = r["rows"]
    assert (one["processes"], two["processes"]) == (1, 2)
    assert one["device_bytes"] == r["checkpoint_bytes"]  # one process holds it all
    assert one["device_bytes"] / 2 <= two["device_bytes"] < 0.6 * one["device_bytes"]  # ~half
    assert all(x["peak_rss_bytes"] > x["baseline_rss_bytes"] > 0 for x in (one, two))


def test_sidecar_toy_runs(tmp_path):
    """benchmarks/sidecar.py at toy size: validation inside fit is charged to the
    trainer's evaluation bucket; with the sidecar the trainer's bucket is empty and every
    checkpoint has its lag."""
    args = ["--steps", "20", "--every", "10", "--eval-rows", "512", "--hidden", "32"]
    r, _ = _run_script("benchmarks.sidecar", args, tmp_path / "s.json")
    in_fit, side = r["rows"]
    assert in_fit["arm"] == "in_fit" and in_fit["trainer_evaluation_s"] > 0
    assert side["arm"] == "sidecar" and side["trainer_evaluation_s"] == 0
    assert side["evaluations"] == 2 and all(lag >= 0 for lag in side["lag_s"])


def test_generate_toy_runs(tmp_path):
    """benchmarks/generate.py --toy in this process: every arm timed (transformers' where
    PyTorch is installed), and the recompute arm's tokens are the KV cache's."""
    from benchmarks import generate

    out = tmp_path / "generate.json"
    r = generate.main(["--toy", "--json", str(out)])
    assert json.loads(out.read_text()) == r
    arms = [(row["arm"], row["batch"]) for row in r["rows"]]
    assert arms[:3] == [("kv_cache", 1), ("kv_cache", 4), ("recompute", 1)]
    assert all(row["tokens_per_s"] > 0 for row in r["rows"])
    assert r["recompute_equals_kv_cache"] is True
    if r["greedy_equals_transformers"] is not None:  # PyTorch is installed
        assert arms[3:] == [("transformers_cpu", 1), ("transformers_cpu", 4)]
        assert r["greedy_equals_transformers"] is True
