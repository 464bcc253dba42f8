"""`make test` runs the suite on both ends of the jax range (README, "Supported versions").

Without a Python 3.12 the newest-jax run is skipped with a message; under ``CI=true``
that is an error, never a skip. ``.ci/find-python`` finds an interpreter on the PATH or
in pyenv, or prints nothing.
"""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def make_newest(ci: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "MAKEFLAGS", "MFLAGS")}
    if ci is not None:
        env["CI"] = ci
    return subprocess.run(
        ["make", "--no-print-directory", "test-newest", "PYTHON_NEW="],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_without_python_3_12_the_newest_run_is_skipped_with_a_message():
    done = make_newest(ci=None)
    assert done.returncode == 0, done.stderr
    assert "SKIPPED: the newest-jax run (no Python 3.12" in done.stdout


def test_under_ci_a_missing_python_3_12_is_an_error():
    done = make_newest(ci="true")
    assert done.returncode != 0
    assert "error: no Python 3.12 found" in done.stderr


def test_find_python_finds_this_interpreter_and_nothing_for_an_absent_version():
    want = f"{sys.version_info.major}.{sys.version_info.minor}"
    script = str(ROOT / ".ci" / "find-python")
    found = subprocess.run([script, want], capture_output=True, text=True, timeout=30)
    assert found.returncode == 0 and found.stdout.strip()
    version = subprocess.run(
        [found.stdout.strip(), "-c", "import sys; print(sys.version_info[:2])"],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout.strip()
    assert version == str(sys.version_info[:2])
    absent = subprocess.run([script, "3.99"], capture_output=True, text=True, timeout=30)
    assert absent.returncode == 0 and absent.stdout == ""


def _collected(end: str, *files: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DISTRAIN_TEST_END": end}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            *files,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


# Three files: one marked for each end, and one with a split test (test_nn_attention.py).
COLLECTED = ("tests/test_launch.py", "tests/test_benchmarks.py", "tests/test_nn_attention.py")


@pytest.fixture(scope="module")
def collected() -> dict[str, list[str]]:
    """The test ids pytest collects from COLLECTED with each DISTRAIN_TEST_END (no end:
    ""): one collection per end serves both tests below (each is a pytest process)."""
    ids = {}
    for end in ("", "lowest", "newest"):
        done = _collected(end, *COLLECTED)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        ids[end] = [line for line in done.stdout.splitlines() if "::" in line]
    return ids


@pytest.mark.one_end("lowest")  # a slow test: see tests/conftest.py
def test_one_end_tests_are_collected_on_their_end_only(collected):
    files = {end: {i.split("::")[0] for i in ids} for end, ids in collected.items()}
    assert files[""] == set(COLLECTED)  # no end given: everything runs
    launch, benchmarks, attention = COLLECTED  # newest only, lowest only, both
    assert files["lowest"] == {benchmarks, attention}
    assert files["newest"] == {launch, attention}


@pytest.mark.one_end("lowest")  # a slow test: see tests/conftest.py
def test_split_ends_variants_alternate_between_the_ends(collected):
    """Each end runs half of a split test's cases, together all of them, none twice."""
    name = "test_split_attention_equals_the_whole_float32"
    every, low, new = ([i for i in collected[end] if f"::{name}[" in i] for end in collected)
    assert len(every) >= 4 and set(low) | set(new) == set(every) and not set(low) & set(new)
    assert low == every[0::2] and new == every[1::2]


SPLIT_MISUSED = "split_ends is for a parametrized test without one_end"


@pytest.mark.parametrize(
    "marks, case, message",
    [
        ("@pytest.mark.split_ends", "def test_single(): pass", SPLIT_MISUSED),
        (
            '@pytest.mark.split_ends\n@pytest.mark.one_end("lowest")\n'
            '@pytest.mark.parametrize("x", [1, 2])',
            "def test_both(x): pass",
            SPLIT_MISUSED,
        ),
        (
            '@pytest.mark.one_end("lowest")\n@pytest.mark.one_end("newest")',
            "def test_two_ends(): pass",
            "one_end names two ends",
        ),
    ],
)
@pytest.mark.split_ends  # a slow test: see tests/conftest.py
def test_a_marker_that_cannot_be_followed_is_a_usage_error(tmp_path, marks, case, message):
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nmarkers =\n  one_end(end): an end\n  split_ends: variants alternate\n"
    )
    (tmp_path / "test_bad.py").write_text(f"import pytest\n\n{marks}\n{case}\n")
    env = {**os.environ, "DISTRAIN_TEST_END": "lowest"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 4, done.stdout[-2000:] + done.stderr[-2000:]
    assert message in done.stderr


def test_an_unknown_end_is_a_usage_error():
    done = _collected("oldest", "tests/test_launch.py")
    assert done.returncode == 4
    assert "DISTRAIN_TEST_END must be one of ('lowest', 'newest'); got 'oldest'" in done.stderr


def test_make_test_names_the_end_each_run_is():
    def dry(target: str, python_new: str) -> str:
        return subprocess.run(
            ["make", "-n", "--no-print-directory", target, f"PYTHON_NEW={python_new}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout

    assert "DISTRAIN_TEST_END=lowest " in dry("test-lowest", sys.executable)
    # No Python 3.12, no newest run: the lowest end runs the newest end's tests too.
    assert "DISTRAIN_TEST_END= " in dry("test-lowest", "")
