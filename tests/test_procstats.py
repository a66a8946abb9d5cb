"""``runtime.procstats``: what /proc says of a live process, a zombie and a reaped one."""

import os
import subprocess
import sys

from torchdata_overlord.runtime.procstats import process_memory, process_running


def test_process_running_tells_live_zombie_and_gone_apart():
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        assert process_running(proc.pid)
        mem = process_memory(proc.pid)
        assert mem["pid"] == proc.pid and mem["rss_mib"] > 0 and mem["pss_mib"] > 0
        proc.stdin.close()                                       # the child reads EOF and exits
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)   # exited, not reaped: a zombie
        assert not process_running(proc.pid)
    finally:
        proc.wait(timeout=30)
    assert not process_running(proc.pid)                         # reaped: no /proc entry
    assert process_memory(proc.pid)["rss_mib"] is None
