"""The Python in docs/getting_started.md and docs/train_step.md runs as written.

Each document's ```python blocks are executed in order in one namespace, on the 8
virtual CPU devices of the test set-up (so replicas really split the batches).
"""

import pathlib
import re

import pytest

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"


def python_blocks(name: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (DOCS / name).read_text(), re.S)


def run_blocks(name: str) -> dict:
    namespace: dict = {"__name__": f"docs_{name}"}
    for i, code in enumerate(python_blocks(name)):
        exec(compile(code, f"{DOCS / name} (python block {i + 1})", "exec"), namespace)
    return namespace


def test_getting_started_python_runs(devices, capsys):
    ns = run_blocks("getting_started.md")
    assert ns["strategy"].num_replicas_in_sync == 8
    assert ns["history"].history["val_accuracy"][-1] > 0.9
    assert "accuracy" in capsys.readouterr().out


def test_train_step_doc_runs(devices, capsys):
    ns = run_blocks("train_step.md")
    assert ns["history"].history["max_logit"]
    assert int(ns["gan_state"]["gen"].step) == 10
    out = capsys.readouterr().out
    assert "must return a tuple (new_state, metrics)" in out
    assert ns["probs"].shape == (359, 10)


@pytest.mark.parametrize(
    "name", ["custom_training_loops.md", "migrating_from_tf.md", "strategies.md", "scaling.md"]
)
def test_other_docs_python_runs(name, devices):
    run_blocks(name)
