"""Actor names and typed references: ``LoaderRef(via, name).deliver(...)`` instead of method-name strings.

A reference is an actor's name plus something that can call it (a :class:`~.transport.Transport`, or
the picklable peers handle roles hold); every method returns a ``concurrent.futures.Future`` and takes
an optional ``timeout`` (default: the reference's). This is the only module that spells remote method
names, so the data path can be followed hop by hop with grep and an IDE.
"""

from __future__ import annotations

import concurrent.futures as cf

__all__ = ["PLANNER", "REGISTRY", "LAUNCHER", "loader_actor", "shadow_actor", "constructor_actor", "role_names",
           "ActorRef", "LoaderRef", "ConstructorRef", "PlannerRef", "RegistryRef", "LauncherRef"]

PLANNER = "planner"
REGISTRY = "planner-registry"            # hosted by the leader client (see client_recovery.PlannerRegistry)
LAUNCHER = "launcher"                    # hosted by a launched job's node 0 (see launch.PlannerStarter)


def loader_actor(name: str) -> str:
    return f"loader:{name}"


def shadow_actor(name: str) -> str:
    return f"shadow:{name}"


def constructor_actor(c: int) -> str:
    return f"constructor:{c}"


def role_names(sources: list[str], constructors: int, shadows: bool = False) -> list[str]:
    """Every actor of a job, in placement order: the Planner, the loaders, the constructors, the shadows."""
    return ([PLANNER] + [loader_actor(n) for n in sources] + [constructor_actor(c) for c in range(constructors)]
            + ([shadow_actor(n) for n in sources] if shadows else []))


class ActorRef:
    """What every role answers: its stats, its process (pid, memory, sockets), and close."""

    def __init__(self, via, name: str, timeout: float):
        self.via, self.name, self.timeout = via, name, float(timeout)

    def _call(self, method: str, *args, timeout: float | None = None, direct: bool = False) -> cf.Future:
        return self.via.call(self.name, method, *args, timeout=timeout or self.timeout, direct=direct)

    def _now(self, method: str, *args, timeout: float | None = None) -> cf.Future:
        """A call the caller waits for at once, whose method waits on no actor the caller runs (see
        ``Transport.call``'s ``direct``): in one process it may run on the caller's thread."""
        return self._call(method, *args, timeout=timeout, direct=True)

    def stats(self, timeout: float | None = None) -> cf.Future:
        return self._call("stats", timeout=timeout)

    def process(self, detail: bool = True, timeout: float | None = None) -> cf.Future:
        return self._call("process", detail, timeout=timeout)

    def close(self, timeout: float | None = None) -> cf.Future:
        return self._call("close", timeout=timeout)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class LoaderRef(ActorRef):
    """A Source Loader (:class:`~.loader_actor.LoaderActor`), primary or shadow."""

    def warm(self, timeout=None):
        return self._call("warm", timeout=timeout)

    def metadata(self, timeout=None):
        return self._now("metadata", timeout=timeout)

    def deliver(self, gen, step, indices, routes, where, timeout=None):
        """On the loader's own thread also in one process: the loaders refill in parallel."""
        return self._call("deliver", gen, step, indices, routes, where, timeout=timeout)

    def exhausted(self, timeout=None):
        return self._now("exhausted", timeout=timeout)

    def get_state(self, timeout=None):
        return self._now("get_state", timeout=timeout)

    def new_generation(self, gen, state, timeout=None):
        return self._now("new_generation", gen, state, timeout=timeout)

    def follow(self, version, state, timeout=None):
        return self._call("follow", version, state, timeout=timeout)

    def promote(self, gen, state, timeout=None):
        return self._now("promote", gen, state, timeout=timeout)

    def restore(self, gen, snapshot, consumed, timeout=None):
        return self._now("restore", gen, snapshot, consumed, timeout=timeout)

    def catch_up(self, gen, consumed, timeout=None):
        """On the loader's own thread: a reshard's new part catches up while the old parts serve."""
        return self._call("catch_up", gen, consumed, timeout=timeout)


class ConstructorRef(ActorRef):
    """A Data Constructor (:class:`~.constructor_actor.ConstructorActor`)."""

    def new_generation(self, gen, planner, where, timeout=None):
        return self._now("new_generation", gen, planner, where, timeout=timeout)

    def put(self, gen, step, source, records, loader=None, timeout=None):
        return self._now("put", gen, step, source, records, loader, timeout=timeout)

    def commit(self, gen, step, plan, buckets, state, info, timeout=None):
        return self._now("commit", gen, step, plan, buckets, state, info, timeout=timeout)

    def fail(self, gen, step, error, timeout=None):
        return self._now("fail", gen, step, error, timeout=timeout)

    def fetch(self, gen, step, ranks, client, consumed, lead=False, feedback=(), with_plan=False, timeout=None):
        return self._now("fetch", gen, step, ranks, client, consumed, lead, list(feedback), with_plan,
                          timeout=timeout)

    def leader_left(self, gen, reason, timeout=None):
        return self._call("leader_left", gen, reason, timeout=timeout)

    def release(self, gen, below, timeout=None):
        return self._now("release", gen, below, timeout=timeout)

    def resume_point(self, timeout=None):
        return self._call("resume_point", timeout=timeout)


class PlannerRef(ActorRef):
    """The Planner (:class:`~.planner_actor.PlannerActor`)."""

    def attach(self, client, state, step, prefetch=None, timeout=None):
        return self._call("attach", client, state, step, prefetch, timeout=timeout)

    def abort(self, reason, timeout=None):
        return self._call("abort", reason, timeout=timeout)

    def advance(self, gen, step, feedback, timeout=None):
        return self._call("advance", gen, step, list(feedback), timeout=timeout)

    def generation(self, timeout=None):
        return self._call("generation", timeout=timeout)

    def report_failure(self, actor, step, timeout=None):
        return self._call("report_failure", actor, step, timeout=timeout)

    def recover(self, home, name, timeout=None):
        return self._call("recover", home, name, timeout=timeout)

    def state_dict(self, timeout=None):
        return self._call("state_dict", timeout=timeout)

    def checkpoint_start(self, timeout=None):
        return self._call("checkpoint_start", timeout=timeout)

    def start_state(self, timeout=None):
        return self._call("start_state", timeout=timeout)

    def roles(self, timeout=None):
        return self._call("roles", timeout=timeout)


class RegistryRef:
    """The leader client's Planner registry (:class:`~.client_recovery.PlannerRegistry`)."""

    def __init__(self, transport, timeout: float):
        self.transport, self.timeout = transport, float(timeout)

    def planner_after(self, old, wait, timeout=None):
        return self.transport.call_client(0, REGISTRY, "planner_after", old, wait, timeout=timeout or self.timeout)


class LauncherRef:
    """A launched job's node-0 launcher (:class:`~torchdata_overlord.launch.PlannerStarter`), the last
    client of its RPC group."""

    def __init__(self, transport, timeout: float):
        self.transport, self.timeout = transport, float(timeout)

    def start_planner(self, name, dead, timeout=None):
        launcher = len(self.transport.rendezvous["client_ranks"]) - 1
        return self.transport.call_client(launcher, LAUNCHER, "start_planner", name, list(dead),
                                          timeout=timeout or self.timeout)
