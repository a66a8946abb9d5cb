"""Trainer ranks as separate processes (a gloo group) joining one rpc job as clients.

Eight trainer processes (mesh dp=1, cp=2, tp=2, pp=2) each create ``OverlordLoader(runtime="rpc",
group="default", rank=r)``: group rank 0 starts the role workers, every rank fetches only its own
part. Each rank's batches must be bit-identical to what LocalJob builds for that rank, TP>0 ranks
(after ``broadcast_at("TP")``) receive no tensors, PP>0 stages receive metadata only and CP ranks their
zig-zag shards; the whole group restarted from each rank's own checkpoint continues identically.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.multiprocessing as tmp

import torchdata_overlord as ol
from torchdata_overlord.runtime.local import LocalJob
from torchdata_overlord.runtime.rpc_session import prestart_fork_server
from torchdata_overlord.sim.corpus import build_demo_corpus
from torchdata_overlord.sources import ParquetSource
from torchdata_overlord.transforms import ImageText, Tokenize
from torchdata_overlord.testing import assert_identical

from test_rpc_job import _alive

GLOBAL_BATCH, STEPS, CKPT_AFTER = 8, 3, 2
WORLD = 8


def group_strategy(g):
    return (g.mix({"web": 0.6, "caps": 0.4}).distribute("DP").cost(ol.attention_flops)
            .balance("greedy", microbatches=2, max_tokens=2048, oversize="split").broadcast_at("TP"))


def make_mesh():
    return ol.ClientPlaceTree(dp=1, cp=2, tp=2, pp=2)


def make_sources(corpus):
    return [ParquetSource("web", corpus.sources["web"], Tokenize(corpus.spm_model, field=corpus.text_fields["web"])),
            ParquetSource("caps", corpus.sources["caps"],
                          ImageText(corpus.spm_model, image_field="image", text_field="text", patch=14, max_side=112))]


def _trainer(rank: int, root: str, out_dir: str, phase: str, steps: int, resume: bool) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{out_dir}/pg-{phase}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=120))
    corpus = build_demo_corpus(root, scale="test", seed=0)
    out = {"items": [], "pid": os.getpid()}
    with ol.OverlordLoader(make_sources(corpus), group_strategy, make_mesh(), rank=rank, global_batch=GLOBAL_BATCH,
                           seq_len=None, image_token_id=corpus.image_token_id, runtime="rpc", group="default",
                           n_workers=2, prefetch=2, timeout=120) as loader:
        if resume:
            loader.load_state_dict(torch.load(f"{out_dir}/first-{rank}.pt", weights_only=False)["state"])
        for i, item in zip(range(steps), loader):
            out["items"].append(item)
            if i + 1 == CKPT_AFTER:
                out["state"] = loader.state_dict()
        stats = loader.stats()
        out["fetches"], out["roles"] = stats["client"]["fetches"], stats["roles"]
    dist.destroy_process_group()
    torch.save(out, f"{out_dir}/{phase}-{rank}.pt")


def _spawn_group(fn, args, nprocs, timeout=240):
    """Run ``fn(rank, *args)`` in ``nprocs`` new processes; bounded, nothing left running. They come from the
    rpc runtime's fork server (torch and the library imported once, as for its role processes), not from
    ``spawn`` (eight imports of torch on two cores took most of a group's start)."""
    prestart_fork_server()
    ctx = tmp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="forkserver")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1.0):
            assert time.monotonic() < deadline, f"the trainer group did not finish within {timeout} s"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


