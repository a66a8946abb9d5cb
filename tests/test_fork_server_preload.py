"""The rpc runtime's fork server imports what the jobs' transforms declare (``ImageText.preload``:
torchvision), so a loader actor started mid-run (a reshard, a recovery) in a process that held no
image source decodes at once instead of importing torchvision under the GIL of serving actors."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from test_loader import corpus  # noqa: F401 (fixture)

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_every_role_process_has_torchvision_before_any_image_is_decoded(corpus, tmp_path):
    out = tmp_path / "out.json"
    script = f"""
import json, sys
sys.path.insert(0, {str(ROOT / 'tests')!r})
import torchdata_overlord as ol
from test_loader import make_sources
from test_elastic import strategy
from test_loader_state import module_strategy
from torchdata_overlord.sim.corpus import build_demo_corpus
corpus = build_demo_corpus({str(Path(corpus.root))!r}, scale="test", seed=0)

def mapped(pid):
    return "torchvision" in open(f"/proc/{{pid}}/maps").read()

if __name__ == "__main__":
    text_only = make_sources(corpus, names=("web", "code", "long"))
    with_images = make_sources(corpus, names=("web", "code", "long", "caps"))
    got = {{}}
    for name, sources in (("text", text_only), ("images", with_images)):
        # a second loader in this process would reuse the first one's fork server: one run per process
        if name != sys.argv[1]:
            continue
        strat = strategy if name == "text" else module_strategy        # module level: the workers unpickle them
        with ol.OverlordLoader(sources, strat, ol.ClientPlaceTree(dp=2), rank=None, global_batch=8, seq_len=None,
                               runtime="rpc", n_workers=2, image_token_id=corpus.image_token_id) as loader:
            pids = sorted(set(loader.stats()["roles"].values()))
            got[name] = [mapped(p) for p in pids]
    json.dump(got, open({str(out)!r} + sys.argv[1], "w"))
"""
    results = {}
    for kind in ("text", "images"):
        proc = subprocess.run([sys.executable, "-c", script, kind], capture_output=True, text=True, timeout=300,
                              cwd=str(ROOT))
        assert proc.returncode == 0, proc.stderr[-3000:]
        results.update(json.loads(Path(str(out) + kind).read_text()))
    assert results["text"] and not any(results["text"])          # nothing asked for it: not imported
    assert len(results["images"]) == 2 and all(results["images"])  # both processes, the text-only one too
