"""The one thread that runs every llama.cpp pass in this process, whichever thread asks for it.

llama-cpp-python builds llama.cpp's CPU backend with OpenMP, which gives each thread that calls llama_decode a
team of worker threads of its own. Once the teams' threads outnumber the CPUs, libgomp stops spinning at the
barrier between a graph's nodes and sleeps there instead (its "throttled" spin count), and every pass takes longer:
1.35x as long on a 2-core CPU once two threads had each decoded (docs/bench/compute-thread.md). The server has a
worker thread per slot and loads the model on another, so all their passes come here.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Callable, TypeVar

T = TypeVar("T")

_here = threading.local()
_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="edgespec-compute",
                                              initializer=lambda: setattr(_here, "compute", True))


def run(fn: Callable[..., T], *args: object) -> T:
    """fn(*args) on the compute thread. The caller waits for it to end, also when it is interrupted (a Ctrl-C):
    a pass cannot stop half-way, and what the caller does next must see the cache as the pass left it."""
    if getattr(_here, "compute", False):
        return fn(*args)
    future = _pool.submit(fn, *args)
    try:
        return future.result()
    except BaseException:
        concurrent.futures.wait([future])
        raise
