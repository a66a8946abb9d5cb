"""The rpc fork server freezes what its preloads made before it forks a worker (runtime/_fork_freeze.py),
so the workers' collections never walk, and never copy, the pages of torch's objects."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import gc, multiprocessing as mp, sys
    import torchdata_overlord.runtime._fork_freeze          # not in a fork server: freezes nothing
    assert gc.get_freeze_count() == 0, gc.get_freeze_count()
    from torchdata_overlord.runtime import rpc_session
    rpc_session.prestart_fork_server()
    ctx = mp.get_context("forkserver")
    # in a worker, before it does anything: the preloaded modules' objects are frozen (not in any generation)
    check = ("import gc, sys, torch; fn = torch.nn.functional.relu; "
             "sys.exit(0 if gc.get_freeze_count() > 10000 and not any(o is fn for o in gc.get_objects()) else 3)")
    p = ctx.Process(target=exec, args=(check, {}))
    p.start()
    p.join(120)
    print("child exit", p.exitcode)
    sys.exit(0 if p.exitcode == 0 else 1)
""")


def test_fork_server_workers_start_with_the_preloads_frozen():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "child exit 0" in proc.stdout
