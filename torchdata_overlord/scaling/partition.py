"""Offline source auto-partitioning (paper 5.1): from every source's profile and mixing weight, its
data-parallel actors and their workers, and the role processes that host them, under the cores and
memory of the loading nodes.

The CPU model: a sample of source ``k`` costs its loader ``P_k + read_k`` CPU seconds and the mixture
draws it with weight ``w_k``, so at any step rate the source needs CPU in proportion to ``w_k`` times that
cost, its *demand*. The loaders' cores are split into worker blocks of one core (a busy transform thread),
in proportion to demand. The loaders' cores are what the Planner and the constructors leave, whose shares
are estimates, not measurements: :data:`PLANNER_CORES`, and per constructor :data:`CONSTRUCTOR_CORES`
plus one core per :data:`SAMPLES_PER_CONSTRUCTOR_CORE` samples of its share of the global batch.

Clusters (the paper's groups of ``cluster_size`` sources by descending cost) name each source's resource
level, the ratio of its cluster's mean cost to the lightest cluster's; the blocks follow each source's
own cost, not its cluster's mean: with few sources a cluster mixes a 0.3 ms text source with a 20 ms
video source, and the mean would give the text source the video source's workers.
"""

from __future__ import annotations

import math
from typing import Mapping

from ..errors import ConfigError
from .placement import PROCESS_BYTES, Placement, SourcePlacement, plural
from .profile import SourceProfile

__all__ = ["auto_partition", "chain_threads", "PLANNER_CORES", "CONSTRUCTOR_CORES", "SAMPLES_PER_CONSTRUCTOR_CORE",
           "MIN_LOADER_CORES", "WORKER_CORES", "PROFILE_NOISE"]

PLANNER_CORES = 0.25                 # planning a step is metadata work: a fraction of one core
CONSTRUCTOR_CORES = 0.05             # a constructor's threads between steps (requests, commits)
SAMPLES_PER_CONSTRUCTOR_CORE = 2048  # packing and padding a step's samples: a guess, 1/2048 core per sample
MIN_LOADER_CORES = 0.5               # the loaders' budget when the other roles seem to take every core
WORKER_CORES = 1.0                   # a worker block: one transform thread kept busy
PROFILE_NOISE = 0.2                  # a profile's share moves this much between runs (one source: 48-57%)


