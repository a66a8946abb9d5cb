"""Environment switches of the rpc runtime (``OVERLORD_RPC_LANE``, ``OVERLORD_RPC_SHM``,
``OVERLORD_READ_AHEAD``): each is on unless set to 0, false, no or off."""

from __future__ import annotations

import os

__all__ = ["env_on"]


def env_on(name: str) -> bool:
    """Whether switch ``name`` is on in this process's environment (on when unset)."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")
