"""NodeSource: any stateful ``torchdata.nodes.BaseNode`` as a source (WebDataset shards, a Hugging
Face dataset, a generator: whatever the user's node reads), resumable exactly through the node's own
``state_dict()``/``reset(state)``."""

from __future__ import annotations

from typing import Any, Callable

from torchdata.nodes import BaseNode

from ..errors import ConfigError
from .base import SKIPPED, SourceReadError
from .skip_log import SkipLog

__all__ = ["NodeSource"]


class NodeSource:
    """``NodeSource(name, node, transform=None)``: the items of ``node`` as one source's rows.

    ``node`` is a :class:`torchdata.nodes.BaseNode` or a zero-argument callable returning one (a
    *factory*). The rpc runtime builds the source again in a role process, so it needs a factory it
    can pickle (a module-level function or class); a node instance works in ``runtime="local"``.
    A row's index is its position in the node's stream (0, 1, 2, ...); the state is the node's state
    plus that count. ``transform(item)`` makes the sample; with ``on_error="skip"`` a failing
    transform skips the item (counted in ``skips``, like :class:`~torchdata_overlord.ParquetSource`),
    and ``max_skips_in_a_row`` consecutive skips end the stream with an error instead of reading
    forever. An error of the node itself always raises: its position after a failure is unknown.
    """

    def __init__(self, name: str, node: BaseNode | Callable[[], BaseNode], transform: Callable | None = None,
                 on_error: str = "raise", skip_log_interval: float = 60.0, max_skips_in_a_row: int = 10_000):
        if on_error not in ("raise", "skip"):
            raise ConfigError(f"source {name!r}: on_error must be 'raise' or 'skip', got {on_error!r}")
        self._factory = None if isinstance(node, BaseNode) else node
        if self._factory is not None:
            if not callable(node):
                raise ConfigError(f"source {name!r}: node must be a torchdata.nodes.BaseNode or a zero-argument "
                                  f"callable returning one, got {type(node).__name__}")
            node = node()
            if not isinstance(node, BaseNode):
                raise ConfigError(f"source {name!r}: the node factory {self._factory!r} returned a "
                                  f"{type(node).__name__}, not a torchdata.nodes.BaseNode")
        self.name, self.node, self.transform, self.on_error = name, node, transform, on_error
        self.skips = SkipLog(name, skip_log_interval)
        self.skip_log_interval, self.max_skips_in_a_row = self.skips.interval, int(max_skips_in_a_row)
        self.epoch = 0                      # a node is one stream: its own epochs are inside it
        self.node.reset()
        self.rows_passed = 0

    def state_dict(self) -> dict:
        """The node's state and the number of items read (plain types if the node's state is)."""
        return {"node": self.node.state_dict(), "count": self.rows_passed}

    def load_state_dict(self, state: dict) -> None:
        try:
            node_state, count = state["node"], state["count"]
        except (KeyError, TypeError) as e:
            raise ConfigError(f"source {self.name!r}: not a NodeSource state (need node, count): {state!r:.200}") from e
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ConfigError(f"source {self.name!r}: state count must be an int >= 0, got {count!r}")
        self.node.reset(node_state)
        self.rows_passed = count

    def __iter__(self) -> "NodeSource":
        return self

    def __next__(self) -> tuple[int, Any]:
        """``(index, sample)``, past skipped items (the stream use; a Source Loader uses next_raw/apply)."""
        since = self.rows_passed
        while True:
            index, item, where = self.next_raw()
            out = self.apply(item, where)
            if out is not SKIPPED:
                return index, out
            self.check_progress(since)

    def next_raw(self) -> tuple[int, Any, int]:
        """``(index, item, index)``: the node's next item; StopIteration when the node ends."""
        try:
            item = next(self.node)
        except StopIteration:
            raise
        except Exception as e:      # noqa: BLE001 - any error of the user's node: name the source and row
            raise SourceReadError(f"source {self.name!r}: its node {type(self.node).__name__} failed on item "
                                  f"{self.rows_passed}: {type(e).__name__}: {e}") from e
        index = self.rows_passed
        self.rows_passed += 1
        return index, item, index

    def apply(self, item: Any, where: int):
        """``transform(item)`` under this source's error policy: the sample, or ``SKIPPED``."""
        if self.transform is None:
            return item
        try:
            return self.transform(item)
        except Exception as e:      # noqa: BLE001 - any user error: wrap with the item's index
            if self.on_error == "raise":
                raise SourceReadError(f"source {self.name!r}: transform failed on item {where}: "
                                      f"{type(e).__name__}: {e}. Fix the transform or pass on_error='skip'.") from e
            self.skip_sample(where, e)
            return SKIPPED

    def skip_sample(self, where: int, error: BaseException) -> None:
        """Count and log item ``where`` as skipped for ``error`` (on_error="skip"), as :meth:`apply` does when
        the transform fails on it (a Source Loader skips this way an item whose sample it cannot use)."""
        self.skips.add(f"<{self.name} node>", where, f"{type(error).__name__}: {error}", self.epoch)

    def check_progress(self, since: int) -> None:
        n = self.rows_passed - since
        if n >= self.max_skips_in_a_row:
            raise SourceReadError(f"source {self.name!r}: {n} items in a row were skipped (on_error='skip'; latest: "
                                  f"{self.skips.latest}); fix the transform, or raise max_skips_in_a_row")

    def spec_args(self) -> tuple[Any, Any, dict]:
        if self._factory is None:
            raise ConfigError(f"source {self.name!r}: runtime='rpc' builds each source again in a role process, so "
                              f"NodeSource needs a factory: pass a module-level function (or class) that returns the "
                              f"node, e.g. NodeSource({self.name!r}, make_node), not a node instance")
        return self._factory, self.transform, {"on_error": self.on_error, "skip_log_interval": self.skip_log_interval,
                                               "max_skips_in_a_row": self.max_skips_in_a_row}

    @property
    def buffer_bytes(self) -> int:
        return 0

    @property
    def skipped(self) -> list[dict]:
        return self.skips.entries

    def close(self) -> None:
        self.skips.flush()

    def __repr__(self) -> str:
        return f"NodeSource({self.name!r}, {type(self.node).__name__}, items read={self.rows_passed})"