def auto_partition(profiles: Mapping[str, SourceProfile], weights: Mapping[str, float], *, cores: float,
                   memory_bytes: int | None, constructors: int, global_batch: int, buffer_size: int | None = None,
                   w_src: int = 8, w_actor: int = 4, cluster_size: int = 4, shadows: bool = False,
                   max_processes: int | None = None, thread_cores: int | None = None) -> Placement:
    """The placement of ``profiles`` (in the job's source order) on ``cores`` cores and ``memory_bytes``
    bytes (None: unlimited). A budget that cannot be met is reported in the notes, never raised: the
    placement is advice. Same inputs, same placement. ``thread_cores``: the cores the roles' threads can
    run on (the machine's), which gives a source the :func:`chain_threads` it needs beyond its share of
    the budget (None: the budget alone)."""
    names = list(profiles)
    _check(names, cores, memory_bytes, constructors, global_batch, buffer_size, w_src, w_actor, cluster_size,
           max_processes)
    if thread_cores is not None and (isinstance(thread_cores, bool) or not isinstance(thread_cores, int)
                                     or thread_cores < 1):
        raise ConfigError(f"thread_cores must be None or an integer >= 1, got {thread_cores!r}")
    notes: list[str] = []
    weight = normalise_weights(names, weights, notes)

    # (1) source clustering: by cost, heaviest first, cluster_size sources per cluster
    order = sorted(names, key=lambda n: (-profiles[n].cost_s, names.index(n)))
    cluster = {n: rank // cluster_size for rank, n in enumerate(order)}
    members = [order[g:g + cluster_size] for g in range(0, len(order), cluster_size)]
    level = [sum(profiles[n].cost_s for n in m) / len(m) for m in members]

    # (2) resource levels: the loaders' cores in worker blocks by demand, then actors x workers per source
    constructor_cores = CONSTRUCTOR_CORES + global_batch / constructors / SAMPLES_PER_CONSTRUCTOR_CORE
    loader_cores = cores - PLANNER_CORES - constructors * constructor_cores
    if loader_cores < MIN_LOADER_CORES:
        notes.append(f"cpu: the planner and {constructors} constructors seem to take {cores - loader_cores:.2f} of "
                     f"{cores:g} cores; the loaders are given {MIN_LOADER_CORES:g} anyway")
        loader_cores = MIN_LOADER_CORES
    share = demand_shares(profiles, weight)
    blocks = _largest_remainder(int(loader_cores // WORKER_CORES), share, order)
    wanted = {n: min(blocks[n], w_src) for n in names}
    limit = {n: min(profiles[n].units if profiles[n].splittable else 1, global_batch) for n in names}
    planned = {n: _shape(wanted[n], limit[n], w_actor)[0] for n in names}

    # (3) configuration: fewer actors where memory does not hold them (largest row groups first), then
    # fewer processes; shadows are idle until promoted (then they replace their primary): no CPU, and no
    # process of their own unless every role is in one (see (4))
    buffer = buffer_size or global_batch
    actor_bytes = {n: profiles[n].group_bytes + buffer * profiles[n].sample_bytes for n in names}
    cap = min(max_processes or max(1, int(cores)), 1 + constructors + sum(planned.values()))

    def processes(actors: dict) -> int:
        return max(1, min(cap, 1 + constructors + sum(actors.values())))

    def memory(actors: dict) -> int:
        return sum(actors[n] * actor_bytes[n] for n in names) + processes(actors) * PROCESS_BYTES

    actors = dict(planned)
    if memory_bytes is not None and memory(actors) > memory_bytes:
        for n in sorted(names, key=lambda n: (-profiles[n].group_bytes, -actor_bytes[n], names.index(n))):
            while actors[n] > 1 and memory(actors) > memory_bytes:
                actors[n] -= 1
        cut = [f"{n} {planned[n]} -> {actors[n]}" for n in names if actors[n] < planned[n]]
        if cut:
            notes.append(f"memory: fewer actors for the largest row groups ({', '.join(cut)}) to fit {_mib(memory_bytes)}")
        packed = processes(actors)
        while cap > 1 and memory(actors) > memory_bytes:
            cap -= 1
        if processes(actors) < packed:
            notes.append(f"memory: {packed} -> {processes(actors)} processes (~{_mib(PROCESS_BYTES)} each) to fit "
                         f"{_mib(memory_bytes)}")
        if memory(actors) > memory_bytes:
            notes.append(f"memory: even one actor per source in one process needs ~{_mib(memory(actors))}, over "
                         f"the budget of {_mib(memory_bytes)}: give the loaders more memory or use smaller row groups")
    shape = {n: _shape(wanted[n], actors[n], w_actor) for n in names}
    actors = {n: shape[n][0] for n in names}

    # (4) processes: every actor by estimated CPU, the largest first onto the least loaded process
    cpu = {n: min(share[n] * loader_cores, actors[n] * max(1, shape[n][1])) / actors[n] for n in names}
    # threads that keep a heavy source's own transforms from pacing the step: more per actor, the
    # placement and the CPU estimates above unchanged
    chain = chain_threads(share, thread_cores, w_src) if thread_cores else {}
    paced = [n for n in chain if chain[n] > actors[n] * max(1, shape[n][1])]
    for n in paced:
        shape[n] = (actors[n], min(w_actor, -(-chain[n] // actors[n]), max(1, w_src // actors[n])))
    n_proc = processes(actors)
    where, load = _pack([(PLANNER_CORES, 0, ("planner",))]
                        + [(cpu[n], actor_bytes[n], ("loader", n, j)) for n in names for j in range(actors[n])]
                        + [(constructor_cores, 0, ("constructor", c)) for c in range(constructors)], n_proc)
    # a shadow is idle until promoted: spread them, never on the primary's process. With every role in
    # one process, the shadows get a standby process of their own (idle: no CPU in the budget, ~40 MiB):
    # a shadow beside its primary dies with it, protecting against nothing
    spare_process = shadows and n_proc == 1 and max_processes != 1
    if spare_process:
        n_proc += 1
        load.append(0.0)
        notes.append("shadows: every role is in one process, so the shadows get a standby process of their own")
        if memory_bytes is not None and memory(actors) <= memory_bytes < memory(actors) + PROCESS_BYTES:
            notes.append(f"memory: the shadows' standby process (~{_mib(PROCESS_BYTES)}) goes over the budget of "
                         f"{_mib(memory_bytes)}")
    elif shadows and n_proc == 1:
        notes.append("shadows: max_processes=1 puts each shadow in its primary's process; a process death takes "
                     "both (the loader is then restored from the checkpoint on a spare)")
    shadow_at, standby = {}, [0] * n_proc
    for n in names if shadows else []:
        mine = {where["loader", n, j] for j in range(actors[n])}
        avoid = mine if len(mine) < n_proc else {where["loader", n, 0]} if n_proc > 1 else set()
        p = min((p for p in range(n_proc) if p not in avoid), key=lambda p: (standby[p], load[p], p))
        standby[p] += 1
        shadow_at[n] = p

    placed = {}
    for n in names:
        a, w = shape[n]
        why = [f"demand {share[n]:.0%} of loader CPU"]
        if n in paced:
            why.append(f"{plural(a * w, 'worker')} so that its own transforms do not pace the step on "
                       f"{thread_cores} cores")
        if blocks[n] > w_src:
            why.append(f"capped at w_src={w_src}")
        if a < planned[n]:
            why.append(f"{planned[n]} actors cut to {a} for memory")
        elif wanted[n] > w_actor * a:
            why.append("not splittable" if not profiles[n].splittable
                       else f"actors bounded by {profiles[n].units} row groups / global batch {global_batch}")
        placed[n] = SourcePlacement(n, a, w, tuple(where["loader", n, j] for j in range(a)), cluster[n],
                                    _reason(profiles[n], cluster[n], level, a, w, why),
                                    profiles[n].transform_s, profiles[n].group_bytes, cpu[n], actor_bytes[n])
    budget = {"cores": cores, "memory_bytes": memory_bytes, "planner_cores": PLANNER_CORES,
              "constructor_cores": constructor_cores, "loader_cores": loader_cores,
              "cpu": PLANNER_CORES + constructors * constructor_cores + sum(a * cpu[n] for n, a in actors.items()),
              "memory": memory(actors) + spare_process * PROCESS_BYTES, "workers": sum(a * shape[n][1] for n, a in actors.items()),
              "global_batch": global_batch, "buffer_size": buffer_size, "w_src": w_src, "w_actor": w_actor,
              "cluster_size": cluster_size, "max_processes": max_processes, "thread_cores": thread_cores}
    return Placement(placed, n_proc, where[("planner",)], tuple(where["constructor", c] for c in range(constructors)),
                     shadow_at, budget, "auto", tuple(notes), {n: profiles[n].to_dict() for n in names})


def demand_shares(profiles: Mapping[str, SourceProfile], weight: Mapping[str, float]) -> dict[str, float]:
    """Each source's share of the loaders' CPU: its (normalised) weight times its cost per sample."""
    demand = {n: weight[n] * p.cost_s for n, p in profiles.items()}
    total = sum(demand.values())
    return {n: d / total if total > 0 else 0.0 for n, d in demand.items()}


def chain_threads(share: Mapping[str, float], cores: int, cap: int) -> dict[str, int]:
    """Transform threads per source (0: inline, on the actor's thread) so that no source's own chain of
    transforms paces a step: the loaders' work of a step takes at least ``total / cores`` on ``cores``
    cores, and a source with ``k`` threads at least ``share * total / k``, so ``k >= share * cores``
    (never more than ``cores``, which always suffice, nor ``cap``). The worker blocks above follow the CPU budget; this follows the cores a
    transform that releases the GIL (a tokenizer, an image decoder) can run on: on 2 cores, one source
    with 52-57% of the loaders' CPU on one thread held the rpc runtime (``n_workers=2``) to 0.8x of its
    speed with two. The share is a timing, measured once (its profile journaled), and moves by
    :data:`PROFILE_NOISE` between runs: it is rounded up by that much, since a thread too many only
    time-slices while one too few paces every step."""
    out = {}
    for n, s in share.items():
        k = min(math.ceil(s * cores * (1 + PROFILE_NOISE) - 1e-9), cores, cap)   # (cores threads always do)
        out[n] = k if k > 1 else 0
    return out


def _pack(items: list, n: int) -> tuple[dict, list]:
    """Longest processing time first: each ``(cores, bytes, actor)``, the most cores first (ties: more
    bytes, then the given order), onto the process with the least (cores, bytes, actors) so far.
    Returns actor -> process and each process's cores."""
    load = [(0.0, 0, 0)] * n
    where = {}
    for cores, bytes_, actor in sorted(items, key=lambda it: (-it[0], -it[1])):     # stable sort
        p = min(range(n), key=lambda p: (*load[p], p))
        load[p] = (load[p][0] + cores, load[p][1] + bytes_, load[p][2] + 1)
        where[actor] = p
    return where, [c for c, _, _ in load]


def _shape(n: int, max_actors: int, w_actor: int) -> tuple[int, int]:
    """(actors, workers per actor) with the most workers in all, at most ``n``, and the fewest actors
    for that: ``n`` workers fit one actor up to ``w_actor``, more take data-parallel actors. No
    worker block: one actor, transform inline."""
    if n < 1:
        return 1, 0
    best = (0, 1, 0)
    for a in range(1, min(n, max_actors) + 1):
        b = min(w_actor, n // a)
        if a * b > best[0]:
            best = (a * b, a, b)
    return best[1], best[2]


def _largest_remainder(blocks: int, share: dict, order: list) -> dict:
    """``blocks`` whole blocks in proportion to ``share``: floors, then one more for the largest
    remainders (ties: ``order``, heaviest source first)."""
    quota = {n: blocks * share[n] for n in order}
    out = {n: math.floor(q) for n, q in quota.items()}
    left = blocks - sum(out.values())
    for n in sorted(order, key=lambda n: -(quota[n] - out[n]))[:max(left, 0)]:
        if quota[n] > out[n]:
            out[n] += 1
    return out


def _reason(p: SourceProfile, g: int, level: list, actors: int, workers: int, why: list) -> str:
    """One line: the cluster and its level (the ratio of cluster mean costs), the shape, and why."""
    if len(level) == 1:
        rank = "the only cluster"
    elif g == 0:
        rank = "heaviest"
    elif g == len(level) - 1:
        rank = "lightest"
    else:
        rank = f"{level[g] / level[-1]:.3g}x the lightest" if level[-1] > 0 else "lighter"
    run = f"{plural(actors, 'actor')} x {plural(workers, 'worker')}" if workers else "1 actor, inline"
    return f"cluster {g} (P={p.transform_s * 1e3:.3g} ms, {rank}): {run}, " + ", ".join(why)


def normalise_weights(names: list, weights: Mapping[str, float], notes: list) -> dict:
    """Mixing weights normalised to sum 1; a source without one weighs 0; all 0 -> equal weights."""
    if not isinstance(weights, Mapping):
        raise ConfigError(f"weights must map source names to weights ({{source: weight}}), got {weights!r:.200}")
    unknown = set(weights) - set(names)
    if unknown:
        raise ConfigError(f"weights name unknown sources {sorted(unknown)}; sources are {names}")
    w = {n: float(weights.get(n, 0.0)) for n in names}
    if not all(math.isfinite(v) and v >= 0 for v in w.values()):
        raise ConfigError(f"weights must be finite and >= 0, got {dict(weights)}")
    total = sum(w.values())
    if total == 0:
        notes.append("weights: all 0, sources weighed equally")
        return {n: 1 / len(names) for n in names}
    return {n: v / total for n, v in w.items()}


def _check(names, cores, memory_bytes, constructors, global_batch, buffer_size, w_src, w_actor, cluster_size,
           max_processes) -> None:
    if not names:
        raise ConfigError("auto_partition needs at least one source profile")
    if isinstance(cores, bool) or not (isinstance(cores, (int, float)) and math.isfinite(cores) and cores > 0):
        raise ConfigError(f"cores must be a finite number > 0, got {cores!r}")
    for label, v, low in (("constructors", constructors, 1), ("global_batch", global_batch, 1), ("w_src", w_src, 1),
                          ("w_actor", w_actor, 1), ("cluster_size", cluster_size, 1),
                          ("memory_bytes", memory_bytes, 0), ("buffer_size", buffer_size, 1),
                          ("max_processes", max_processes, 1)):
        if v is None and label in ("memory_bytes", "buffer_size", "max_processes"):
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ConfigError(f"{label} must be an integer >= {low}, got {v!r}")


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"
