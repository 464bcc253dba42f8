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

The global parameters live in shard holders (``param_shards.py``), one named, detached
Ray actor per shard beside the coordinator's, made by the first island with its initial
values (made by the coordinator from the committed shard files if it finds one gone).
The island's proxy (:class:`Coordinator`) routes the tensors: on ``submit`` it sends
each holder its shard of the pseudo-gradient, then the coordinator the rows and
metrics; on ``wait_round`` it reads the round's parameters from the holders. No
parameter passes through the coordinator.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

from distrain._src.islands import param_shards
from distrain._src.islands.island_coordinator import (
    IslandCoordinator,
    IslandsFailed,
    RejoinRequired,
)
from distrain._src.islands.param_shards import (
    Exchange,
    HolderLost,
    LeafSpec,
    PseudoGradientLost,
    ShardFailed,
    ShardHolder,
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


def holder_name(directory: str, index: int, shards: int) -> str:
    """The holder of shard ``index`` of the run in ``directory``."""
    return f"{actor_name(directory)}-shard-{index}-of-{shards}"


def check_shared(directory: str, run_id: str) -> None:
    """Refuses to start an actor where ``directory`` does not hold ``run_id`` (a holder
    made by ``ShardHolder(..., check=partial(check_shared, directory, run_id))``).

    Raises:
      DirectoryNotShared: it does not (one line).
    """
    seen = _read_run_id(directory)
    if seen != run_id:
        raise DirectoryNotShared(_not_shared(directory, run_id, seen))


class RayHolders:
    """The run's shard holders as Ray actors, made if absent (``segments``: each
    shard's initial values, or only their specs); a call runs on all at once.

    Args:
      directory: the run directory (absolute).
      segments: per shard, its initial segments or their :class:`LeafSpec`.
      outer_optimizer: the outer optimizer.
      run_id: the run directory's id.
      timeout: seconds a call may take.
    """

    def __init__(self, directory: str, segments: list[list[Any]], outer_optimizer: Any,
                 run_id: str, timeout: float) -> None:  # fmt: skip
        self.timeout = timeout
        self.handles = [
            _holder(directory, k, len(segments), seg, outer_optimizer, run_id)
            for k, seg in enumerate(segments)
        ]

    def map(self, method: str, args: list[tuple[Any, ...]]) -> list[Any]:
        """``method`` on every holder at once; a holder's error comes back as raised.

        Raises:
          HolderLost: a holder's actor died (Ray restarts it).
        """
        ray = import_ray()
        refs = [getattr(h, method).remote(*a) for h, a in zip(self.handles, args, strict=True)]
        try:
            return list(ray.get(refs, timeout=self.timeout))
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"a shard holder did not answer {method}() within {self.timeout:g} s. "
                "Expected it to be alive (see events.jsonl in the run directory)."
            ) from None
        except ray.exceptions.RayActorError as e:
            if e.actor_init_failed:
                raise _failed_to_start(e, "a shard holder") from None
            raise HolderLost(f"a shard holder restarted ({type(e).__name__})") from None
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, ShardFailed | PseudoGradientLost | ValueError):
                raise e.cause from None
            raise

    def kill(self) -> None:
        for handle in self.handles:
            import_ray().kill(handle, no_restart=True)


