"""The coordinator as a Ray actor, and calls to it that survive its restart.

The actor is named (one per run directory) and created by the first island that asks
(``get_if_exists``), detached from that island's life, restarted by Ray if its process
dies (``max_restarts=-1``: the constructor resumes from the run's latest checkpoint),
and threaded (islands block in ``lease`` and ``wait_round`` while others submit).
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from distrain._src.islands.coordinator import IslandsFailed, RejoinRequired

NAMESPACE = "distrain-islands"


def import_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ImportError(
            "Fault-isolated islands need Ray (the islands and their coordinator talk "
            "through it). Install the extra: `pip install 'distrain[ray]'`."
        ) from e
    return ray


def actor_name(directory: str) -> str:
    """One coordinator per run directory."""
    return "islands-" + hashlib.sha1(os.path.abspath(directory).encode()).hexdigest()[:16]


def connect(address: str | None, islands: int) -> None:
    """Joins the Ray cluster of the run (``address``, else ``RAY_ADDRESS``); a single
    island may start a local one."""
    ray = sys.modules.get("ray")  # not imported: not initialized (or not installed)
    if ray is not None and ray.is_initialized():  # the caller's own ray.init()
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address is None and islands > 1:
        raise RuntimeError(
            f"{islands} islands need one Ray cluster to meet in, and none is given. Start "
            "them with `distrain launch --islands N -- python train.py` (it starts a local "
            "Ray cluster), or set RAY_ADDRESS (or ray_address=) to a running cluster."
        )
    import_ray()
    from distrain._src.ps.ray_backend import connect as ps_connect

    ps_connect(address)


def coordinator(name: str, args: tuple[Any, ...]) -> Any:
    """The run's coordinator actor, created with ``args`` if it does not exist yet."""
    ray = import_ray()
    from distrain._src.islands.coordinator import IslandCoordinator

    cls = ray.remote(IslandCoordinator)
    return cls.options(
        name=name,
        namespace=NAMESPACE,
        get_if_exists=True,
        lifetime="detached",
        max_restarts=-1,
        max_concurrency=64,
        num_cpus=0,
        runtime_env={"env_vars": {"JAX_PLATFORMS": "cpu"}},
    ).remote(*args)


class Coordinator:
    """Island-side proxy: blocking calls with a deadline; the coordinator's restarts and
    the errors raised inside it come back as `RejoinRequired` / the original error.

    Args:
      handle: the actor handle.
      timeout: seconds a call may wait for the coordinator (e.g. while Ray restarts it)
        before it raises ``TimeoutError``.
    """

    def __init__(self, handle: Any, timeout: float) -> None:
        self.handle = handle
        self.timeout = timeout

    def __call__(self, method: str, *args: Any) -> Any:
        ray = import_ray()
        try:
            return ray.get(getattr(self.handle, method).remote(*args), timeout=self.timeout)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"the islands' coordinator did not answer {method}() within {self.timeout:g} s. "
                "Expected it to be alive (see events.jsonl in the run directory)."
            ) from None
        except ray.exceptions.RayActorError as e:
            raise RejoinRequired(f"the coordinator restarted ({type(e).__name__})") from None
        except ray.exceptions.RayTaskError as e:
            cause = e.cause
            if isinstance(cause, RejoinRequired | IslandsFailed | ValueError):
                raise cause from None
            raise

    def poll(self, method: str, *args: Any, until: float | None = None) -> Any:
        """Calls ``method`` (which returns None while it should be called again) until
        it returns something."""
        deadline = time.time() + (until or self.timeout)
        while True:
            result = self(method, *args)
            if result is not None:
                return result
            if time.time() > deadline:
                raise TimeoutError(
                    f"{method}() of the islands' coordinator had no answer for "
                    f"{until or self.timeout:g} s."
                )

    def retry(self, fn: Callable[[], Any]) -> Any:
        """Runs ``fn`` until the coordinator (restarting) answers, for ``timeout`` s."""
        deadline = time.time() + self.timeout
        while True:
            try:
                return fn()
            except RejoinRequired:
                if time.time() > deadline:
                    raise
                time.sleep(0.5)
