"""A mesh larger than the trainer world is refused before the first step, not silently half-fed.

Two trainer processes in a real gloo group on loopback (as ``torchrun --nproc_per_node 2`` makes
them) give a ``dp=2, cp=2`` mesh ``rank=dist.get_rank()``: ranks 2 and 3 (DP group 1) have no
process. Both runtimes must say so, naming the mesh, the world size and the missing ranks, and the
rpc runtime before it starts a role process. A mesh that fits the world still runs.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import torchdata_overlord as ol
from torchdata_overlord.runtime.coverage import uncovered

from test_rpc_group import _spawn_group

WORLD = 2


class Ids:
    """A row's ``n`` as a short sequence of token ids."""

    columns = ["n"]

    def __call__(self, row):
        return {"input_ids": torch.arange(row["n"] % 5 + 1)}


def dp_strategy(g):
    return g.mix({"s": 1.0}).distribute("DP").cost(ol.token_count).balance("greedy", microbatches=1).plan()


def _trainer(rank: int, data: str, out_dir: str) -> None:
    import multiprocessing

    import torch.distributed as dist

    from torchdata_overlord.runtime.coverage import check_clients_cover_mesh

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/pg", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    out = {}

    def attempt(key, mesh, **kw):
        try:
            with ol.OverlordLoader([ol.ParquetSource("s", data, Ids())], dp_strategy, mesh, rank=dist.get_rank(),
                                   global_batch=4, seq_len=None, prefetch=0, **kw) as loader:
                out[key] = [len(mb["input_ids"]) for mb in next(loader)["microbatches"]]
        except ol.ConfigError as e:
            out[key] = f"ConfigError: {e}"
        out[key + ":children"] = len(multiprocessing.active_children())

    too_big = ol.ClientPlaceTree(dp=2, cp=2)
    attempt("local", too_big)
    attempt("rpc group", too_big, runtime="rpc", group="default", n_workers=1)
    attempt("fits", ol.ClientPlaceTree(dp=2))
    # the group check sees what each process asks for: another mapping, or rank=None (every rank), covers it
    for key, ranks in (("swapped", [1, 0]), ("one asks all", [None, 1]), ("both ask 0", [0, 0])):
        try:
            check_clients_cover_mesh(ol.ClientPlaceTree(dp=2), ranks[rank], group="default")
            out[key] = "ok"
        except ol.ConfigError as e:
            out[key] = f"ConfigError: {e}"
    dist.destroy_process_group()
    with open(f"{out_dir}/out-{rank}.json", "w") as f:
        json.dump(out, f)


@pytest.mark.slow
def test_mesh_larger_than_the_world_is_refused_naming_the_missing_ranks(tmp_path):
    pq.write_table(pa.table({"n": list(range(40))}), tmp_path / "s.parquet")
    _spawn_group(_trainer, (str(tmp_path / "s.parquet"), str(tmp_path)), WORLD, timeout=180)
    got = [json.loads((tmp_path / f"out-{r}.json").read_text()) for r in range(WORLD)]
    for out in got:
        for key in ("local", "rpc group"):
            msg = out[key]
            assert msg.startswith("ConfigError: the mesh pp=1 x dp=2 x cp=2 x tp=1 has 4 ranks but the "), msg
            assert "has 2 processes: mesh rank(s) [2, 3] have no client" in msg
            assert out[key + ":children"] == 0                 # refused before any role process started
        assert "the trainer group (group='default') has 2 processes" in out["rpc group"]
        assert "they ask for ranks [0, 1]" in out["rpc group"]
        assert out["swapped"] == out["one asks all"] == "ok"
        assert "mesh rank(s) [1] have no client (they ask for ranks [0, 0])" in out["both ask 0"]
    # the mesh that fits: each process gets its own DP group's part of the step
    assert all(isinstance(out["fits"], list) and sum(out["fits"]) > 0 for out in got)


@settings(max_examples=100, deadline=None)
@given(n=st.integers(1, 64), asked=st.lists(st.one_of(st.none(), st.integers(0, 63)), max_size=70))
def test_uncovered_ranks_are_those_no_client_asks_for(n, asked):
    asked = [a if a is None else a % n for a in asked]
    got = uncovered(n, asked)
    if None in asked:
        assert got == []
    else:
        assert got == [r for r in range(n) if r not in asked]
