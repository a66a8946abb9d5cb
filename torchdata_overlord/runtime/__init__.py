"""Runtimes: where the roles run. ``local``: every role in the caller's process (embedded)."""

from .local import LocalJob, SourceExhausted

__all__ = ["LocalJob", "SourceExhausted"]
