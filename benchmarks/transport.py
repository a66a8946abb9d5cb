"""The loader -> constructor hand-off alone (issue 15, item 2): the per-sample cost of moving planned
samples between two role processes of one host, over the socket (TensorPipe ``uv``/``basic``, the
wire buffer copied through loopback TCP) and through shared memory (:mod:`torchdata_overlord.runtime.shm`,
the default on one host: the buffer written once into the sender's arena, the RPC carrying a handle),
and, for reference, between two actors of one process (no RPC).

One ``RpcTransport(n_workers=2)``: a *sender* actor on worker 0 (a Source Loader), two *sink*
actors (Data Constructors) on worker 1 and two on worker 0 (``inprocess``); the paths take turns
in each round (the sender switches its shared memory off for ``socket``: ``shm.set_enabled``; the
load of a shared machine moves, so they are interleaved, medians over rounds). For each sample size (4 KiB,
52 KiB, 1 MiB of tensors: ``input_ids`` and ``labels`` as int64, one uint8 ``pixels`` tensor making
up the rest, and a few Python fields), the sender runs ``steps`` steps as ``LoaderActor.deliver``
does: one ``put`` of ``samples`` samples to each sink at once, then waits for both answers; a sink
keeps a step's samples until the next step (as a constructor holds them until built). On the paths
through shared memory (``shm``, ``lane``) the sender first offers its samples to
:func:`torchdata_overlord.runtime.wire.hold`, as a Source Loader's read-ahead thread does before their
step: a sample of 256 KiB or more (``HOLD_MIN_BYTES``) is put into shared memory there, and a put sends
it by place instead of copying it; smaller ones are copied by the put, as before. ``hold_us`` per
sample is what that costs ahead of the step (the copy, for a held sample; deciding, for the others).

Figures, per sample (the step's wall time / samples in it, the median over steps):

* ``handoff_us``: the deliver-shaped hand-off above (what ``take_rpc_us_per_sample`` in
  ``runtimes.py`` measures inside a real job, there also waiting for the GIL the loader's refill holds);
* ``stream_us``: the same puts kept ``window`` deep in flight, one sink (throughput: what a sample
  costs when the round-trip latency overlaps other work, as the refill overlaps it in a job);
* ``cpu_us``: CPU time of the two worker processes per sample in the stream run (sender + receiver);
* ``hold_us``: offering a sample to ``hold`` ahead of its step (for a held one, the copy a put no longer makes);
* floors: ``empty_call_rtt_us_per_put``, the round trip of a call without arguments between the two
  processes, run on the sink actor's own thread (TensorPipe or the lane, and the hand-over to the actor's
  thread; a ``put``, quick, skips that hand-over on a lane when the sink is idle), and
  ``pack_unpack_us``, packing and unpacking a put's samples in one process, per sample (as the path
  sends them: held samples by place, the others copied).

Every run checks the samples arrived bit-identical (a checksum per sample, computed on each side).

    python benchmarks/transport.py                  # full size (~30 s)
    python benchmarks/transport.py --quick --out /tmp/transport.json     # CI smoke
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402

from torchdata_overlord.runtime.wire import HOLD_MIN_BYTES  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SIZES_KIB = [4, 52, 1024]
TARGET_US = 20.0                     # per sample at 52 KiB, one host (issue 15)


def make_sample(i: int, nbytes: int) -> dict:
    """A sample of ``nbytes`` bytes of tensors, shaped like a Source Loader's record."""
    n = max(1, min(nbytes // 32, 4096))                 # tokens: 8 bytes each, ids and labels
    rest = max(0, nbytes - 16 * n)
    g = torch.Generator().manual_seed(i)
    return {"input_ids": torch.randint(0, 50_000, (n,), generator=g), "labels": torch.randint(0, 50_000, (n,), generator=g),
            "pixels": torch.randint(0, 256, (rest,), dtype=torch.uint8, generator=g), "source": "web", "index": i}


def checksum(rec: dict) -> int:
    return int(sum(int(rec[k].view(torch.uint8).to(torch.int64).sum()) * (j + 1)
                   for j, k in enumerate(("input_ids", "labels", "pixels"))))


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Sink:
    """A Data Constructor's ``put``: keep the step's samples (dropping the previous step's). Like
    ``ConstructorActor.put`` it is quick: the lane thread that receives it may run it."""

    QUICK_METHODS = frozenset({"put"})

    def __init__(self):
        self.held: dict = {}

    def put(self, step: int, recs: dict) -> int:
        self.held = {"step": step, "recs": recs}
        return len(recs)

    def checksums(self) -> dict:
        return {i: checksum(r) for i, r in self.held["recs"].items()}

    def cpu(self) -> float:
        return _cpu()


class Sender:
    """A Source Loader sending its parts (every call runs in its worker process)."""

    def __init__(self, peers):
        self.peers, self.sinks = peers, []

    def use(self, path: str, sinks: list[str]) -> None:
        from torchdata_overlord.runtime import lane, shm
        shm.set_enabled(path != "socket")
        lane.set_enabled(path == "lane")
        self.sinks, self.held = list(sinks), path in ("shm", "lane")

    def samples(self, first: int, nbytes: int, samples: int) -> tuple[dict, float]:
        """``samples`` samples from number ``first`` on, put into shared memory when the path goes through
        it (as a loader's read-ahead does), and the seconds that took."""
        from torchdata_overlord.runtime.wire import hold
        recs = {i: make_sample(first + i, nbytes) for i in range(samples)}
        t0 = time.perf_counter()
        if self.held:
            recs = {i: hold(r) for i, r in recs.items()}
        return recs, time.perf_counter() - t0

    def handoff(self, nbytes: int, samples: int, steps: int, warmup: int) -> dict:
        made = [self.samples(c * samples, nbytes, samples) for c in range(len(self.sinks))]
        recs = [r for r, _ in made]
        per_step = []
        for step in range(warmup + steps):
            t0 = time.perf_counter()
            futs = [self.peers.call(s, "put", step, recs[c], timeout=60) for c, s in enumerate(self.sinks)]
            for f in futs:
                f.result(65)
            if step >= warmup:
                per_step.append(time.perf_counter() - t0)
        sent = {i: checksum(r) for part in recs for i, r in part.items()}
        got = {}
        for s in self.sinks:
            got.update(self.peers.call(s, "checksums", timeout=60).result(65))
        return {"per_step_s": per_step, "identical": got == sent and len(got) == len(sent),
                "hold_s": sum(t for _, t in made) / (samples * len(self.sinks))}

    def floor(self, nbytes: int, samples: int, n: int) -> dict:
        """What every put costs whatever carries its bytes: an empty call's round trip to the first sink,
        TensorPipe's own round trip to that process (``rpc_async`` of a builtin: no actor, no ordering, no
        wire format), and packing + unpacking one put's samples in this process (the wire format's
        per-tensor work)."""
        import operator

        import torch.distributed.rpc as rpc

        from torchdata_overlord.runtime.wire import pack, unpack
        recs, _ = self.samples(0, nbytes, samples)
        worker = self.peers.where(self.sinks[0])
        rtt, raw, wire = [], [], []
        # each floor in a loop of its own: taking turns, each slowed the next (an empty call on the lane: 87 us
        # in a loop of calls, 161-179 right after a TensorPipe round trip, 120-149 after a pack + unpack, ~290
        # after both, here), and none of the three follows another so in a job's step
        for _ in range(n):
            t0 = time.perf_counter()
            self.peers.call(self.sinks[0], "cpu", timeout=60).result(65)
            rtt.append(time.perf_counter() - t0)
        for _ in range(n):
            t0 = time.perf_counter()
            rpc.rpc_async(worker, operator.add, args=(1, 1), timeout=60).wait()
            raw.append(time.perf_counter() - t0)
        for _ in range(n):
            t0 = time.perf_counter()
            unpack(*pack(((0, recs), {}), peer=worker))
            wire.append(time.perf_counter() - t0)
        return {"rtt_s": float(np.median(rtt)), "raw_rtt_s": float(np.median(raw)),
                "pack_unpack_s": float(np.median(wire))}

    def stream(self, nbytes: int, samples: int, calls: int, window: int) -> dict:
        recs, _ = self.samples(0, nbytes, samples)
        sink = self.sinks[0]
        other_cpu = self.peers.call(sink, "cpu", timeout=60).result(65)
        from torchdata_overlord.runtime import lane, shm
        st = shm.stats()
        sent0, held0, lane0 = st["sent"], st["held_messages"], lane.stats()["calls"]
        c0, t0 = _cpu(), time.perf_counter()
        inflight = []
        for k in range(calls):
            inflight.append(self.peers.call(sink, "put", k, recs, timeout=60))
            if len(inflight) >= window:
                inflight.pop(0).result(65)
        for f in inflight:
            f.result(65)
        wall, cpu = time.perf_counter() - t0, _cpu() - c0
        other_cpu = self.peers.call(sink, "cpu", timeout=60).result(65) - other_cpu
        local = self.peers.where(sink) == self.peers.where("sender")
        st = shm.stats()
        return {"wall_s": wall, "cpu_s": cpu + (0.0 if local else other_cpu), "samples": calls * samples,
                "via_shm": st["sent"] - sent0 + st["held_messages"] - held0, "via_held": st["held_messages"] - held0,
                "via_lane": lane.stats()["calls"] - lane0}


PATHS = {"inprocess": "two actors of one process (no RPC, no pickling)",
         "socket": "RPC, the wire buffer through loopback TCP (TensorPipe uv/basic; the path before shared memory)",
         "shm": "RPC, the wire buffer in the sender's shared memory, a handle over TensorPipe's TCP",
         "lane": "the buffer in shared memory, the call on a Unix socket (runtime/lane.py; the default on one host)"}


def measure(t, path: str, kib: int, a: dict) -> dict:
    """One path at one sample size (the sender switched to it first)."""
    sinks = ["near:0", "near:1"] if path == "inprocess" else ["sink:0", "sink:1"]
    call = lambda m, *args: t.call("sender", m, *args, timeout=300).result(310)      # noqa: E731
    call("use", path, sinks)
    nbytes = kib * 1024
    h = call("handoff", nbytes, a["samples"], a["steps"], a["warmup"])
    n = a["samples"] * len(sinks)
    call("stream", nbytes, a["samples"], a["window"], a["window"])                   # warm
    s = call("stream", nbytes, a["samples"], a["stream_calls"], a["window"])
    f = call("floor", nbytes, a["samples"], a["floor_calls"]) if path != "inprocess" else {
        "rtt_s": 0.0, "raw_rtt_s": 0.0, "pack_unpack_s": 0.0}
    return {"kib": kib, "identical": h["identical"], "handoff_us": 1e6 * float(np.median(h["per_step_s"])) / n,
            "empty_call_rtt_us_per_put": 1e6 * f["rtt_s"], "tensorpipe_rtt_us_per_put": 1e6 * f["raw_rtt_s"],
            "pack_unpack_us": 1e6 * f["pack_unpack_s"] / a["samples"],
            "handoff_p90_us": 1e6 * float(np.percentile(h["per_step_s"], 90)) / n,
            "stream_us": 1e6 * s["wall_s"] / s["samples"], "cpu_us": 1e6 * s["cpu_s"] / s["samples"],
            "hold_us": 1e6 * h["hold_s"], "via_shm": s["via_shm"], "via_held": s["via_held"], "via_lane": s["via_lane"]}


def main(argv=None) -> int:
    from torchdata_overlord.runtime.rpc_transport import RpcTransport

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="few steps (CI smoke)")
    ap.add_argument("--out", type=Path, default=RESULTS / "transport.json")
    ap.add_argument("--steps", type=int, default=None, help="measured hand-off steps per size and round")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds of every path (medians kept)")
    args = ap.parse_args(argv)
    a = {"sizes_kib": SIZES_KIB, "samples": 8, "window": 4, "warmup": 2 if args.quick else 5,
         "steps": args.steps or (8 if args.quick else 40), "stream_calls": 8 if args.quick else 40,
         "floor_calls": 5 if args.quick else 30,
         "rounds": args.rounds or (1 if args.quick else 5)}
    t_all, load_start = time.perf_counter(), round(os.getloadavg()[0], 2)
    print(f"loader -> constructor hand-off: {a['samples']} samples per put, 2 constructors, sizes {a['sizes_kib']} KiB; "
          f"{a['warmup']} + {a['steps']} steps; stream {a['stream_calls']} puts {a['window']} deep; "
          f"{a['rounds']} interleaved round(s) of {list(PATHS)}", flush=True)
    runs: dict = {p: {str(k): [] for k in a["sizes_kib"]} for p in PATHS}
    errors = {}
    with RpcTransport(n_workers=2, startup_timeout=120, rpc_timeout=60, stop_timeout=10) as t:
        sinks = {"sink:0": 1, "sink:1": 1, "near:0": 0, "near:1": 0}
        t.place({"sender": 0, **sinks})
        for s, w in sinks.items():
            t.start_actor(s, Sink, worker=w)
        t.start_actor("sender", Sender, t.peers(), worker=0)
        for r in range(a["rounds"]):        # interleaved: the machine is shared and its load moves
            for kib in a["sizes_kib"]:
                for path in (PATHS if r % 2 == 0 else list(PATHS)[::-1]):
                    try:
                        runs[path][str(kib)].append(measure(t, path, kib, a))
                    except Exception as e:  # noqa: BLE001 (recorded; the exit status says a run failed)
                        errors[f"{path}/{kib}/{r}"] = f"{type(e).__name__}: {e}"
                        traceback.print_exc()
    table = {}
    for path, by in runs.items():
        table[path] = {}
        for kib, rows in by.items():
            if rows:
                table[path][kib] = {k: float(np.median([row[k] for row in rows]))
                                    for k in ("handoff_us", "handoff_p90_us", "stream_us", "cpu_us", "hold_us",
                                              "empty_call_rtt_us_per_put", "tensorpipe_rtt_us_per_put",
                                              "pack_unpack_us")}
                table[path][kib]["identical"] = all(row["identical"] for row in rows)
                table[path][kib]["via_shm"] = sum(row["via_shm"] for row in rows)
                table[path][kib]["via_held"] = sum(row["via_held"] for row in rows)
                table[path][kib]["via_lane"] = sum(row["via_lane"] for row in rows)
    print(f"\nper sample, us (medians of {a['rounds']} round(s)); hand-off: deliver-shaped (a put of {a['samples']} "
          f"samples to each of 2 constructors, then wait for both); stream: {a['window']} puts in flight to one; "
          f"cpu: both processes' CPU time in the stream run; hold: putting a sample into shared memory ahead of its "
          f"step (shm and lane; the copy a put then skips); floors: an empty call's round trip (us per put, "
          f"whatever carries the bytes) and packing + unpacking (us per sample, in one process)")
    print(f"{'KiB':>6} {'path':>10} {'hand-off':>9} {'p90':>9} {'stream':>9} {'cpu':>9} {'hold':>7} {'identical':>9} {'via shm':>8} "
          f"{'by place':>8} {'via lane':>8} {'empty call':>10} {'tensorpipe':>10} {'pack+unpack':>11}")
    for kib in map(str, a["sizes_kib"]):
        for path in PATHS:
            row = table[path].get(kib)
            if row:
                print(f"{kib:>6} {path:>10} {row['handoff_us']:>9.1f} {row['handoff_p90_us']:>9.1f} "
                      f"{row['stream_us']:>9.1f} {row['cpu_us']:>9.1f} {row['hold_us']:>7.1f} {str(row['identical']):>9} "
                      f"{row['via_shm']:>8} {row['via_held']:>8} {row['via_lane']:>8} "
                      f"{row['empty_call_rtt_us_per_put']:>10.0f} {row['tensorpipe_rtt_us_per_put']:>10.0f} "
                      f"{row['pack_unpack_us']:>11.1f}")
    verdict = {}
    if all("52" in table[p] for p in ("socket", "shm", "lane")):
        ln, sh, so = table["lane"]["52"], table["shm"]["52"], table["socket"]["52"]
        verdict = {"target_us_per_sample_52kib": TARGET_US, "default_path": "lane",
                   "lane_handoff_us_52kib": ln["handoff_us"], "shm_handoff_us_52kib": sh["handoff_us"],
                   "socket_handoff_us_52kib": so["handoff_us"], "lane_stream_us_52kib": ln["stream_us"],
                   "shm_stream_us_52kib": sh["stream_us"], "socket_stream_us_52kib": so["stream_us"],
                   "handoff_meets_target": ln["handoff_us"] <= TARGET_US, "stream_meets_target": ln["stream_us"] <= TARGET_US,
                   "all_identical": all(r["identical"] for by in table.values() for r in by.values()),
                   "shm_used": all(r["via_shm"] > 0 for p in ("shm", "lane") for r in table[p].values()),
                   # a loader holds a record of 256 KiB or more ahead of its step (wire.HOLD_MIN_BYTES), not smaller ones
                   "sent_by_place": all((r["via_held"] > 0) == (int(kib) * 1024 >= HOLD_MIN_BYTES)
                                        for p in ("shm", "lane") for kib, r in table[p].items()),
                   "lane_hold_us_1mib": table["lane"]["1024"]["hold_us"] if "1024" in table["lane"] else None,
                   "lane_used": all(r["via_lane"] > 0 for r in table["lane"].values()),
                   "others_off_lane": all(r["via_lane"] == 0 for p in ("socket", "shm") for r in table[p].values()),
                   "empty_call_rtt_us_per_put": ln["empty_call_rtt_us_per_put"],
                   "empty_call_rtt_us_per_put_tensorpipe": sh["empty_call_rtt_us_per_put"],
                   "empty_call_rtt_us_per_sample": ln["empty_call_rtt_us_per_put"] / a["samples"],
                   "tensorpipe_rtt_us_per_put": sh["tensorpipe_rtt_us_per_put"],
                   "pack_unpack_us_52kib": ln["pack_unpack_us"],
                   "socket_used_no_shm": all(r["via_shm"] == 0 and r["via_held"] == 0 for r in table["socket"].values())}
        print(f"\n52 KiB per sample, one host, target <= {TARGET_US:g} us: hand-off lane {ln['handoff_us']:.1f} us vs "
              f"shm over TensorPipe {sh['handoff_us']:.1f} us vs socket {so['handoff_us']:.1f} us "
              f"({'MEETS' if verdict['handoff_meets_target'] else 'MISSES'}); stream lane {ln['stream_us']:.1f} vs shm "
              f"{sh['stream_us']:.1f} vs socket {so['stream_us']:.1f} us "
              f"({'MEETS' if verdict['stream_meets_target'] else 'MISSES'}); bit-identical: {verdict['all_identical']}; "
              f"shm used: {verdict['shm_used']}, samples of 256 KiB and more sent by place (put there ahead of the step), "
              f"the others copied: {verdict['sent_by_place']}, lane used: {verdict['lane_used']}, the others off it: "
              f"{verdict['others_off_lane']}, socket path free of shm: {verdict['socket_used_no_shm']}; an empty call takes "
              f"{verdict['empty_call_rtt_us_per_put']:.0f} us on the lane, "
              f"{verdict['empty_call_rtt_us_per_put_tensorpipe']:.0f} us over TensorPipe "
              f"(TensorPipe's own round trip {verdict['tensorpipe_rtt_us_per_put']:.0f} us), and packing + "
              f"unpacking {verdict['pack_unpack_us_52kib']:.0f} us per sample")
    out = {"benchmark": "transport", "quick": args.quick, "config": a, "paths": PATHS, "table": table, "runs": runs,
           "verdict": verdict, "errors": errors}
    write_results(args.out, out, started=t_all, load_start=load_start)
    ok = (verdict and verdict["all_identical"] and verdict["shm_used"] and verdict["socket_used_no_shm"]
          and verdict["sent_by_place"]
          and verdict["lane_used"] and verdict["others_off_lane"])
    return 1 if errors or not ok else 0


if __name__ == "__main__":
    sys.exit(main())
