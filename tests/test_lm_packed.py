"""Packed documents for the LM example: rows, masks, and an exact resume after SIGKILL.

tests/scripts/lm_packed_train.py trains the LM on packed, load-balanced rows with the
sequence split over a "context" axis of 4 (2 replicas); here it is killed for real after
a backup and restarted with the same command.
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import distrain as dt
from distrain.models import LMConfig, Transformer
from examples.lm import data as lm_data

SCRIPT = Path(__file__).parent / "scripts" / "lm_packed_train.py"
TIMEOUT = 180


def test_pack_documents_rows_segments_and_positions():
    docs = [b"abcdefghij", b"de", b"xyz"]
    rows = lm_data.pack_documents(docs, 4)
    assert {k: v.shape for k, v in rows.items()} == dict.fromkeys(
        ["inputs", "targets", "segment_ids", "positions"], (4, 4)
    )
    # full pieces of "abcdefghij" first, then the tails packed first-fit
    assert rows["inputs"][0].tobytes() == b"abcd" and rows["targets"][0].tobytes() == b"bcde"
    assert rows["inputs"][2].tobytes() == b"ijde" and rows["targets"][2].tobytes() == b"j\0e\0"
    np.testing.assert_array_equal(rows["segment_ids"][2], [1, 1, 2, 2])
    np.testing.assert_array_equal(rows["positions"][2], [0, 1, 0, 1])
    np.testing.assert_array_equal(rows["segment_ids"][3], [1, 1, 1, 0])  # "xyz" + padding
    # every input byte of every document is in exactly one row, with its target
    real = rows["segment_ids"] > 0
    assert real.sum() == sum(len(d) for d in docs)
    assert lm_data.real_text_fraction(rows) == pytest.approx(15 / 16)
    with pytest.raises(ValueError, match=r"seq_len must be a positive int; received seq_len=0"):
        lm_data.pack_documents(docs, 0)
    with pytest.raises(ValueError, match=r"needs at least one document. Received none"):
        lm_data.pack_documents([], 4)


def test_stdlib_rows_are_almost_all_text_and_load_balance_keeps_them():
    splits = lm_data.stdlib_packed_splits(64, heldout_fraction=0.3, max_documents=60)
    assert lm_data.real_text_fraction(splits["train"]) >= 0.97
    balanced = lm_data.stdlib_packed_splits(
        64, heldout_fraction=0.3, max_documents=60, load_balance=4
    )
    back = dt.nn.load_balance_inverse(balanced["train"], 4)
    jax.tree.map(np.testing.assert_array_equal, back, splits["train"])


def test_attention_never_crosses_a_document():
    """Changing one document of a packed row changes no other document's logits."""
    model = Transformer(LMConfig(seq_len=16, d_model=32, n_layers=2, n_heads=2), rngs=nnx.Rngs(0))
    rows = lm_data.pack_documents([b"first doc", b"second", b"x"], 16)
    seg, pos = jnp.asarray(rows["segment_ids"], jnp.int32), jnp.asarray(rows["positions"])
    tokens = jnp.asarray(rows["inputs"], jnp.int32)
    logits = model(tokens, seg, pos)
    changed = model(tokens.at[0, 0].set(90), seg, pos)  # a byte of the first document
    other = np.asarray(seg[0] != 1)
    np.testing.assert_array_equal(logits[0, other], changed[0, other])
    assert not np.array_equal(logits[0, ~other], changed[0, ~other])
    # the second document alone, at positions 0..5, gives the same logits as in the row
    start = int(np.argmax(rows["segment_ids"][0] == 2))
    alone = model(tokens[:, start : start + 6])
    np.testing.assert_allclose(logits[0, start : start + 6], alone[0], atol=1e-5)


def _run(ckpt: Path, out: Path, kill_at: str | None = None) -> tuple[int, list[str]]:
    cmd = [sys.executable, str(SCRIPT), "--dir", str(ckpt), "--out", str(out)]
    cmd += ["--step-sleep", "0.3"] if kill_at else []
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True
    )
    lines: list[str] = []
    try:
        for line in proc.stdout:
            lines.append(line.strip())
            if line.strip() == kill_at:
                os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait(timeout=TIMEOUT), lines
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


@pytest.mark.one_end("newest")  # a real process; see tests/conftest.py
def test_sigkill_and_resume_gives_the_same_batches_and_parameters(tmp_path):
    code, ref = _run(tmp_path / "ref", tmp_path / "ref.npz")
    assert code == 0 and ref[-1] == "DONE", ref
    steps = [x for x in ref if x.startswith("STEP")]
    assert len(steps) == 8
    kill_at = steps[4]  # "STEP 5 ...": the backup of step 4 is written
    code, first = _run(tmp_path / "ckpt", tmp_path / "run.npz", kill_at=kill_at)
    assert code == -signal.SIGKILL and "DONE" not in first
    code, second = _run(tmp_path / "ckpt", tmp_path / "run.npz")
    assert code == 0 and second[-1] == "DONE"
    resumed = [x for x in second if x.startswith("STEP")]
    assert 0 < len(resumed) < 8  # resumed from a backup, not from scratch
    assert resumed == steps[-len(resumed) :]  # the same batches (checksums) from there on
    with np.load(tmp_path / "ref.npz") as a, np.load(tmp_path / "run.npz") as b:
        assert a.files == b.files
        for k in a.files:
            assert a[k].tobytes() == b[k].tobytes(), f"parameter {k} differs"
