"""Tutorial: hybrid balance for a vision-language model (paper Fig. 9, right).

A VLM step runs two modules with different parallelism over the same ranks: a vision encoder on
the images and the LLM backbone on the text, image placeholders included. The backbone is
balanced as in LLMBalance; the images are balanced on their own, across *every* rank (world-wide
data parallel for the encoder), with a cost model of their patch counts. Five more lines:

    images = g.view("image").distribute("WORLD").cost(ol.encoder_cost).balance("greedy")
    return text.plan(encoder=images)

The same mixed buffer is viewed twice: as images for the encoder, as token sequences for the
backbone. This walk-through iterates an ``OverlordLoader`` over the demo corpus's real ``web``
text and ``caps`` captioned JPEGs, prints what one rank receives (its packed microbatches, where
each image's placeholder tokens sit, and the images it embeds for the encoder), checks that the
encoder parts cover every image of the step exactly once, and compares the encoder's per-rank
cost with the equal-count split in arrival order that a cost-blind loader makes.

    python tutorials/vlm_hybrid_balance.py
    python tutorials/vlm_hybrid_balance.py --scale test --root /tmp/overlord-corpus --steps 2
"""

from __future__ import annotations

import argparse
from collections import Counter

import numpy as np
import torch

import torchdata_overlord as ol
from torchdata_overlord.sim.corpus import build_demo_corpus, default_corpus_root

MIXTURE = {"web": 0.5, "caps": 0.5}


def make_strategy(max_tokens: int):
    def strategy(g: ol.DGraph) -> ol.Plan:
        g = g.mix(MIXTURE)
        # the encoder: every sample with an image, over all ranks, by image-patch FLOPs
        # (equivalently: mesh.attach("encoder", dp=world) and .distribute("DP", module="encoder"))
        images = g.view("image").distribute("WORLD").cost(ol.encoder_cost).balance("greedy")
        # the backbone: LLMBalance on the token sequences (image placeholders + caption, or text)
        text = (g.view("text").distribute("DP").cost(ol.attention_flops)
                 .balance("greedy", microbatches=2, max_tokens=max_tokens, oversize="split")
                 .broadcast_at("TP"))
        return text.plan(encoder=images)             # one Plan; the encoder's rides in plan.modules
    return strategy


def image_cost(grid) -> np.ndarray:
    """Encoder FLOPs of images from their (rows, cols) patch grids: the same model the plan used."""
    patches = np.asarray(grid, np.float64).reshape(-1, 2).prod(1)
    return ol.encoder_cost.of_length(patches)


def backbone_images(step_item: dict, mesh: ol.ClientPlaceTree) -> list[tuple[str, tuple, int]]:
    """(image key, grid, encoder rank) of every image in the step's backbone microbatches, read once
    per DP group (from its pp=0, cp=0, tp=0 rank); an image cut by an oversize split appears once per piece."""
    out = []
    for rank, item in step_item.items():
        c = mesh.coords(rank)
        if item["delivery"] != "data" or c["cp"] or c["tp"]:
            continue
        for mb in item["microbatches"]:
            for k, g, r in zip(mb.get("image_keys", []), mb.get("image_grid", torch.zeros(0, 2)).tolist(),
                               mb.get("image_encoder_rank", torch.zeros(0)).tolist()):
                out.append((k, tuple(g), int(r)))
    return out


