"""The tutorials run on the real demo corpus (scale "test") and show what their docstrings claim."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from torchdata_overlord.sim.corpus import build_demo_corpus

TUTORIALS = Path(__file__).resolve().parent.parent / "tutorials"
NAMES = ("long_short_mixing", "vlm_hybrid_balance", "curriculum_mixing", "checkpoint_resume", "custom_source",
         "elastic_resume")


def load(name):
    spec = importlib.util.spec_from_file_location(f"tutorial_{name}", TUTORIALS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    path = tmp_path_factory.mktemp("tutorial-corpus")
    build_demo_corpus(path, scale="test")                  # built once; every tutorial then reuses it
    return str(path)


def run(name, root, *args):
    return load(name).main(["--scale", "test", "--root", root, *args])


@pytest.mark.parametrize("name", NAMES)
def test_tutorial_is_a_runnable_walk_through(name):
    module = load(name)
    assert f"python tutorials/{name}.py" in module.__doc__
    assert callable(module.main)
    assert 'if __name__ == "__main__":' in (TUTORIALS / f"{name}.py").read_text()


def test_long_short_mixing_balances_and_spans_cp_ranks(root, capsys):
    fig = run("long_short_mixing", root, "--steps", "3", "--global-batch", "32", "--max-tokens", "4096")
    out = capsys.readouterr().out
    arrival, greedy, cp = fig["arrival"], fig["greedy"], fig["cp"]
    assert 1.0 <= greedy["max_over_mean"] <= arrival["max_over_mean"]
    assert greedy["lockstep_over_bound"] <= arrival["lockstep_over_bound"]
    assert cp["max_over_mean"] >= 1.0 and len(fig["steps"]) == 3
    # distribute("CP") with a per-rank budget of 2048: the long documents span both CP ranks
    assert fig["cp_level"] == "lockstep" and fig["cp_spans"] > 0 and fig["last_spans"]
    assert all(sp["cp_ranks"] == [0, 1] for sp in fig["last_spans"])
    assert fig["shard_shown"]["nshards"] == 2 and fig["shard_shown"]["length"] <= 2048
    assert "span CP ranks" in out and "balance level: lockstep" in out


def test_vlm_hybrid_balance_embeds_every_image_once(root, capsys):
    fig = run("vlm_hybrid_balance", root, "--steps", "2", "--global-batch", "32")
    out = capsys.readouterr().out
    assert fig["steps"] == 2
    assert fig["encoder_covers_every_image_once"] is True
    assert 1.0 <= fig["encoder_max_over_mean_balanced"] <= fig["encoder_max_over_mean_arrival"]
    # what rank 0 receives: packed microbatches with image placeholders, and its encoder share
    assert "image_positions" in out and "all <image>: True" in out and "encoder part (bucket 0)" in out
    assert "backbone     none" in out and "backbone metadata" in out


def test_curriculum_mixing_stays_within_one_sample(root):
    steps, batch = 6, 30
    fig = run("curriculum_mixing", root, "--steps", str(steps), "--global-batch", str(batch))
    assert fig["max_cumulative_deviation"] < 1
    for name in ("linear", "cosine", "piecewise", "dynamic"):
        f = fig[name]
        assert f["max_cumulative_deviation"] < 1, name
        assert sum(f["cumulative"].values()) == steps * batch, name
        for s, n in f["cumulative"].items():
            assert abs(n - f["cumulative_target"][s]) < 1, (name, s)
    assert fig["piecewise"]["final_weights"] == {"code": 0.3, "long": 0.2, "web": 0.5}
    assert fig["linear"]["cumulative"]["long"] > 0
    # the simulated loss moved the dynamic weights away from uniform
    assert max(fig["dynamic"]["final_weights"].values()) > 0.4


def test_checkpoint_resume_is_bit_identical(root, capsys):
    fig = run("checkpoint_resume", root, "--steps", "4", "--save-at", "2")
    out = capsys.readouterr().out
    assert fig["identical"] is True
    assert fig["checkpoint_step"] == 2 and fig["resumed_steps"] == [2, 3]
    assert fig["tensors_compared"] > 0
    assert "identical" in out


@pytest.mark.slow
def test_custom_source_runs_a_users_node_the_same_in_both_runtimes(root):
    """Run as a script, as a user would: rpc role processes import the node factory from it."""
    proc = subprocess.run([sys.executable, str(TUTORIALS / "custom_source.py"), "--scale", "test", "--root", root,
                           "--steps", "4"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "4 steps, the same in both runtimes" in proc.stdout
    assert "'chat': " in proc.stdout and "'notes': " in proc.stdout and "'code': " in proc.stdout
    assert "resumed the rpc loader at step 2" in proc.stdout


def test_elastic_resume_continues_at_another_mesh_with_nothing_lost_or_repeated(root, capsys):
    fig = run("elastic_resume", root, "--steps", "5", "--save-at", "2")
    out = capsys.readouterr().out
    assert fig["ok"] and "nothing lost or repeated" in out
    assert any(c.startswith("mesh: saved pp=1 dp=4") for c in fig["changes"])
    assert any(c.startswith("global_batch: saved 32, now 24") for c in fig["changes"])
    assert sum(fig["before"].values()) == 2 * 32 and sum(fig["after"].values()) == 3 * 24
