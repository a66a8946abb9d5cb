"""The roles of paper section 3: Planner (here), Source Loader and Data Constructor (next)."""

from .planner import Planner

__all__ = ["Planner"]
