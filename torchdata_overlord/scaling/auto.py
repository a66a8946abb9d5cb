"""``placement="auto"``, the rpc runtime's default: profile the sources (journaled between runs), weigh
them by the strategy's mixture at step 0, and partition them over the cores and memory this machine
leaves the data plane (the trainer keeps one core; the loaders may use half the available memory)."""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Mapping

from ..plane.mixture_probe import mixture_schedule
from ..roles.loader_parts import part_key
from ..runtime.refs import PLANNER, constructor_actor, loader_actor, shadow_actor
from .journal import ProfileJournal, default_journal_dir
from .partition import auto_partition, chain_threads, demand_shares, normalise_weights
from .placement import Placement
from .profile import profile_sources

__all__ = ["auto_placement", "chain_workers", "actor_processes", "memory_budget", "MEMORY_SHARE"]

log = logging.getLogger("torchdata_overlord")

MEMORY_SHARE = 0.5          # of MemAvailable: the rest is the trainer's (its batches, its model on the CPU side)


def memory_budget() -> int | None:
    """Bytes the data plane may use: :data:`MEMORY_SHARE` of ``MemAvailable`` (None where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(int(line.split()[1]) * 1024 * MEMORY_SHARE)
    except OSError:
        pass
    return None


def _weights(strategy: Callable, mesh, names: list[str], global_batch: int, seed: int) -> dict[str, float]:
    """The mixture's weights at step 0; equal weights when the strategy does not say before seeing data."""
    schedule = mixture_schedule(strategy, mesh, names, global_batch, seed)
    if schedule is None:
        return {n: 1.0 for n in names}
    try:
        return {n: float(w) for n, w in schedule.weights(0).items() if n in names}
    except Exception:  # noqa: BLE001 - a schedule that needs feedback first: weigh equally
        return {n: 1.0 for n in names}


def _profiles(sources: list, journal_dir) -> dict:
    """Every source's profile (journaled); the memory the profiling decoded here is given back."""
    profiles = profile_sources(sources, ProfileJournal(journal_dir))
    try:                                    # profiling decoded a row group per source here: give it back
        import pyarrow as pa
        pa.default_memory_pool().release_unused()
    except Exception:  # noqa: BLE001
        pass
    return profiles


def auto_placement(sources: list, strategy: Callable, mesh, global_batch: int, seed: int, constructors: int, *,
                   cores: int, shadows: bool = False, checkpoint_dir: str | None = None,
                   buffer_size: Any = None, journal_dir: str | os.PathLike | None = None,
                   thread_cores: int | None = None) -> Placement:
    """Profile ``sources`` (Source objects; their journal entries when the files and transform are
    unchanged) and partition them: see :func:`~.partition.auto_partition`. ``cores``: what the roles
    may use (the trainer's core already taken off); ``thread_cores``: what their threads can run on."""
    t0 = time.perf_counter()
    profiles = _profiles(sources, journal_dir or default_journal_dir(checkpoint_dir))
    names = [s.name for s in sources]
    buffer = buffer_size if isinstance(buffer_size, int) else None
    placement = auto_partition({n: profiles[n] for n in names}, _weights(strategy, mesh, names, global_batch, seed),
                               cores=max(1, cores), memory_bytes=memory_budget(), constructors=constructors,
                               global_batch=global_batch, buffer_size=buffer, shadows=shadows,
                               thread_cores=thread_cores)
    log.info("placement by measured cost in %.2f s:\n%s", time.perf_counter() - t0, placement.render())
    return placement


def chain_workers(sources: list, strategy: Callable, mesh, global_batch: int, seed: int, *, thread_cores: int,
                  checkpoint_dir: str | None = None, journal_dir: str | os.PathLike | None = None,
                  w_actor: int = 4) -> dict[str, int]:
    """Transform workers per source for ``n_workers=`` round robin (one actor per source, placed by
    hand): the measured :func:`~.partition.chain_threads` of each source on ``thread_cores`` cores, so
    that a source with most of the loaders' CPU does not run its transforms one at a time."""
    profiles = _profiles(sources, journal_dir or default_journal_dir(checkpoint_dir))
    names = [s.name for s in sources]
    weight = normalise_weights(names, _weights(strategy, mesh, names, global_batch, seed), [])
    share = demand_shares({n: profiles[n] for n in names}, weight)
    return chain_threads(share, thread_cores, w_actor)


def actor_processes(placement: Placement, shadow_keys: bool) -> dict[str, int]:
    """Actor name -> process index: the Planner, each source's loader parts, the constructors and (with
    ``shadow_keys``) a shadow per loader part, never on that part's process when another exists."""
    where = {PLANNER: placement.planner}
    where.update({constructor_actor(c): p for c, p in enumerate(placement.constructors)})
    n = placement.processes
    for s, sp in placement.sources.items():
        for j, p in enumerate(sp.processes):
            key = part_key(s, j, sp.actors)
            where[loader_actor(key)] = p
            if shadow_keys:
                shadow = placement.shadows.get(s, (p + 1) % n)
                where[shadow_actor(key)] = (p + 1) % n if shadow == p and n > 1 else shadow
    return where
