"""The coordinator as a Ray actor, and calls to it that survive its restart.

The actor is named (one per run directory) and created by the first island that asks
(``get_if_exists``), detached from that island's life, restarted by Ray if its process
dies (``max_restarts=-1``: the constructor resumes from the run's latest checkpoint),
and threaded (islands block in ``lease`` and ``wait_round`` while others submit). The
last island to leave a finished run ends it, so that a rerun in the same directory gets
a fresh actor with its own configuration.

Ray may start the actor, or restart it, on any node of the cluster, so the run
directory must be one that every node sees at the same path. The first island writes
an id into it (``DIR/run-id``); the actor refuses to start, with one line, where it does
not read that id (the directory is not shared, or a relative path resolved elsewhere),
rather than find no checkpoint there and start the run over; and each island checks
that the actor reads the id the island reads.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

from distrain._src.islands.island_coordinator import (
    IslandCoordinator,
    IslandsFailed,
    RejoinRequired,
)

NAMESPACE = "distrain-islands"
RUN_ID = "run-id"  # DIR/run-id: this run directory's id, written by the first island


class DirectoryNotShared(ValueError):
    """The coordinator does not see the run directory that the islands write."""


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


def run_id(directory: str) -> str:
    """The id in ``directory/run-id``, written by the first island to get here."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, RUN_ID)
    if not os.path.exists(path):
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        with open(tmp, "w") as f:
            f.write(uuid.uuid4().hex)
        try:
            os.link(tmp, path)  # created only if absent, with its content: one id wins
        except FileExistsError:
            pass
        finally:
            os.remove(tmp)
    return _read_run_id(directory) or ""


def _read_run_id(directory: str) -> str | None:
    try:
        with open(os.path.join(directory, RUN_ID)) as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


def _where() -> str:
    try:
        return f"node {import_ray().util.get_node_ip_address()}"
    except Exception:  # noqa: BLE001 - in-process, without Ray: only the path is known
        return "this process"


class RemoteCoordinator(IslandCoordinator):
    """The actor: an `IslandCoordinator` that starts only where it reads the islands'
    ``run_id`` in its directory, and that tells the last island to leave.

    Raises:
      DirectoryNotShared: its ``directory`` does not hold ``run_id`` where it runs.
    """

    def __init__(
        self,
        config: Any,
        params: Any,
        treedef: str,
        outer_optimizer: Any,
        directory: str,
        run_id: str,
    ) -> None:
        seen = _read_run_id(directory)
        if seen != run_id:
            raise DirectoryNotShared(_not_shared(directory, run_id, seen))
        self.run_id = run_id
        super().__init__(config, params, treedef, outer_optimizer, directory)

    def check_directory(self, run_id: str) -> str | None:
        """None if this coordinator was made for, and still reads, the island's
        ``run_id``; else what is wrong, in one line."""
        seen = _read_run_id(self.directory)
        if seen == run_id == self.run_id:
            return None
        if seen == run_id:
            return (
                f"the coordinator of an earlier run in {self.directory} is still alive "
                f"(made for run id {self.run_id}; the directory now holds {run_id}). "
                "Expected it to have ended with its run. Stop it: ray.kill(ray.get_actor("
                f"{actor_name(self.directory)!r}, namespace={NAMESPACE!r})), then start again."
            )
        return _not_shared(self.directory, run_id, seen)

    def leave(self, island: int, token: str) -> bool:  # type: ignore[override]
        """`IslandCoordinator.leave`; True once no island is alive (the run is over)."""
        super().leave(island, token)
        return not self.status()["alive"]


def _not_shared(directory: str, expected: str, seen: str | None) -> str:
    found = f"run id {seen}" if seen else "no run-id file"
    return (
        f"the islands' coordinator ({_where()}) does not see the run directory the islands "
        f"write: the islands wrote run id {expected} in {RUN_ID}, and it finds {found} in "
        f"{os.path.abspath(directory)}. Expected a directory that every node of the Ray "
        "cluster sees at the same absolute path (a shared filesystem); Ray may start or "
        "restart the coordinator on any node."
    )


def coordinator(name: str, args: tuple[Any, ...], timeout: float) -> Coordinator:
    """A proxy to the run's coordinator actor (created with ``args`` if it does not
    exist yet), connected: the actor showed that it reads the run directory
    (``args[-1]``) as this process does.

    Raises:
      DirectoryNotShared: it does not (a one-line reason).
    """
    ray = import_ray()
    rid = run_id(args[-1])
    actor = ray.remote(RemoteCoordinator).options(
        name=name,
        namespace=NAMESPACE,
        get_if_exists=True,
        lifetime="detached",
        max_restarts=-1,
        max_concurrency=64,
        num_cpus=0,
        runtime_env={"env_vars": {"JAX_PLATFORMS": "cpu"}},
    )
    coord = Coordinator(lambda: actor.remote(*args, rid), timeout, rid)
    coord.retry(lambda: coord("status"))
    return coord


def _failed_to_start(e: Exception) -> Exception:
    """The error of an actor whose constructor raised (Ray keeps only its text)."""
    text = str(e)
    marker = f"{DirectoryNotShared.__name__}: "
    if marker in text:  # the last line of the traceback: the refusal, one line
        return DirectoryNotShared(text.rsplit(marker, 1)[1].strip())
    return RuntimeError(f"the islands' coordinator failed to start: {text}")


class Coordinator:
    """Island-side proxy: blocking calls with a deadline; the coordinator's restarts and
    the errors raised inside it come back as `RejoinRequired` / the original error.

    After an actor error the next call looks the actor up again (creating it if it is
    gone: ended by the last island of a run while this one joined, or out of restarts),
    and checks that it reads ``run_id`` in the run directory.

    Args:
      create: returns the actor's handle, creating the actor if it does not exist.
      timeout: seconds a call may wait for the coordinator (e.g. while Ray restarts it)
        before it raises ``TimeoutError``.
      run_id: the run directory's id as this process reads it.
    """

    def __init__(self, create: Callable[[], Any], timeout: float, run_id: str) -> None:
        self.create = create
        self.timeout = timeout
        self.run_id = run_id
        self.handle: Any = None

    def _connect(self) -> Any:
        ray = import_ray()
        handle = self.create()
        problem = ray.get(handle.check_directory.remote(self.run_id), timeout=self.timeout)
        if problem is not None:
            raise DirectoryNotShared(problem)
        self.handle = handle
        return handle

    def __call__(self, method: str, *args: Any) -> Any:
        ray = import_ray()
        try:
            handle = self._connect() if self.handle is None else self.handle
            return ray.get(getattr(handle, method).remote(*args), timeout=self.timeout)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"the islands' coordinator did not answer {method}() within {self.timeout:g} s. "
                "Expected it to be alive (see events.jsonl in the run directory)."
            ) from None
        except ray.exceptions.RayActorError as e:
            if e.actor_init_failed:  # not restarted by Ray: the next call would fail alike
                raise _failed_to_start(e) from None
            self.handle = None
            raise RejoinRequired(f"the coordinator restarted ({type(e).__name__})") from None
        except ray.exceptions.RayTaskError as e:
            cause = e.cause
            if isinstance(cause, RejoinRequired | IslandsFailed | ValueError):
                raise cause from None
            raise

    def kill(self) -> None:
        """Ends the actor: the run is over (a rerun in its directory gets a fresh one)."""
        if self.handle is not None:
            import_ray().kill(self.handle, no_restart=True)

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
