"""Source auto-partitioning (paper section 5.1): profile every source (:mod:`.profile`, kept between
runs by :mod:`.journal`), then decide its actors, workers and role processes (:mod:`.partition`,
whose result is a :class:`~.placement.Placement`)."""

from .auto import auto_placement
from .autoscaler import AutoScaler
from .journal import ProfileJournal, default_journal_dir
from .partition import auto_partition
from .placement import Placement, SourcePlacement
from .profile import SourceProfile, profile_source, profile_sources

__all__ = ["SourceProfile", "profile_source", "profile_sources", "ProfileJournal", "default_journal_dir",
           "SourcePlacement", "Placement", "auto_partition", "auto_placement", "AutoScaler"]
