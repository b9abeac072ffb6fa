"""A test helper for speculative proposers that draft from the target's hidden states
(engine/eagle.py): every proposal a drafter makes, with the request's tokens at that moment."""

from __future__ import annotations


def record_drafts(drafter) -> list[tuple[list[int], list[int]]]:
    """Wraps `drafter.propose_for` so each of its proposals is kept: (the request's prompt and
    output tokens when it drafted, its drafts), in order. Returns that list, filled as the
    engine drafts."""
    seen: list[tuple[list[int], list[int]]] = []
    propose = drafter.propose_for

    def recording(wanted):
        propose(wanted)
        for req, got in drafter.proposals.items():
            seen.append((req.prompt_token_ids + req.output_token_ids, list(got)))

    drafter.propose_for = recording
    return seen
