"""The interpreter's heap after start-up: out of the cyclic collector's sight.

A full collection walks every object the collector tracks. After the model has loaded that is
millions of them (the modules of torch and transformers, the tokenizer, the model's own), and a
full collection takes about half a second on a 2-core machine, holding the interpreter lock:
the event loop, `/health` and every stream stop meanwhile. Requests set collections off by
allocating: parsing a 4 MB body of small JSON values makes ~150,000 containers, enough for a
full collection. `freeze_start_up_objects` moves what start-up built to the permanent
generation (`gc.freeze`), so later collections walk only what requests made (milliseconds).
Those objects are still freed by reference counting; only a cycle among them would stay,
which is the price: start-up's objects live as long as the worker anyway.

Called by the process entry points (`python -m serverless_llm.worker`, the local endpoint)
once the model has loaded, not by `Worker.load`: a test process builds many workers, and must
be able to collect them.
"""

from __future__ import annotations

import gc

__all__ = ["freeze_start_up_objects"]


def freeze_start_up_objects() -> int:
    """Collects start-up's garbage, then freezes what is left; returns the objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
