"""Tutorial: your own data as a source, from a ``torchdata.nodes`` node, in both runtimes.

A source is anything with the :class:`torchdata_overlord.Source` protocol; the quickest way to get
one is :class:`torchdata_overlord.NodeSource` over a stateful ``torchdata.nodes.BaseNode`` (WebDataset
shards, a Hugging Face dataset, a database cursor: whatever your node reads). Its state is the
node's own ``state_dict()``, so the loader checkpoints and resumes it exactly. Here the node is
``Dialogues``, a few lines that make synthetic chat turns from a seed (a real one would read files),
mixed with the demo corpus's Parquet ``code`` source and a JSON Lines file read by
:class:`torchdata_overlord.FileSource`. A source type of your own implements the protocol's members
(``torchdata_overlord/sources/base.py``); those it marks optional, such as ``skips`` (without it the
source reports no skips in ``loader.stats()``), may be left out.

``runtime="rpc"`` builds every source again in a role process, so a NodeSource needs a *factory*
(here the module-level ``make_dialogues``), and the transform must be importable there too (module
level, outside ``if __name__ == "__main__":``). The walk-through runs the same job in both runtimes,
checks that they yield the same steps bit for bit, then resumes the rpc loader from a state taken
by the local one.

    python tutorials/custom_source.py
    python tutorials/custom_source.py --scale test --root /tmp/overlord-corpus --steps 4
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from torchdata.nodes import BaseNode

import torchdata_overlord as ol
from torchdata_overlord.sim.corpus import build_demo_corpus, default_corpus_root
from torchdata_overlord.testing import assert_identical, make_text_corpus


class Dialogues(BaseNode):
    """A user's node: chat turns made from ``seed``, endless; its whole state is the next turn's number."""

    def __init__(self, seed: int = 0):
        super().__init__()
        self.seed = seed

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        self.turn = 0 if initial_state is None else int(initial_state["turn"])

    def next(self) -> dict:
        words = make_text_corpus(1, seed=self.seed * 1_000_003 + self.turn)[0]
        self.turn += 1
        return {"text": f"user: {words}\nassistant: {words[::-1]}"}

    def get_state(self) -> dict:
        return {"turn": self.turn}


def make_dialogues() -> Dialogues:
    """The factory the rpc runtime calls in the role process (a module-level function pickles)."""
    return Dialogues(seed=7)


def write_jsonl(path: str, n: int = 200) -> str:
    """A JSON Lines file of ``n`` short notes, standing in for the user's own files."""
    with open(path, "w") as f:
        for i, text in enumerate(make_text_corpus(n, seed=11)):
            f.write(json.dumps({"id": i, "text": text}) + "\n")
    return path


def make_loader(corpus, jsonl: str, runtime: str) -> ol.OverlordLoader:
    tokenize = ol.Tokenize(corpus.spm_model, field="text")
    sources = [ol.NodeSource("chat", make_dialogues, tokenize),
               ol.FileSource("notes", jsonl, tokenize, seed=3),
               corpus.source("code")]
    return ol.OverlordLoader(sources, strategy, ol.ClientPlaceTree(dp=2), rank=None, global_batch=12,
                             seq_len=None, runtime=runtime)


def strategy(g: ol.DGraph) -> ol.Plan:
    return (g.mix({"chat": 0.5, "notes": 0.25, "code": 0.25}).distribute("DP").cost(ol.attention_flops)
            .balance("karmarkar_karp", microbatches=2).plan())


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", default="demo", choices=["demo", "test"])
    ap.add_argument("--root", default=None, help="corpus directory (default: the shared cache)")
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args(argv)
    corpus = build_demo_corpus(args.root or default_corpus_root(), scale=args.scale)
    half = args.steps // 2
    with tempfile.TemporaryDirectory() as tmp:
        jsonl = write_jsonl(os.path.join(tmp, "notes.jsonl"))
        streams = {}
        for runtime in ("local", "rpc"):
            with make_loader(corpus, jsonl, runtime) as loader:
                streams[runtime] = [step for _, step in zip(range(args.steps), loader)]
        assert_identical(streams["rpc"], streams["local"])
        with make_loader(corpus, jsonl, "local") as loader:
            head = [step for _, step in zip(range(half), loader)]
            state = loader.state_dict()
        with make_loader(corpus, jsonl, "rpc") as loader:
            loader.load_state_dict(state)
            tail = [step for _, step in zip(range(args.steps - half), loader)]
        assert_identical(head + tail, streams["local"])
    per_source = {}
    for step in streams["local"]:
        for out in step.values():
            for mb in out["microbatches"]:
                for key in mb["sample_keys"]:
                    name = key.rsplit(":", 1)[0]           # "source:index"
                    per_source[name] = per_source.get(name, 0) + 1
    print(f"{args.steps} steps, the same in both runtimes; samples per source (every rank): {per_source}")
    print(f"resumed the rpc loader at step {half} from the local loader's state: the same {args.steps - half} steps")
    return {"steps": args.steps, "identical": True, "resumed_at": half, "per_source": per_source}


if __name__ == "__main__":
    main()
