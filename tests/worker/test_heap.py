"""`freeze_start_up_objects` (worker.heap): start-up's garbage is collected, what is left is
frozen out of the collector's sight, and what requests make afterwards is still collected. Run
in a process of its own: freezing this one would keep the test session's cycles forever."""

from __future__ import annotations

import subprocess
import sys

PROGRAM = """
import gc, weakref
from serverless_llm.worker.heap import freeze_start_up_objects

class Node:
    pass

def cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)

kept = [Node() for _ in range(1000)]
garbage = cycle()  # start-up's garbage: collected before the freeze, not frozen
frozen = freeze_start_up_objects()
assert garbage() is None, "start-up garbage was frozen"
assert frozen == gc.get_freeze_count() and frozen >= 1000, frozen
tracked = len(gc.get_objects())
assert tracked < frozen, (tracked, frozen)  # the collector no longer walks them
later = cycle()  # a request's cycle: still collected
gc.collect()
assert later() is None, "a cycle made after the freeze was not collected"
print("ok", frozen, tracked)
"""


def test_freeze_collects_first_then_hides_start_up_objects():
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok ")