def _run_group(root, out_dir, phase, steps, resume):
    _spawn_group(_trainer, (str(root), str(out_dir), phase, steps, resume), WORLD)
    return [torch.load(f"{out_dir}/{phase}-{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_demo_corpus(tmp_path_factory.mktemp("corpus"), scale="test", seed=0)


@pytest.mark.slow
def test_trainer_ranks_in_a_gloo_group_receive_their_part(corpus, tmp_path):
    job = LocalJob(make_sources(corpus), group_strategy, make_mesh(), GLOBAL_BATCH, None,
                   image_token_id=corpus.image_token_id)
    try:
        reference = [job.step().outputs for _ in range(STEPS + 1)]
    finally:
        job.close()

    first = _run_group(corpus.root, tmp_path, "first", STEPS, resume=False)
    mesh = make_mesh()
    for r, got in enumerate(first):
        c = mesh.coords(r)
        assert [it["step"] for it in got["items"]] == list(range(STEPS))
        for k, item in enumerate(got["items"]):
            assert_identical(item["microbatches"], reference[k][r]["microbatches"])
            if c["tp"] > 0:
                assert item["delivery"] == "none" and item["microbatches"] is None
            elif c["pp"] > 0:
                assert item["delivery"] == "metadata"
                assert all("input_ids" not in mb and "position_ids" in mb for mb in item["microbatches"])
            else:
                assert item["delivery"] == "data"
                assert all(mb["cp_rank"] == c["cp"] and mb["cp_size"] == 2 for mb in item["microbatches"])
        # the lazy order: every rank asks only its Data Constructor, once a step it asks for (a TP>0
        # rank too: it learns the step's state from it, and receives no tensors); prefetch=2 may have
        # asked for up to two steps beyond those read
        assert STEPS <= got["fetches"] <= STEPS + 2, (r, got["fetches"])
    assert any(len(mb["input_ids"]) for it in first[0]["items"] for mb in it["microbatches"])
    # the roles lived in worker processes of rank 0, none in a trainer process
    role_pids = set(first[0]["roles"].values())
    assert len(role_pids) == 2 and not role_pids & {g["pid"] for g in first}
    assert not [p for p in role_pids | {g["pid"] for g in first} if _alive(p)]

    # restart the whole group from each rank's own checkpoint after step CKPT_AFTER - 1
    again = _run_group(corpus.root, tmp_path, "again", STEPS + 1 - CKPT_AFTER, resume=True)
    for r, got in enumerate(again):
        assert [it["step"] for it in got["items"]] == list(range(CKPT_AFTER, STEPS + 1))
        for item in got["items"]:
            assert_identical(item["microbatches"], reference[item["step"]][r]["microbatches"])
    assert not [p for p in set(again[0]["roles"].values()) if _alive(p)]


def _ft_trainer(rank: int, root: str, out_dir: str, steps: int, kill_at: int) -> None:
    import torch.distributed as dist

    from torchdata_overlord.runtime import faults

    dist.init_process_group("gloo", init_method=f"file://{out_dir}/pg-ft", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    corpus = build_demo_corpus(root, scale="test", seed=0)
    out = {"items": []}
    ft = ol.FaultTolerance(checkpoint_dir=f"{out_dir}/ckpt", call_timeout=10)
    with ol.OverlordLoader(make_sources(corpus), group_strategy, ol.ClientPlaceTree(dp=2), rank=rank,
                           global_batch=GLOBAL_BATCH, seq_len=None, image_token_id=corpus.image_token_id,
                           runtime="rpc", group="default", prefetch=2, spares=2, fault_tolerance=ft,
                           n_workers=7, timeout=120) as loader:     # a process per role: the kill takes the Planner only
        for i, item in zip(range(steps), loader):
            out["items"].append(item)
            if rank == 0 and i == kill_at:
                out["killed"] = faults.kill_role(loader, "planner")
        out["faults"] = loader.stats()["client"]["faults"]
    dist.destroy_process_group()
    torch.save(out, f"{out_dir}/ft-{rank}.pt")


@pytest.mark.slow
def test_every_trainer_rank_follows_a_replaced_planner(corpus, tmp_path):
    """Rank 0 (the leader) replaces a killed Planner; rank 1 learns where it is from rank 0 and both
    ranks keep receiving exactly their batches."""
    steps, kill_at = 14, 5
    job = LocalJob(make_sources(corpus), group_strategy, ol.ClientPlaceTree(dp=2), GLOBAL_BATCH, None,
                   image_token_id=corpus.image_token_id)
    try:
        reference = [job.step().outputs for _ in range(steps)]
    finally:
        job.close()
    _spawn_group(_ft_trainer, (str(corpus.root), str(tmp_path), steps, kill_at), 2)
    got = [torch.load(f"{tmp_path}/ft-{r}.pt", weights_only=False) for r in range(2)]
    for r, g in enumerate(got):
        assert [it["step"] for it in g["items"]] == list(range(steps))
        for k, item in enumerate(g["items"]):
            assert_identical(item["microbatches"], reference[k][r]["microbatches"])
    assert any(rec["how"] == "replaced the Planner" for rec in got[0]["faults"]["recoveries"])
    assert any(rec["how"] == "learned the leader's new Planner" for rec in got[1]["faults"]["recoveries"])
    assert not _alive(got[0]["killed"])


class _FailsOnRow3:
    """A transform that fails on the row numbered 3 (in every source's first buffer)."""

    columns = ["n"]

    def __call__(self, row):
        if row["n"] == 3:
            raise ValueError("a planted bad row")
        return {"input_ids": torch.arange(1, 2 + row["n"] % 5)}


def _one_source(g):
    return g.mix({"bad": 1.0}).distribute("DP").balance("greedy", microbatches=1).plan()


def _failing_start_trainer(rank: int, data: str, out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{out_dir}/pg-bad", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    out = {}
    try:
        with ol.OverlordLoader([ParquetSource("bad", data, _FailsOnRow3(), shuffle=False)], _one_source,
                               ol.ClientPlaceTree(dp=2), rank=rank, global_batch=4, seq_len=None, runtime="rpc",
                               group="default", n_workers=1, timeout=120) as loader:
            next(iter(loader))
    except Exception as e:       # noqa: BLE001 - what each rank is told
        out["error"] = (type(e).__name__, str(e))
    dist.destroy_process_group()
    torch.save(out, f"{out_dir}/bad-{rank}.pt")


@pytest.mark.slow
def test_a_start_that_fails_on_rank_0_tells_every_rank_why(tmp_path):
    """A source failing its first fill makes rank 0's loader raise; the other ranks, waiting to attach to the
    Planner, are told that error at once (before: a CallTimeout without the cause after the call timeout, and
    rank 0's close waiting that long for them to leave)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"n": list(range(40))}), tmp_path / "bad.parquet", row_group_size=10)
    _spawn_group(_failing_start_trainer, (str(tmp_path / "bad.parquet"), str(tmp_path)), 2, timeout=200)
    got = [torch.load(f"{tmp_path}/bad-{r}.pt", weights_only=False)["error"] for r in range(2)]
    assert got[0][0] == "SourceReadError" and "bad.parquet row 3" in got[0][1]
    assert got[1][0] == "JobClosed", got[1]
    assert "trainer rank 0 could not start the data plane's roles: SourceReadError" in got[1][1]
    assert "bad.parquet row 3" in got[1][1]


def _two_rank_loader(corpus, rank: int):
    """Rank ``rank``'s loader of a dp=2 job of two trainer processes, every role in one worker."""
    return ol.OverlordLoader(make_sources(corpus), group_strategy, ol.ClientPlaceTree(dp=2), rank=rank,
                             global_batch=GLOBAL_BATCH, seq_len=None, image_token_id=corpus.image_token_id,
                             runtime="rpc", group="default", n_workers=1, prefetch=2, timeout=120)


def _late_rank_trainer(rank: int, root: str, out_dir: str) -> None:
    """Rank 1 makes its loader only once rank 0 has consumed 3 steps (the Planner then stands further on)."""
    import torch.distributed as dist

    from torchdata_overlord.runtime.client import Job

    dist.init_process_group("gloo", init_method=f"file://{out_dir}/pg-late", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    flag = f"{out_dir}/rank0-consumed-3"
    if rank == 1:                 # every read of the job's state this rank makes waits for rank 0's 3 steps
        def late(read):
            def wait_then_read(self):
                deadline = time.monotonic() + 120
                while not os.path.exists(flag) and time.monotonic() < deadline:
                    time.sleep(0.05)
                return read(self)
            return wait_then_read
        for name in ("state_dict", "start_state"):
            if hasattr(Job, name):
                setattr(Job, name, late(getattr(Job, name)))
    corpus = build_demo_corpus(root, scale="test", seed=0)
    out = {"items": []}
    try:
        with _two_rank_loader(corpus, rank) as loader:
            for i, item in zip(range(6), loader):
                out["items"].append(item)
                if rank == 0 and i == 2:
                    open(flag, "w").close()
    except Exception as e:       # noqa: BLE001 - recorded for the test
        out["error"] = f"{type(e).__name__}: {e}"
    dist.destroy_process_group()
    torch.save(out, f"{out_dir}/late-{rank}.pt")


@pytest.mark.slow
def test_a_rank_that_makes_its_loader_late_still_starts_at_step_0(corpus, tmp_path):
    """A trainer rank slower to make its loader than rank 0 to iterate (its first state read after the Planner
    planned ahead) starts at step 0 with every other rank; it used to take the Planner's position by then as its
    start and fail: 'client 1 starts at step N but the leader ... starts at step 0' (a torchrun trial, 3 of 7
    four-rank runs without any fault)."""
    job = LocalJob(make_sources(corpus), group_strategy, ol.ClientPlaceTree(dp=2), GLOBAL_BATCH, None,
                   image_token_id=corpus.image_token_id)
    try:
        reference = [job.step().outputs for _ in range(6)]
    finally:
        job.close()
    _spawn_group(_late_rank_trainer, (str(corpus.root), str(tmp_path)), 2, timeout=240)
    for r in range(2):
        got = torch.load(f"{tmp_path}/late-{r}.pt", weights_only=False)
        assert "error" not in got, got.get("error")
        assert [it["step"] for it in got["items"]] == list(range(6))
        for k, item in enumerate(got["items"]):
            assert_identical(item["microbatches"], reference[k][r]["microbatches"])


def _early_leader_trainer(rank: int, root: str, out_dir: str) -> None:
    """Rank 0 reads 3 steps and closes its loader; rank 1 goes on asking for more."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{out_dir}/pg-early", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    corpus = build_demo_corpus(root, scale="test", seed=0)
    out = {"steps": []}
    try:
        with _two_rank_loader(corpus, rank) as loader:
            for item in zip(range(3 if rank == 0 else 12), loader):
                out["steps"].append(item[1]["step"])
    except Exception as e:       # noqa: BLE001 - what the rank is told
        out["error"] = (type(e).__name__, str(e))
    dist.destroy_process_group()
    torch.save(out, f"{out_dir}/early-{rank}.pt")


@pytest.mark.slow
def test_a_rank_asking_past_a_closed_leaders_steps_is_told_at_once(corpus, tmp_path):
    """Rank 0 (the leader: its requests plan the steps) closes after 3 steps; rank 1 gets the steps rank 0 had
    asked for, then JobClosed saying why (before: it waited out its timeout, then TimeoutError or JobClosed,
    and rank 0's close waited as long for it to leave)."""
    _spawn_group(_early_leader_trainer, (str(corpus.root), str(tmp_path)), 2, timeout=200)
    first, second = (torch.load(f"{tmp_path}/early-{r}.pt", weights_only=False) for r in range(2))
    assert first["steps"] == [0, 1, 2] and "error" not in first
    assert second["steps"] == list(range(len(second["steps"]))) and 3 <= len(second["steps"]) < 12
    assert second["error"][0] == "JobClosed" and "closed its loader: no step after those it asked for" in \
        second["error"][1], second


def _role_killed_trainer(rank: int, root: str, out_dir: str) -> None:
    """Two ranks, no fault tolerance, a call timeout of 60 s; rank 0 SIGKILLs the one role process after 3 steps
    and both ranks read on: when does each rank's next() raise, and its loader's close end?"""
    import torch.distributed as dist

    from torchdata_overlord.runtime import faults

    dist.init_process_group("gloo", init_method=f"file://{out_dir}/pg-killed", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    corpus = build_demo_corpus(root, scale="test", seed=0)
    out = {"steps": []}
    try:
        with ol.OverlordLoader(make_sources(corpus), group_strategy, ol.ClientPlaceTree(dp=2), rank=rank,
                               global_batch=GLOBAL_BATCH, seq_len=None, image_token_id=corpus.image_token_id,
                               runtime="rpc", group="default", n_workers=1, prefetch=2, timeout=60) as loader:
            for item in zip(range(40), loader):
                out["steps"].append(item[1]["step"])
                if rank == 0 and len(out["steps"]) == 3:
                    out["killed_at"], out["killed"] = time.time(), faults.kill_role(loader, "planner")
                elif rank == 1 and len(out["steps"]) >= 3:
                    time.sleep(0.2)      # rank 0 kills the roles while rank 1 still reads (on 2 noisy cores)
    except Exception as e:       # noqa: BLE001 - what the rank is told
        out["error"] = (type(e).__name__, str(e))
    out["closed_at"] = time.time()
    torch.save(out, f"{out_dir}/killed-{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_killed_role_process_without_fault_tolerance_fails_every_rank_at_once(corpus, tmp_path):
    """The role process dies in a job of two trainer ranks without spares: rank 0 (the leader) cannot replace
    the Planner and raises RoleLost, and rank 1 (waiting in rank 0's registry for a new Planner) is told so at
    once. Before: rank 1 waited for a new Planner (recovery_timeout), rank 0's close waited a call timeout (60 s)
    for rank 1 to leave, and only rank 0's group ending then failed rank 1 (ActorDied: 'planner-registry' is
    unreachable), both about 60 s after the kill (a user trial)."""
    _spawn_group(_role_killed_trainer, (str(corpus.root), str(tmp_path)), 2, timeout=240)
    first, second = (torch.load(f"{tmp_path}/killed-{r}.pt", weights_only=False) for r in range(2))
    killed_at = first["killed_at"]
    for r, got in enumerate((first, second)):
        assert "error" in got and got["error"][0] == "RoleLost", (r, got.get("error"))
        assert "cannot be replaced: give the job spare processes" in got["error"][1], (r, got["error"])
        # well below the call timeout (60 s): the death is seen, not waited out
        assert got["closed_at"] - killed_at < 20, (r, got["closed_at"] - killed_at, got["error"])
    assert "client 1 lost the Planner" in second["error"][1] and "will start no new one" in second["error"][1]
    assert not _alive(first["killed"])
