"""JAX's persistent compilation cache, on by default for `distrain train` and `distrain
launch` (distrain/_src/compile_cache.py): where it goes, how to turn it off, and that a
program read back from it computes what a fresh compilation computes."""

import json
import os
import subprocess
import sys

from distrain._src import compile_cache
from distrain._src.cluster.launch import add_arguments
from distrain._src.cluster.processes import child_env

# A step of a small MLP, compiled in a fresh process: prints its result and whether jax
# read the executable from the cache (jax.monitoring's cache-hit event).
PROGRAM = """
import json, jax, jax.numpy as jnp, numpy as np
from distrain._src import compile_cache
hits = []
jax.monitoring.register_event_listener(
    lambda e, **kw: hits.append(e) if e == "/jax/compilation_cache/cache_hits" else None)
where = compile_cache.enable()
x = jnp.asarray(np.random.default_rng(0).normal(size=(64, 64)), jnp.float32)
step = jax.jit(lambda w: jnp.tanh(w @ w.T).sum(0) @ w)
print(json.dumps({"dir": where, "hit": bool(hits) or None,
                  "out": np.asarray(step(x)).tolist(), "hit_after": bool(hits)}))
"""


def _run(env: dict[str, str]) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_directory_follows_the_switch_jax_and_xdg(tmp_path):
    base = {"HOME": str(tmp_path / "home")}
    assert compile_cache.directory(base) == str(tmp_path / "home/.cache/distrain/xla")
    xdg = {**base, "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    assert compile_cache.directory(xdg) == str(tmp_path / "xdg/distrain/xla")
    assert compile_cache.directory({**xdg, "JAX_COMPILATION_CACHE_DIR": "/x"}) is None
    for off in ("0", "off", "OFF", "false"):
        assert compile_cache.directory({**xdg, compile_cache.ENV: off}) is None
    mine = {**xdg, compile_cache.ENV: str(tmp_path / "mine"), "JAX_COMPILATION_CACHE_DIR": "/x"}
    assert compile_cache.directory(mine) == str(tmp_path / "mine")


def test_the_launcher_gives_its_processes_the_cache_unless_it_is_off(tmp_path, monkeypatch):
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--nproc", "2", "--", "python"])
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert child_env(args, 1, 1234, 0)["JAX_COMPILATION_CACHE_DIR"] == str(
        tmp_path / "distrain" / "xla"
    )
    monkeypatch.setenv(compile_cache.ENV, "0")
    assert "JAX_COMPILATION_CACHE_DIR" not in child_env(args, 1, 1234, 0)


def test_a_program_read_back_from_the_cache_computes_the_same(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env.update(XDG_CACHE_HOME=str(tmp_path), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    cold, warm = _run(env), _run(env)
    assert cold["dir"] == warm["dir"] == str(tmp_path / "distrain" / "xla")
    assert os.listdir(cold["dir"])  # what the first process compiled is on disk
    assert not cold["hit_after"] and warm["hit_after"]  # the second read it back
    assert warm["out"] == cold["out"]  # bit for bit
    off = _run({**env, compile_cache.ENV: "0"})
    assert off["dir"] is None and not off["hit_after"] and off["out"] == cold["out"]
