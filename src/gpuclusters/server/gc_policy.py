"""The server process's garbage-collector settings.

CPython's cyclic collector walks every tracked object in its oldest
generation on a full collection. A server's heap is mostly objects that
live as long as the process: the modules (FastAPI, pydantic's schemas,
SQLAlchemy's mappers, the Kubernetes client's models: 160,000 objects
after the imports alone) and what startup builds. A full collection walked
all of them every few seconds under load and found almost nothing to free:
on the control-plane bench, **150-177 ms with the event loop stopped**,
every 5-10 s, freeing about a thousand objects each time. Every API request
that arrived meanwhile waited that long, which was the whole of the API's
p99 (p50 10-25 ms, p99 160-230 ms).

So, once startup is done (``after_startup``, called by the lifespan of the
server process):

* ``gc.collect()`` then ``gc.freeze()``: what exists now is moved to the
  permanent generation, which collections no longer walk. Only live objects
  are frozen (the collection runs first); one that dies later is still
  freed by its reference count, and a cycle among frozen objects is kept
  until exit, which for objects made at startup is the same thing;
* the youngest generation is collected every ``GEN0_THRESHOLD``
  allocations instead of 700: the ORM makes and drops thousands of objects
  per request or step, and most die by reference count before any
  collection would see them, so fewer, larger young collections do the
  same work with less overhead (CPython 3.13 raised the default for the
  same reason).

Tests that build apps in-process do not call it: freezing a test session's
heap would keep every earlier test's garbage.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)

GEN0_THRESHOLD = 7000


def after_startup() -> None:
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, gen1, gen2)
    log.info(
        "garbage collector: %d objects frozen after startup (%.0f ms); young collections every"
        " %d allocations",
        gc.get_freeze_count(),
        (time.perf_counter() - started) * 1000,
        GEN0_THRESHOLD,
    )
