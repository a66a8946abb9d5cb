"""``runtime.procstats``: what /proc says of a live process, a zombie and a reaped one."""

import os
import subprocess
import sys

from torchdata_overlord.runtime.procstats import process_memory, process_running, smaps_rollup


def test_process_running_tells_live_zombie_and_gone_apart():
    proc = subprocess.Popen([sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "up\n"                  # its interpreter runs (not mid-exec)
        assert process_running(proc.pid)
        mem = process_memory(proc.pid)
        assert mem["pid"] == proc.pid and mem["rss_mib"] > 0 and mem["pss_mib"] > 0
        fields = smaps_rollup(proc.pid)
        assert fields["Pss_Anon"] > 0 and fields["Pss"] >= fields["Pss_Anon"] and fields["Rss"] >= fields["Pss"]
        proc.stdin.close()                                       # the child reads EOF and exits
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)   # exited, not reaped: a zombie
        assert not process_running(proc.pid)
    finally:
        if proc.returncode is None and not proc.stdin.closed:   # an assertion failed above: end it
            proc.kill()
        proc.wait(timeout=30)
    assert not process_running(proc.pid)                         # reaped: no /proc entry
    assert process_memory(proc.pid)["rss_mib"] is None and smaps_rollup(proc.pid) is None