def describe_rank(rank: int, item: dict, mesh: ol.ClientPlaceTree, patch: int, image_token_id: int) -> None:
    print(f"rank {rank} {mesh.coords(rank)} receives, at step {item['step']}: backbone delivery "
          f"'{item['delivery']}'")
    for m, mb in enumerate(item["microbatches"] or []):
        fields = ", ".join(f"{k} {tuple(v.shape)}" if isinstance(v, torch.Tensor) else f"{k} [{len(v)}]"
                           for k, v in mb.items())
        print(f"  microbatch {m}: {fields}")
        print(f"    {len(mb['sample_keys'])} packed segments: {' '.join(mb['sample_keys'])}")
        cu = mb["cu_seqlens_padded"].tolist()                # where each packed sequence starts
        none = torch.zeros(0, 2, dtype=torch.int64)         # a microbatch without images has no image fields
        for k, (start, length), seg, enc in zip(mb.get("image_keys", []), mb.get("image_positions", none).tolist(),
                                               mb.get("image_segments", none[:, 0]).tolist(),
                                               mb.get("image_encoder_rank", none[:, 0]).tolist()):
            ids = mb["input_ids"][start:start + length]
            print(f"    image {k}: {length} placeholder tokens at [{start}:{start + length}) of segment {seg} "
                  f"(starts at {cu[seg]}), all <image>: {bool((ids == image_token_id).all())}; embedded by rank {enc}")
    enc = item["encoder"]
    if enc is None:
        print("  encoder part: none")
        return
    print(f"  encoder part (bucket {enc['bucket']}): {len(enc['image_keys'])} image(s) to embed")
    for k, px, g in zip(enc["image_keys"], enc["pixels"], enc["image_grid"].tolist()):
        print(f"    {k}: pixels {tuple(px.shape)} {px.dtype} = {g[0]}x{g[1]} patches of {patch}px")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=str(default_corpus_root()), help="where the demo corpus is built / cached")
    ap.add_argument("--scale", default="demo", choices=["demo", "test"])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=4096, help="tokens per packed backbone microbatch")
    ap.add_argument("--rank", type=int, default=0, help="the rank whose delivery is printed")
    args = ap.parse_args(argv)

    corpus = build_demo_corpus(args.root, scale=args.scale)
    mesh = ol.ClientPlaceTree(pp=2, dp=2, tp=2)                   # 8 ranks; the encoder uses all 8
    patch = 14
    sources = [corpus.source("web"),
               # ImageText: decode, resize to whole 14px patches (longer side <= 224), tokenize the caption
               corpus.source("caps", transform=corpus.transform("caps", patch=patch, max_side=224))]
    print(f"mesh {mesh.describe()}: backbone DP over {mesh.sizes['dp']} groups, encoder over all "
          f"{mesh.world_size} ranks; global batch {args.global_batch} ({MIXTURE})\n")

    before, after, covered, steps = [], [], True, 0
    # rank=None simulates every rank in this process (each item is {rank: item}); a trainer passes its rank.
    with ol.OverlordLoader(sources, make_strategy(args.max_tokens), mesh, rank=None, global_batch=args.global_batch,
                           seq_len=None, image_token_id=corpus.image_token_id, workers={"caps": 2}) as loader:
        for step, item in zip(range(args.steps), loader):
            if step == 0:
                describe_rank(args.rank, item[args.rank], mesh, patch, corpus.image_token_id)
                print("every rank at this step (TP ranks > 0 get the backbone by broadcast, PP stage 1 gets "
                      "metadata only,\nbut every rank embeds its share of the images):")
                for r, out in sorted(item.items()):
                    enc = out["encoder"]
                    print(f"  rank {r} {mesh.coords(r)}: backbone {out['delivery']:>8}, encoder "
                          f"{len(enc['image_keys']) if enc else 0} image(s), "
                          f"{image_cost(enc['image_grid']).sum() / 1e9 if enc else 0:.1f} GFLOP")
                print()
            # every image of the backbone is embedded exactly once, by the rank the microbatch names
            in_backbone = backbone_images(item, mesh)
            embedded = Counter(k for out in item.values() if out["encoder"] for k in out["encoder"]["image_keys"])
            by_rank = {r: set(out["encoder"]["image_keys"]) if out["encoder"] else set() for r, out in item.items()}
            once = (set(embedded) == {k for k, _, _ in in_backbone} and set(embedded.values()) <= {1}
                    and all(k in by_rank[r] for k, _, r in in_backbone))
            covered &= once
            # encoder balance. After: the plan's own figure (loader.last_plan is the Plan of the step
            # just consumed), checked against the images each rank actually received.
            enc_plan = loader.last_plan.module("encoder")
            received = np.array([image_cost(out["encoder"]["image_grid"]).sum() if out["encoder"] else 0.0
                                 for _, out in sorted(item.items())])
            assert np.isclose(received.max() / received.mean(), enc_plan.stats["max_over_mean"])
            # Before: what balance("arrival") does over the same ranks: the step's images in arrival
            # order, cut into equal counts, blind to their cost.
            costs = ol.encoder_cost(enc_plan.records)
            chunk = (np.arange(len(costs)) * mesh.world_size) // max(len(costs), 1)
            arrival = np.bincount(chunk, weights=costs, minlength=mesh.world_size)
            before.append(arrival.max() / arrival.mean())
            after.append(enc_plan.stats["max_over_mean"])
            print(f"step {step}: {len(embedded)} images; encoder max/mean over {mesh.world_size} ranks "
                  f"{before[-1]:.3f} (arrival order, equal counts) -> {after[-1]:.3f} (balanced); "
                  f"every image embedded once: {once}")
            steps += 1
    figures = {"steps": steps, "encoder_covers_every_image_once": covered,
               "encoder_max_over_mean_arrival": float(np.mean(before)),
               "encoder_max_over_mean_balanced": float(np.mean(after))}
    print(f"\nover {steps} steps: encoder per-rank max/mean {figures['encoder_max_over_mean_arrival']:.3f} "
          f"(arrival order) -> {figures['encoder_max_over_mean_balanced']:.3f} (balanced by patch FLOPs)")
    return figures


if __name__ == "__main__":
    main()
