"""CPU priority of the server's background work: compiles, loading compiled grammars, warm-ups.

The step path runs at the process's own priority; work that is not on it lowers its own, so that on
a core it shares with the step path it takes only what the step path leaves.
"""
from __future__ import annotations

import os
import sys
import threading

LOWEST = 19     # the nice value of the lowest priority


def lower_priority(nice: int = LOWEST, thread: bool = False) -> None:
    """This process (``thread``: only the calling thread; on Linux a thread has its own nice value,
    and the threads it starts inherit it) at CPU priority ``nice`` (0: as it is, 19: the lowest):
    background work then runs on what the step path leaves. Best effort: where the system refuses,
    it runs as it is."""
    if nice <= 0:
        return
    try:
        if thread and hasattr(threading, "get_native_id") and sys.platform.startswith("linux"):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        elif not thread:
            os.setpriority(os.PRIO_PROCESS, 0, nice)
    except (OSError, AttributeError):
        pass