def _holder(directory: str, index: int, shards: int, segments: list[Any],
            outer_optimizer: Any, run_id: str) -> Any:  # fmt: skip
    """The handle of shard ``index``'s holder, made with ``segments`` if it is absent
    (looked up first: its initial values would go through Ray on every connect)."""
    ray = import_ray()
    name = holder_name(directory, index, shards)
    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:  # absent: made here (another island may make it first)
        pass
    return (
        ray.remote(ShardHolder)
        .options(
            name=name,
            namespace=NAMESPACE,
            get_if_exists=True,
            lifetime="detached",
            max_restarts=-1,
            max_concurrency=16,  # islands put and read while the coordinator applies
            num_cpus=0,
            runtime_env={"env_vars": {"JAX_PLATFORMS": "cpu"}},
        )
        .remote(
            directory,
            index,
            shards,
            segments,
            outer_optimizer,
            functools.partial(check_shared, directory, run_id),
        )  # fmt: skip
    )


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
        specs = param_shards.specs_of(params)
        holders = None  # outside a Ray worker (in-process use): in-process holders
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            cut = param_shards.plan([s.shape for s in specs], config.shards)
            # The first island made the holders with the initial values; one gone since
            # (out of restarts) is made again from its committed shard file.
            segments = [[LeafSpec((s.stop - s.start,), specs[s.leaf].dtype) for s in seg]
                        for seg in cut]  # fmt: skip
            holders = RayHolders(os.path.abspath(directory), segments, outer_optimizer,
                                 run_id, timeout=max(60.0, 10 * config.death_timeout))  # fmt: skip
            params = specs
        super().__init__(config, params, treedef, outer_optimizer, directory, holders)

    def _round_params(self) -> list[Any]:
        return []  # the islands' proxies read them from the holders

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
    config, leaves, treedef, outer_optimizer, directory = args
    specs = param_shards.specs_of(leaves)
    cut = param_shards.plan([s.shape for s in specs], config.shards)
    segments = [param_shards.split(leaves, seg) for seg in cut]
    timeout_s = timeout

    def exchange() -> Exchange:  # the holders first: the coordinator finds them
        holders = RayHolders(os.path.abspath(directory), segments, outer_optimizer, rid, timeout_s)
        return Exchange(specs, config.shards, holders, config.outer_dtype)

    args = (config, specs, treedef, outer_optimizer, directory)
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
    coord = Coordinator(lambda: actor.remote(*args, rid), timeout, rid, exchange)
    coord.retry(lambda: coord("status"))
    return coord


def _failed_to_start(e: Exception, what: str = "the islands' coordinator") -> Exception:
    """The error of an actor whose constructor raised (Ray keeps only its text)."""
    text = str(e)
    marker = f"{DirectoryNotShared.__name__}: "
    if marker in text:  # the last line of the traceback: the refusal, one line
        return DirectoryNotShared(text.rsplit(marker, 1)[1].strip())
    return RuntimeError(f"{what} failed to start: {text}")


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
      exchange: makes (if absent) and returns the shard holders; the proxy sends them the
        pseudo-gradients and reads the parameters from them.
    """

    def __init__(self, create: Callable[[], Any], timeout: float, run_id: str,
                 exchange: Callable[[], Exchange]) -> None:  # fmt: skip
        self.create = create
        self.timeout = timeout
        self.run_id = run_id
        self.make_exchange = exchange
        self.exchange: Exchange | None = None
        self.handle: Any = None
        self.bytes_sent = self.bytes_received = 0  # through the holders, by this process

    def _connect(self) -> Any:
        ray = import_ray()
        self.exchange = self.make_exchange()
        handle = self.create()
        problem = ray.get(handle.check_directory.remote(self.run_id), timeout=self.timeout)
        if problem is not None:
            raise DirectoryNotShared(problem)
        self.handle = handle
        return handle

    def __call__(self, method: str, *args: Any) -> Any:
        """``method(*args)`` of the coordinator; ``submit`` sends the pseudo-gradient to
        the holders first, ``wait_round`` reads the round's parameters from them (None,
        to be called again, while a holder serves another round)."""
        if method == "submit":
            island, token, round_, grads, *metrics = args
            if grads is not None:
                self._holders(lambda x: x.put(island, token, round_, grads))
            return self._call("submit_sent", island, token, round_, grads is not None, *metrics)
        result = self._call(method, *args)
        if method == "wait_round" and result is not None:
            params = self._holders(lambda x: x.params(result.round))
            return None if params is None else result._replace(params=params)
        return result

    def _holders(self, call: Callable[[Exchange], Any]) -> Any:
        """``call`` on the shard holders; a restarted holder asks the island to rejoin."""
        exchange = self.exchange
        if exchange is None:
            self._call("status")  # connects, and makes the holders' handles
            exchange = self.exchange
        if exchange is None:  # pragma: no cover - _connect always sets it
            raise RuntimeError("the islands' proxy has no shard holders after connecting")
        sent, received = exchange.bytes_sent, exchange.bytes_received
        try:
            return call(exchange)
        except HolderLost as e:
            self.handle = None  # reconnect: the holders again (Ray restarted one)
            raise RejoinRequired(str(e)) from None
        finally:
            self.bytes_sent += exchange.bytes_sent - sent
            self.bytes_received += exchange.bytes_received - received

    def _call(self, method: str, *args: Any) -> Any:
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
        """Ends the actors: the run is over (a rerun in its directory gets fresh ones)."""
        if self.handle is not None:
            import_ray().kill(self.handle, no_restart=True)
        if self.exchange is not None:
            self.exchange.holders.kill()

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
