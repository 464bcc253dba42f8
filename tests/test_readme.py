"""The README's twenty-line example runs as written."""

import pathlib
import re

import numpy as np

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_trains(devices, capsys):
    code = re.search(r"## Twenty lines\n\n```python\n(.*?)```", README.read_text(), re.S).group(1)
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)
    assert namespace["strategy"].num_replicas_in_sync == 8
    loss = float(namespace["strategy"].reduce("sum", namespace["loss"]))
    assert np.isfinite(loss) and loss < 1.0  # from ln(10) = 2.3 at the start
    assert "loss" in capsys.readouterr().out
