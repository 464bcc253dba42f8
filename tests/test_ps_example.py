"""Smoke test of examples/parameter_server: asynchronous SGD on the digits, few steps."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # examples/ is not a package

from examples.parameter_server import main as example_main  # noqa: E402
from examples.parameter_server.train import Config, train_and_evaluate  # noqa: E402


def test_example_trains_and_reports(tmp_path, devices):
    lines = []
    result = train_and_evaluate(
        Config(num_workers=2, steps=40, eval_every=20, checkpoint_dir=str(tmp_path / "ckpt")),
        log=lines.append,
    )
    assert [h["step"] for h in result["history"]] == [20, 40]
    assert result["history"][-1]["loss"] < 2.3  # below chance level: it learns
    assert result["test_accuracy"] > 0.3
    for server in result["servers"]:
        assert server["pushed"] == server["applied"] == 40 and server["duplicates"] == 0
    assert result["coordinator"]["completed"] == 40
    assert (tmp_path / "ckpt" / "40").is_dir() and "saved step 40" in lines[-1]


def test_example_command_line_maps_to_config():
    config = example_main.parse(
        ["--backend", "ray", "--num-workers", "3", "--max-staleness", "0", "--steps", "8"]
    )
    assert config == Config(backend="ray", num_workers=3, max_staleness=0, steps=8)
    assert example_main.parse([]) == Config()
