"""Every mesh rank has a client: checked against the torch.distributed world before the first step.

A plan hands each mesh rank its part of the step; a rank that no trainer process asks for takes
its part nowhere, silently (``torchrun --nproc_per_node 2`` with a ``dp=2, cp=2`` mesh feeds DP
group 0 and drops DP group 1). Where the world is known, that is a ``ConfigError`` naming the
mesh, the world size and the ranks left without a client.
"""

from __future__ import annotations

from typing import Iterable

from ..errors import ConfigError
from ..plane.place_tree import ClientPlaceTree

__all__ = ["check_clients_cover_mesh", "uncovered"]


def uncovered(mesh_size: int, asked: Iterable[int | None]) -> list[int]:
    """Mesh ranks no client asks for; a client's ``None`` asks for every rank."""
    asked = list(asked)
    if any(a is None for a in asked):
        return []
    return sorted(set(range(mesh_size)) - set(asked))


def check_clients_cover_mesh(mesh: ClientPlaceTree, rank: int | None, group=None) -> None:
    """Refuse a mesh with ranks no trainer process will ask for (nothing to check without an
    initialised ``torch.distributed``).

    With ``group=`` (the rpc runtime's trainer group, ``"default"`` or a process group) every process
    of the group is a client: the ranks they ask for are gathered over it (a collective: every
    process of the group makes its loader, as it must anyway). Otherwise each process of the
    default world runs its own loader for ``rank``; ``rank=None`` asks for every rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    if group is not None:
        pg = None if group in (True, "default") else group
        world = dist.get_world_size(pg)
        asked: list = [None] * world
        dist.all_gather_object(asked, rank, group=pg)
        missing = uncovered(mesh.world_size, asked)
        who, how = f"the trainer group (group={group!r}) has {world} processes", f"they ask for ranks {asked}"
    else:
        world = dist.get_world_size()
        if rank is None or world >= mesh.world_size:
            return
        missing, who = list(range(world, mesh.world_size)), f"the torch.distributed world has {world} processes"
        how = "one loader per process at rank=dist.get_rank()"
    if missing:
        shown = missing if len(missing) <= 16 else f"{missing[:16]} and {len(missing) - 16} more"
        raise ConfigError(f"the mesh {mesh.describe()} has {mesh.world_size} ranks but {who}: mesh rank(s) "
                          f"{shown} have no client ({how}), their samples would reach no one. Give the loader the "
                          f"trainer's own mesh (its sizes multiply to the number of trainer processes) or one "
                          f"loader per mesh rank")
