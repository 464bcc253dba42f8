"""One public path per name: the public modules re-export, and users import only them.

Everything but the public modules lives under ``distrain._src``; every name in a public
module's ``__all__`` exists and is documented; the examples, the documentation and the
shipped configs import nothing else from distrain (what they show is what users write);
every class is abstract or final.
"""

import ast
import importlib
import inspect
import pathlib
import pkgutil
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PUBLIC = (
    "distrain",
    "distrain.callbacks",
    "distrain.checkpoint",
    "distrain.config",
    "distrain.data",
    "distrain.experimental",
    "distrain.experimental.coordinator",
    "distrain.experimental.partitioners",
    "distrain.metrics",
    "distrain.mixed_precision",
)


def test_every_module_outside_src_is_public():
    import distrain

    outside = {
        info.name
        for info in pkgutil.walk_packages(distrain.__path__, "distrain.")
        if not info.name.startswith("distrain._src")
    }
    # `distrain.cli` is the console script (`distrain train`, `distrain launch`).
    assert outside == set(PUBLIC) - {"distrain"} | {"distrain.cli"}


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_name_exists_and_is_documented(name):
    module = importlib.import_module(name)
    assert module.__doc__, f"{name} has no docstring"
    exported = module.__all__
    assert len(exported) == len(set(exported)), f"{name}.__all__ repeats a name"
    for attr in exported:
        value = getattr(module, attr)  # lazy names load here
        if inspect.isclass(value) or inspect.isfunction(value) or inspect.ismodule(value):
            assert inspect.getdoc(value), f"{name}.{attr} has no docstring"


def _imports(code: str) -> set[str]:
    names = set()
    try:
        tree = ast.parse(code)
    except SyntaxError:  # an illustrative block (a signature): read its import lines
        found = re.findall(r"^\s*(?:from|import)\s+(distrain[\w.]*)", code, re.M)
        return set(found)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {n for n in names if n == "distrain" or n.startswith("distrain.")}


def _sources():
    for path in sorted((ROOT / "examples").rglob("*.py")):
        yield path, path.read_text()
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for i, block in enumerate(re.findall(r"```python\n(.*?)```", path.read_text(), re.S)):
            yield f"{path} block {i + 1}", block
    for path in sorted((ROOT / "configs").glob("*.yaml")):  # `fn: package.module:function`
        paths = re.findall(r"^\s*\w+:\s*([\w.]+):\w+\s*(?:#.*)?$", path.read_text(), re.M)
        yield path, "".join(f"import {p}\n" for p in paths)


def test_examples_and_docs_import_only_public_modules():
    bad = []
    for where, code in _sources():
        for module in _imports(code) - set(PUBLIC):
            bad.append(f"{where}: {module}")
    assert not bad, "non-public imports:\n" + "\n".join(bad)


# Concrete bases that are meant to be extended, and why (equinox's rule otherwise: a
# base class is abstract, and a concrete class is not subclassed).
EXTENSION_POINTS = {
    "distrain._src.train.callbacks.base.Callback": "Keras' contract: hooks are optional no-ops",
    "distrain._src.train.callbacks.checkpointing._Saver": "private: the two checkpoint callbacks",
    "distrain._src.cross_device_ops._Psum": "private: two final spellings of one psum",
    "distrain._src.train.config._Section": "private: the pydantic settings every section shares",
}


def _distrain_classes():
    import distrain

    for info in pkgutil.walk_packages(distrain.__path__, "distrain."):
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if inspect.isclass(value) and value.__module__ == info.name:
                yield value


def test_classes_are_abstract_or_final():
    bad = []
    for cls in _distrain_classes():
        for base in cls.__bases__:
            name = f"{base.__module__}.{base.__qualname__}"
            if name.startswith("distrain.") and not inspect.isabstract(base):
                if name not in EXTENSION_POINTS:
                    bad.append(f"{cls.__module__}.{cls.__qualname__} subclasses concrete {name}")
    assert not bad, "\n".join(bad)
    import distrain as dt

    for final in (dt.metrics.Mean, dt.metrics.Accuracy, dt.metrics.Sum, dt.AllReduce):
        assert getattr(final, "__final__", False), final
    with pytest.raises(TypeError, match="abstract"):
        dt.metrics.WeightedMean(total=1.0, count=1.0)
