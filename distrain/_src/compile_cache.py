"""JAX's persistent compilation cache, on by default for ``distrain train`` and the
processes ``distrain launch`` starts.

A restart compiles the same programs again (2-4 s a restart on a 2-core CPU, minutes
for a large model on an accelerator); with the cache a restarted process reads them
back. The cache is jax's own (keyed by the program, the jax and XLA versions, the
flags and the devices, so a stale entry is never used); this module only chooses its
directory:

* ``DISTRAIN_COMPILATION_CACHE=0`` (or ``off``): no cache;
* ``DISTRAIN_COMPILATION_CACHE=DIR``: that directory;
* otherwise, when ``JAX_COMPILATION_CACHE_DIR`` or jax's ``jax_compilation_cache_dir``
  is already set, that one (nothing changes);
* otherwise ``$XDG_CACHE_HOME/distrain/xla`` (``~/.cache/distrain/xla``): shared by the
  attempts of a run and by later runs of the same program.

jax keeps what took at least ``jax_persistent_cache_min_compile_time_secs`` (1 s by
default) to compile and does not bound the directory's size: delete it at will.

Example:
  >>> enable()     # in a process before its first compilation
  '/home/me/.cache/distrain/xla'
"""

from __future__ import annotations

import os

ENV = "DISTRAIN_COMPILATION_CACHE"
_OFF = ("0", "off", "false", "no")


def directory(environ: os._Environ[str] | dict[str, str] = os.environ) -> str | None:
    """The cache directory distrain would set, or None (off, or the user set jax's)."""
    setting = environ.get(ENV, "").strip()
    if setting.lower() in _OFF:
        return None
    if setting:
        return os.path.abspath(os.path.expanduser(setting))
    if environ.get("JAX_COMPILATION_CACHE_DIR"):
        return None
    home = environ.get("HOME") or os.path.expanduser("~")
    base = environ.get("XDG_CACHE_HOME") or os.path.join(home, ".cache")
    return os.path.join(base, "distrain", "xla")


def enable() -> str | None:
    """Points this process's jax at :func:`directory` unless jax already has a cache
    directory; returns the directory in use (None: no cache)."""
    import jax

    current = getattr(jax.config, "jax_compilation_cache_dir", None)
    if current:
        return str(current)
    chosen = directory()
    if chosen is not None:
        jax.config.update("jax_compilation_cache_dir", chosen)
    return chosen


def child_env(environ: dict[str, str]) -> dict[str, str]:
    """``environ`` with ``JAX_COMPILATION_CACHE_DIR`` set for a child process (the
    launcher's), unless it is off or already set."""
    chosen = directory(environ)
    return environ if chosen is None else {**environ, "JAX_COMPILATION_CACHE_DIR": chosen}
