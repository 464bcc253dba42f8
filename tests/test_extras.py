"""The hardware extras (cuda12, cuda13, tpu) are jax's own, over the core jax range.

Resolving them needs the package index (the network): `.ci/check-extras` does that in
CI, one `pip install --dry-run` per extra. Here, offline: every hardware extra of
pyproject.toml names an extra that the installed jax publishes (its metadata's
Provides-Extra, and a Requires-Dist for it), with the same version range as the core
dependency, and the README says which one to pick.
"""

import importlib.metadata
import pathlib
import re
import tomllib

from packaging.requirements import Requirement

ROOT = pathlib.Path(__file__).resolve().parents[1]
HARDWARE = ("cuda12", "cuda13", "tpu")


def _project():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_hardware_extras_are_jax_extras_over_the_core_range():
    project = _project()
    core = next(Requirement(r) for r in project["dependencies"] if r.startswith("jax"))
    jax_meta = importlib.metadata.metadata("jax")
    provided = set(jax_meta.get_all("Provides-Extra") or [])
    requires = importlib.metadata.requires("jax") or []
    for extra in HARDWARE:
        (text,) = project["optional-dependencies"][extra]
        req = Requirement(text)
        assert req.name == "jax" and req.extras == {extra}, text
        assert req.specifier == core.specifier, (text, str(core.specifier))
        assert extra in provided, f"jax {jax_meta['Version']} has no extra {extra!r}"
        assert any(f'extra == "{extra}"' in r for r in requires), extra
    # The installed jax is inside the range the extras ask for.
    assert core.specifier.contains(jax_meta["Version"])


def test_ci_resolves_every_hardware_extra():
    script = (ROOT / ".ci" / "check-extras").read_text()
    assert re.search(r'HARDWARE = \("cuda12", "cuda13", "tpu"\)', script)
    assert "--dry-run" in script
    assert "make check-extras" in (ROOT / ".ci" / "run").read_text()
    assert "check-extras:" in (ROOT / "Makefile").read_text()


def test_readme_says_which_extra_to_pick():
    readme = (ROOT / "README.md").read_text()
    for extra in HARDWARE:
        assert f"distrain[{extra}]" in readme, extra
