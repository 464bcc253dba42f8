"""examples/rl_lm: GRPO on a small LM, on 8 replicas; its learning signal and exact resume.

One toy run (``train.TOY``: seconds) is shared by the tests. Sampling the same
completions on 1 and 8 replicas from one key is ``dt.models.generate``'s property
(``tests/test_models_generate.py``); here the step's own rollout is checked against a
one-device rollout of the whole batch.
"""

import os
import pathlib
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # examples/ is not a package

import distrain as dt  # noqa: E402
from examples.rl_lm import main as rl_main  # noqa: E402
from examples.rl_lm import task, train  # noqa: E402
from tests.processes import xla_flags  # noqa: E402

CFG = train.TOY


def test_reward_gives_partial_credit_and_nothing_for_a_wrong_length():
    target = np.array([task.encode("cba..."), task.encode("dcba..")])
    length = np.array([3, 4])
    completions = [
        (["cba...", "dcba.."], [4, 5], [1.0, 1.0]),  # right
        (["cab...", "dcab.."], [4, 5], [1 / 3, 0.5]),  # partial credit
        (["cb....", "dcbaa."], [3, 6], [0.0, 0.0]),  # stops early / late
    ]
    for texts, lengths, expected in completions:
        got = task.reward(
            np.array([task.encode(t) for t in texts]), np.array(lengths), target, length
        )
        np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-6)


def test_cli_rejects_a_group_of_one(tmp_path):
    with pytest.raises(ValueError, match=r"group_size must be >= 2 .*; received 1"):
        rl_main.main(["--devices", "8", "--workdir", str(tmp_path), "--toy", "--group-size", "1"])


def test_cli_rejects_prompts_that_do_not_split_over_replicas(tmp_path):
    with pytest.raises(ValueError, match=r"prompts_per_step \(12\) must be divisible .* \(8\)"):
        rl_main.main(["--devices", "8", "--workdir", str(tmp_path), "--toy",
                      "--prompts-per-step", "12"])  # fmt: skip


@pytest.fixture(scope="module")
def toy(devices, tmp_path_factory):
    """The toy run, uninterrupted, on 8 replicas: pretraining then 4 GRPO steps."""
    return train.train(CFG, dt.MirroredStrategy(), str(tmp_path_factory.mktemp("toy")))


@pytest.mark.one_end("newest")  # the toy run compiles for a minute; see tests/conftest.py
def test_toy_run_trains_the_policy_only_on_8_replicas(toy):
    assert toy.replicas == 8 and toy.resumed_from is None
    assert [r["step"] for r in toy.history] == [1, 2, 3, 4]
    for row in toy.history:
        assert 0 <= row["reward"] <= 1 and 0 <= row["correct"] <= row["reward"]
        assert np.isfinite(row["loss"]) and row["kl"] >= 0
    assert 0 <= toy.accuracy_before <= 1 and 0 <= toy.accuracy_after <= 1
    state = toy.state
    assert int(state.step) == CFG.rl_steps * CFG.inner_updates
    # The reference is frozen: no optimizer state, and still the pretrained weights.
    opt_leaves = jax.tree.leaves(state.opt_state)
    policy_leaves = jax.tree.leaves(state.params["policy"])
    assert len(opt_leaves) == 2 * len(policy_leaves) + 1  # adam's mu, nu and count
    moved = [
        float(np.abs(np.asarray(a) - np.asarray(b)).max())
        for a, b in zip(policy_leaves, jax.tree.leaves(state.params["reference"]), strict=True)
    ]
    assert max(moved) > 0  # the policy left the reference
    assert jax.tree.leaves(state.params)[0].sharding.is_fully_replicated


@pytest.mark.one_end("newest")  # the toy run compiles for a minute; see tests/conftest.py
def test_a_grpo_step_samples_as_one_device_and_raises_the_reward_of_its_samples(toy):
    """One step from the pretrained policy: its 8 replicas sample what one device samples
    for the whole batch, and the updated policy puts more probability on the better
    completions: the mean reward of those completions, weighted by how much likelier the
    new policy makes each (self-normalised importance sampling), goes up. A flipped
    gradient sign lowers it; zero advantages leave it where it was."""
    strategy = dt.MirroredStrategy()
    split = task.make_split(CFG.seed)
    batch = {k: split.train[k][: CFG.prompts_per_step] for k in ("prompt", "length", "target")}
    graphdef, _ = train.init_params(CFG)
    policy = jax.device_get(toy.state.params["reference"])  # the pretrained model
    with strategy.scope():
        state0 = strategy.put_replicated(train.init_rl_state(CFG, policy))
        state1, metrics = strategy.run(
            train.make_step(graphdef, CFG), args=(state0, strategy.distribute_batch(batch))
        )
        reward_8 = float(strategy.reduce("sum", metrics["reward"], axis=None))

    key = jax.random.split(state0.rng)[0]  # the step's sampling key
    one = jax.jit(train.rollout, static_argnums=0)(CFG, policy, batch, key)
    assert float(np.asarray(one.reward).sum()) == pytest.approx(reward_8, rel=1e-6)
    logp = jax.jit(train.token_logprobs, static_argnums=0)

    def completion_logp(params):
        return np.asarray((logp(graphdef, params, one.seq) * one.mask).sum(1), np.float64)

    old = completion_logp(policy)
    new = completion_logp(jax.device_get(state1.params["policy"]))
    w = np.exp(new - old - (new - old).max())
    reward = np.asarray(one.reward, np.float64)
    before, after = reward.mean(), (w * reward).sum() / w.sum()
    assert after > before + 0.01, (before, after)  # measured: 0.066 -> 0.082


@pytest.mark.one_end("newest")  # a real process killed and restarted; see tests/conftest.py
def test_sigkill_mid_rl_then_resume_equals_the_uninterrupted_run(toy, tmp_path):
    workdir = tmp_path / "run"
    cmd = [sys.executable, "-m", "examples.rl_lm.main", "--toy", "--devices", "8",
           "--workdir", str(workdir)]  # fmt: skip
    env = {**os.environ, "XLA_FLAGS": xla_flags(8), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        for line in proc.stdout:
            if line.startswith("rl 3/"):  # step 2's checkpoint is written
                os.killpg(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=300) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    second = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "resumed from RL step 2" in second.stdout

    with dt.checkpoint.CheckpointManager(workdir) as mgr:
        resumed = mgr.restore(target=toy.state)
    assert resumed.step == CFG.rl_steps
    # Policy, reference, optimizer, rng and step, bit for bit; the data position and
    # every logged number (rewards, KL, held-out accuracy) too.
    got, want = jax.tree.leaves(resumed.state), jax.tree.leaves(toy.state)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert resumed.metadata["history"] == toy.history
    assert resumed.data_state["step"] == CFG.rl_steps
