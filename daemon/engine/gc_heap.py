"""Python's cyclic garbage collector in the engine's processes. A collection of the oldest generation walks every
container object the process holds, and at start-up those are most of them: the model's modules and weights' holders,
the CUDA graphs and their buffers, the tokenizer, the page pool's tables. It runs on whichever thread allocates when
the thresholds trip, the engine thread among them, holding the GIL: in a served run of the 7B shape one such collection
held the engine thread 149 ms and the device waited 135 ms for its next step (`bench/step_log_report.py`'s `gc_ms`).

Once start-up is done those objects live as long as the process, so they are collected once and then frozen
(`gc.freeze`, as vLLM's engine does after its start): later collections walk only what was made since. `/v1/status`
`gc` says how many objects were frozen and how many collections of each generation ran.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)


def freeze_start_up_heap(what: str) -> int:
    """Collects, then moves every object the process now holds to the permanent generation, which collections skip.
    Call once the process has started (its model loaded, its graphs captured), never in a process that keeps making
    and dropping engines (tests): what is frozen is never collected. -> the number of objects frozen."""
    began = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%s: %d objects of start-up frozen out of Python's garbage collections (%.0f ms)", what, frozen,
             (time.perf_counter() - began) * 1e3)
    return frozen


def gc_status() -> dict:
    """For /v1/status: the objects frozen at start-up, and the collections of each generation so far."""
    return {"frozen_objects": gc.get_freeze_count(),
            "collections_by_generation": [stats["collections"] for stats in gc.get_stats()]}
