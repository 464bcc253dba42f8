"""Moved public names keep working for a release: each warns once per access with its
new path, and is the same object (distrain/_src/deprecations.py)."""

import importlib
import re
import warnings
from pathlib import Path

import pytest

import distrain as dt
from distrain._src import deprecations

ENTRIES = [(module, name) for module, names in deprecations.TABLE.items() for name in names]
CHANGELOG = Path(__file__).parents[1] / "CHANGELOG.md"


@pytest.mark.parametrize("module, name", ENTRIES, ids=[f"{m}.{n}" for m, n in ENTRIES])
def test_old_names_warn_with_the_new_path_and_are_the_same_object(module, name):
    mod = importlib.import_module(module)
    new_path = deprecations.TABLE[module][name][0]
    with pytest.warns(DeprecationWarning) as seen:
        old = getattr(mod, name)
    assert len(seen) == 1
    text = str(seen[0].message)
    assert f"{module.replace('distrain', 'dt', 1)}.{name} is deprecated; use {new_path}." in text
    assert seen[0].filename == __file__  # points at the user's line
    new = dt
    for part in new_path.split(".")[1:]:
        new = getattr(new, part)
    assert old is new
    assert name not in getattr(mod, "__all__", ())
    assert name not in dir(mod)
    with pytest.warns(DeprecationWarning):  # every access warns, not only the first
        getattr(mod, name)


def test_unknown_names_still_raise_attribute_error():
    for mod in (dt, dt.experimental, dt.data):
        with pytest.raises(AttributeError, match=r"has no attribute 'NoSuchName'"):
            mod.NoSuchName  # noqa: B018


def test_tensorflow_code_runs_with_a_warning():
    """The seed documents' spelling, as a migrating user writes it."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cls = dt.experimental.MultiWorkerMirroredStrategy
        impl = dt.experimental.CollectiveCommunication.RING
    assert cls is dt.MultiWorkerMirroredStrategy
    assert impl is dt.CommunicationImplementation.RING
    assert [w.category for w in seen] == [DeprecationWarning, DeprecationWarning]


def test_the_changelog_lists_every_deprecation():
    text = CHANGELOG.read_text()
    deprecated = text[text.index("### Deprecated") :]
    for module, name in ENTRIES:
        old = f"{module.replace('distrain', 'dt', 1)}.{name}"
        assert re.search(rf"`{re.escape(old)}`", deprecated), old
