"""The Source Loader actor: a SourceLoader that hands each step's planned samples straight to the constructors.

It never talks to the trainer and never sends sample bytes to the Planner: the Planner orders
``deliver(step)``, the samples go loader -> constructor (``put``), and the answer is a
:class:`Delivery`: the loader's state after the step and the metadata of its refilled buffer, which
the Planner plans the next step from (one call per loader and step; ``metadata()`` is asked only
when no delivery answered it: the first step, after a reset or a replacement).
"""

from __future__ import annotations

import time
from typing import Mapping, NamedTuple

from ..errors import ConfigError, a_type
from ..plane.records import BufferMeta
from ..roles.loader_parts import part_key
from ..roles.source_loader import SourceLoader, record_bytes
from ..sources.read_ahead import ReadAhead
from . import shm
from .refs import ConstructorRef
from .role import RoleActor, gather
from .step import JobReset
from .wire import hold

__all__ = ["LoaderActor", "Delivery"]


class Delivery(NamedTuple):
    """A loader's answer to ``deliver(step)``: its state after the step, and the metadata of its
    buffer refilled for the next step (None when the refill failed: ``metadata()`` then raises why,
    when the next step is planned)."""

    state: dict
    meta: BufferMeta | None


class LoaderActor(RoleActor):
    """A SourceLoader that delivers each step's planned samples straight to the constructors.

    ``part=(j, k)``: it reads part ``j`` of its source's ``k`` data-parallel parts (see
    :mod:`~torchdata_overlord.roles.loader_parts`).

    Fault tolerance: the Planner snapshots every source's state to the checkpoint store and logs
    what each step took, so :meth:`restore` rebuilds the state at any version from a snapshot plus a
    replay. A *shadow* is the same actor kept idle: it is told the primary's state after every step
    (:meth:`follow`) and :meth:`promote` makes it the primary. Calls from an older generation (a
    frozen Planner that woke up) are refused.
    """

    def __init__(self, spec, buffer_size: int, workers: int, image_token_id: int | None, timeout: float,
                 read_ahead: bool, peers, part: tuple[int, int] = (0, 1)):
        source = spec.build(fresh=part[1] > 1)
        if part[1] > 1:
            if not hasattr(source, "shard"):
                raise ConfigError(f"source {spec.name!r}: {a_type(source)} cannot be split into data-parallel "
                                  f"loaders (only sources read by row groups or files can); give it one loader actor")
            source.shard(*part)
        # read_ahead (the rpc runtime): between steps, the rows of the next refill are read and transformed
        self.ahead = ReadAhead(source) if read_ahead else None
        source = self.ahead or source
        self.loader = SourceLoader(source, buffer_size, workers, image_token_id)
        self.name, self.timeout, self.peers = spec.name, float(timeout), peers
        self.part, self.key = tuple(part), part_key(spec.name, *part)
        self.gen, self.delivered = 0, 0
        self.followed: tuple[int, dict] | None = None        # (version, state) of the primary, when a shadow
        self.sent = {"samples": 0, "bytes": 0, "seconds": 0.0}   # to constructors: what and how long
        self.refill_error: BaseException | None = None       # what the refill after the last delivery raised

    def _check_gen(self, gen: int) -> None:
        if gen < self.gen:
            raise JobReset(f"loader {self.name!r}: a call of generation {gen}, the job is at {self.gen}")

    def warm(self) -> int:
        """Open the source and fill the first buffer (at start-up, under the start-up timeout, so the
        first step's calls are not mistaken for a frozen loader); returns the samples buffered."""
        self.loader.fill()
        return self.loader.stats()["buffered"]

    def metadata(self) -> BufferMeta:
        """The buffer's metadata, filled first; raises (once) the error a refill after the last delivery met."""
        err, self.refill_error = self.refill_error, None
        if err is not None:
            raise err
        return self.loader.metadata()

    def deliver(self, gen: int, step: int, indices: list, routes: Mapping[str, list],
                where: Mapping[str, str] | None = None) -> Delivery:
        """Take ``indices`` (every sampled one, dropped ones too: consumed), send each constructor
        its part and refill while the parts travel: the answer is the state after the step and the
        next step's metadata. A refill that fails does not fail this step: it is raised when the next
        step asks (``metadata()``)."""
        self._check_gen(gen)
        if where:
            self.peers.learn(dict(where))
        self.loader.fill()                  # a promoted or restored loader starts with an empty buffer
        recs = self.loader.take(indices) if indices else {}
        self._hold_ahead(routes)
        t0, acked = time.perf_counter(), []
        futs = {c: ConstructorRef(self.peers, c, self.timeout).put(gen, step, self.name, {i: recs[i] for i in idx},
                                                                   self.key)
                for c, idx in routes.items()}
        for f in futs.values():
            f.add_done_callback(lambda _: acked.append(time.perf_counter()))
        state = self.loader.get_state()
        try:                                # the next step's read, while the parts travel and are built
            meta = self.loader.metadata()
        except Exception as e:              # noqa: BLE001 - the next step's error, not this one's
            meta, self.refill_error = None, e
        if self.ahead is not None and meta is not None:    # and the step after's, until it is ordered
            self.ahead.ahead(len(indices))
        gather(futs, self.timeout)
        self.sent["seconds"] += (max(acked) if len(acked) == len(futs) else time.perf_counter()) - t0 if futs else 0.0
        self.sent["samples"] += sum(len(idx) for idx in routes.values())
        self.sent["bytes"] += sum(record_bytes(recs[i]) for idx in routes.values() for i in idx)
        self.delivered += 1
        return Delivery(state, meta)

    def _hold_ahead(self, routes: Mapping[str, list]) -> None:
        """Have the read-ahead thread put the samples it transforms into shared memory (:func:`.wire.hold`)
        while most of a step's samples go to constructors in other processes of this host: a put then
        sends them by place instead of copying them (one copy either way, made ahead of the step instead
        of in it); a sample that stays in this process would be copied for nothing, so not otherwise."""
        if self.ahead is None:
            return
        far = near = 0
        if shm.sharing():                   # (else no RPC group, or no peer of this host yet)
            from .rpc_agent import self_name

            here = self_name()
            for c, idx in routes.items():
                w = self.peers.where(c)
                if w != here and shm.peer_ready(w):
                    far += len(idx)
                else:
                    near += len(idx)
        self.ahead.finish = hold if far > near else None

    # -- standby and recovery ------------------------------------------------------------------
    def follow(self, version: int, state: dict) -> None:
        """A shadow keeps the primary's latest state (cheap: a few numbers, no reading). The first
        time, it also reads a buffer's worth at that state, so its files are open, its row group
        decoded and its transform loaded: a promotion then only re-reads one buffer."""
        first = self.followed is None
        self.followed = (int(version), state)
        if first:
            self.loader.reset(state)
            self.loader.fill()
            self.loader.reset(state)         # keep the warm source, not the buffered samples

    def promote(self, gen: int, state: dict) -> dict:
        """Become the primary at ``state`` (the state after the last completed step)."""
        self.gen, self.refill_error = gen, None
        self.loader.reset(state)
        return self.loader.get_state()

    def restore(self, gen: int, snapshot: dict, consumed: list) -> dict:
        """Differential restore: ``snapshot`` plus a replay of the steps' consumption since."""
        self.gen, self.refill_error = gen, None
        return self.loader.replay(snapshot, consumed)

    def catch_up(self, gen: int, consumed: list) -> dict:
        """A loader started for a reshard (:mod:`.reshard`) redoes the consumption of the steps since its
        state (``consumed``: each step's sampled indices of its source), from where it is, and refills
        for the next step; returns its state after those steps (as a :class:`Delivery` would). A
        refill that fails is raised when the next step asks (``metadata()``), as after a delivery."""
        self._check_gen(gen)
        state = self.loader.catch_up(consumed)
        try:
            self.loader.fill()
        except Exception as e:              # noqa: BLE001 - the next step's error, not this one's
            self.refill_error = e
        return state

    def exhausted(self) -> bool:
        return bool(self.loader.exhausted)

    def stats(self) -> dict:
        return {**self.loader.stats(), "steps_delivered": self.delivered, "sent": dict(self.sent),
                "part": list(self.part), "read_ahead": None if self.ahead is None else dict(self.ahead.counts)}

    def get_state(self) -> dict:
        return self.loader.get_state()

    def new_generation(self, gen: int, state: dict) -> None:
        """Start generation ``gen`` at ``state`` (a loaded checkpoint, or a rewind)."""
        self.gen, self.refill_error = gen, None
        if not self.loader.holds(state):    # (the first start loads the state the warm-up filled from)
            self.loader.reset(state)

    def close(self) -> None:
        self.loader.close()
