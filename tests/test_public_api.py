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
import shutil
import sys

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
    "distrain.experimental.islands",
    "distrain.experimental.partitioners",
    "distrain.goodput",
    "distrain.metrics",
    "distrain.mixed_precision",
    "distrain.models",
    "distrain.nn",
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


def test_no_name_is_public_in_two_modules():
    # One public path per name: the tf.distribute surface is on `dt`, the rest in its
    # submodule (dt.checkpoint.CheckpointManager, not also dt.CheckpointManager).
    homes: dict[int, list[str]] = {}
    for name in PUBLIC:
        module = importlib.import_module(name)
        for attr in module.__all__:
            value = getattr(module, attr)
            if not inspect.ismodule(value):  # a submodule is listed by its parent only
                homes.setdefault(id(value), []).append(f"{name}.{attr}")
    twice = [paths for paths in homes.values() if len(paths) > 1]
    assert not twice, f"public under two paths: {twice}"


def _type_checking_imports(module) -> dict[str, object]:
    """The names a module's ``if TYPE_CHECKING:`` block imports, resolved."""
    tree = ast.parse(inspect.getsource(module))
    blocks = [
        node
        for node in tree.body
        if isinstance(node, ast.If)
        and isinstance(node.test, ast.Name)
        and node.test.id == "TYPE_CHECKING"
    ]
    out = {}
    for block in blocks:
        for node in block.body:
            assert isinstance(node, ast.ImportFrom), ast.dump(node)
            for alias in node.names:
                assert alias.asname == alias.name, "re-export as `import x as x` (PEP 484)"
                parent = importlib.import_module(node.module)
                out[alias.name] = getattr(parent, alias.name, None) or importlib.import_module(
                    f"{node.module}.{alias.name}"
                )
    return out


def _lazy_table(module) -> dict[str, object]:
    out = {}
    for attr, target in module._LAZY.items():
        module_name, _, member = target.partition(":")
        loaded = importlib.import_module(module_name)
        out[attr] = getattr(loaded, member) if member else loaded
    return out


@pytest.mark.parametrize("name", PUBLIC)
def test_lazy_names_are_typed_for_type_checkers(name):
    # A name loaded by a module __getattr__ is invisible to mypy and pyright unless a
    # TYPE_CHECKING block imports it (jax/scipy/__init__.py's pattern); the __getattr__
    # itself sits in the `else:` branch, so a checker flags a misspelt `dt.name`.
    module = importlib.import_module(name)
    source = inspect.getsource(module)
    if "__getattr__" not in source:
        assert not hasattr(module, "_LAZY")
        return
    if not hasattr(module, "_LAZY"):  # deprecated names only (distrain/_src/deprecations.py)
        assert "__getattr__ = _deprecations.getattr_hook(__name__)" in source
        assert "if not TYPE_CHECKING:" in source
        return
    assert "else:\n    __getattr__, __dir__ = _lazy.exports(globals(), _LAZY)" in source
    assert _type_checking_imports(module) == _lazy_table(module)


@pytest.mark.one_end("newest")  # mypy runs in both ends' `make check`; tests/conftest.py
def test_mypy_sees_lazy_names_with_their_types(tmp_path):
    # Before the TYPE_CHECKING blocks mypy typed every lazy name as Any (the module
    # __getattr__'s return type), so these lines passed; now each one is an error.
    api = pytest.importorskip("mypy.api")
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import distrain as dt\n"
        "a: int = dt.checkpoint.CheckpointManager\n"
        "b: int = dt.InputOptions\n"
        "c: int = dt.experimental.ParameterServerStrategy\n"
        "d = dt.CheckpointManager\n"
    )
    # With the project's mypy settings, and a copy of the cache `make check`'s mypy left
    # in this environment (8 s instead of a minute of checking jax and distrain again).
    cache, made = tmp_path / "mypy_cache", pathlib.Path(sys.prefix) / ".mypy_cache"
    if made.is_dir():
        shutil.copytree(made, cache)
    out, _, status = api.run(
        [str(probe), f"--config-file={ROOT / 'pyproject.toml'}", f"--cache-dir={cache}"]
    )
    assert status == 1, out
    assert 'Incompatible types in assignment (expression has type "type[CheckpointManager]"' in out
    assert 'expression has type "type[InputOptions]"' in out
    assert 'expression has type "type[ParameterServerStrategy]"' in out
    assert 'Module has no attribute "CheckpointManager"' in out, out


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
    "distrain._src.train.config_section.ConfigSection": "the pydantic settings of every section",
    "distrain._src.models.llama._DecoderConfig": "private: the fields Llama and Mixtral share",
    "distrain._src.islands.island_coordinator.IslandCoordinator": (
        "private: the Ray actor adds the run directory's check to the plain-Python coordinator"
    ),
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


def test_parameter_server_modules_meet_through_contracts_not_private_attributes():
    # The coordinator once typed workers as Any and read the strategy's _backend,
    # _coordinator and _require_group; now the backends implement the ABCs of
    # ps/backend.py and the strategy offers what the coordinator needs.
    from distrain._src.ps.backend import ServerBackend, Worker
    from distrain._src.ps.inprocess import InProcessBackend
    from distrain._src.ps.ray_backend import RayBackend, RayWorker
    from distrain._src.ps.worker import WorkerCore

    assert inspect.isabstract(ServerBackend) and inspect.isabstract(Worker)
    assert issubclass(InProcessBackend, ServerBackend) and issubclass(RayBackend, ServerBackend)
    assert issubclass(WorkerCore, Worker) and issubclass(RayWorker, Worker)
    allowed = {
        "os._exit",  # a Ray worker's injected crash
        "context._enter_scope",  # the scope stack's entry, shared by every strategy
        "value._set",  # RemoteValue, defined in scheduled_functions.py
        "value._fail",
    }
    reads = []
    for path in sorted((ROOT / "distrain" / "_src" / "ps").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            ):
                tail = ast.unparse(node).split(".")[-2:]
                if ".".join(tail) not in allowed:
                    reads.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not reads, "private attributes read across objects:\n" + "\n".join(reads)
