"""What a source gives a Source Loader: the :class:`Source` protocol, shared by every source type.

A Source Loader (:class:`~torchdata_overlord.roles.source_loader.SourceLoader`) reads raw rows one
by one (``next_raw``), transforms them on its worker pool (``apply``) and checkpoints the source's
position (``state_dict``/``load_state_dict``), never the samples. The rpc runtime rebuilds a source
in another process from its :class:`~torchdata_overlord.runtime.job_config.SourceSpec`: its class,
its constructor arguments (``spec_args``) and its state. Implementations:
:class:`~torchdata_overlord.ParquetSource`, :class:`~torchdata_overlord.FileSource` (JSON Lines,
CSV, Arrow IPC) and :class:`~torchdata_overlord.NodeSource` (any stateful ``torchdata.nodes`` node).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from ..errors import OverlordError

__all__ = ["Source", "SourceReadError", "SKIPPED"]

SKIPPED = object()  # what apply() returns for a sample skipped under on_error="skip"


def positions(source) -> tuple:
    """``(position, state_at)`` of ``source``: its own when it has both, else ``state_dict`` and the identity
    (its states stand for its positions)."""
    if hasattr(source, "position") and hasattr(source, "state_at"):
        return source.position, source.state_at
    return source.state_dict, _as_is


def _as_is(state):
    return state


class SourceReadError(OverlordError, RuntimeError):
    """Reading a source or transforming one of its samples failed during iteration (on_error="raise")."""


@runtime_checkable
class Source(Protocol):
    """A resumable stream of raw rows and the transform that makes them samples.

    * ``name``: the source's name (the mixture's key); ``epoch``: the pass over the data (0 for an
      endless stream); ``rows_passed``: rows read or skipped so far;
    * ``next_raw() -> (index, row, where)``: the next raw row; ``index`` is unique over the whole run
      (a row seen again in a later epoch gets another index), ``where`` locates it for error messages
      and :meth:`apply`; raises ``StopIteration`` at the end;
    * ``apply(row, where)``: the sample, or :data:`SKIPPED` (skipped under the source's error policy);
    * ``check_progress(since)``: raise :class:`SourceReadError` if every row since ``rows_passed`` was
      ``since`` was skipped and skipping on could never yield a sample;
    * ``state_dict()`` / ``load_state_dict(state)``: the exact position, plain Python types only;
    * optionally ``position()`` / ``state_at(position)``: the position as a small immutable value, and
      the ``state_dict()`` it stands for. A Source Loader keeps where the source stood before every
      buffered row; with these it keeps positions and makes a state only for a checkpoint;
    * ``spec_args() -> (data, transform, kwargs)``: how to build it again elsewhere
      (``type(source)(name, data, transform, **kwargs)``), all picklable;
    * optionally ``on_error`` (``"raise"`` or ``"skip"``) and ``skip_sample(where, error)``: count and log the row
      at ``where`` as skipped, as ``apply`` does for a failing transform under ``"skip"``; a Source Loader
      skips this way a row whose sample it cannot use (text holding the image placeholder), and raises
      for it where the source has neither;
    * optionally ``skips`` (a :class:`~torchdata_overlord.sources.skip_log.SkipLog`): what ``stats()``
      reports as the source's skips; a source without one reports none (zeros);
    * ``buffer_bytes`` (bytes the source itself holds) and ``close()``.

    The members marked optional are not declared below, so ``isinstance(source, Source)`` checks only the
    required ones, and a source that passes it works in both runtimes.
    """

    name: str
    epoch: int
    rows_passed: int

    def next_raw(self) -> tuple[int, Any, Any]: ...

    def apply(self, row: Any, where: Any) -> Any: ...

    def check_progress(self, since: int) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def spec_args(self) -> tuple[Any, Any, dict]: ...

    @property
    def buffer_bytes(self) -> int: ...

    def close(self) -> None: ...
