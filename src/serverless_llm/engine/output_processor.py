"""A request's output side: for each token the step's update appends, the sampling state,
logprobs, grammar, released text and stop strings (the stop rule itself is stop_rule.py), and
the `EngineOutput` the caller gets."""

from __future__ import annotations

import logging

from .outputs import EngineOutput
from .request import FinishReason, Request
from .sampling.logprobs import TokenLogprob
from .stop_rule import Stop

logger = logging.getLogger(__name__)


def process_token(
    req: Request, tok: int, lp: TokenLogprob | None, stop: Stop | None
) -> tuple[str, Stop | None]:
    """The output side of one token the step's update has appended to `req`: sampling state,
    logprobs, the grammar, the text it releases and stop strings. `stop` is the stop rule's
    verdict on the token; returns the text and the final verdict (a grammar that ends or
    refuses the token, or a stop string, ends the request too)."""
    p = req.params
    rule = req.stop_rule
    num_out = len(req.output_token_ids)
    req.sampling.on_token(tok)
    if lp is not None:
        req.out.logprobs.append(lp)
        req.out.cumulative_logprob += lp.logprob
    if req.grammar is not None:
        if req.grammar_open:
            ended = _advance_grammar(req, tok, stop is not None and stop.by_token)
            if ended is not None:
                stop = ended
        else:
            after = p.structured_after
            req.grammar_open = req.output_token_ids[-len(after) :] == list(after)
    by_token = stop is not None and stop.by_token
    # The text of the token that stopped the request is not output (vLLM), unless asked.
    text = "" if by_token and not p.include_stop_str_in_output else None
    if text is None:
        text = req.out.detokenizer.add([tok])
    if stop is not None:
        # An output that ends inside a multi-byte character still shows what it has.
        text += req.out.detokenizer.flush()
    matcher = req.out.stop_matcher
    if matcher is not None:
        if by_token:
            text = matcher.flush() + text
        else:
            text, hit = matcher.feed(text, active=rule.strings_active(num_out))
            if hit is not None:
                stop = rule.check(tok, num_out, stop_string=hit)
            elif stop is not None:
                text += matcher.flush()
    if text:
        req.out.text_chunks.append(text)
    return text, stop


def _advance_grammar(req: Request, tok: int, stopped: bool) -> Stop | None:
    """Moves the request's grammar past `tok` (already a stop token when `stopped`); a token the
    grammar refuses, or the grammar's own end, ends the request."""
    if stopped:
        req.grammar.accept_token(tok)
        return None
    if not req.grammar.accept_token(tok):
        logger.warning(
            "request %s: token %d breaks its grammar (another constraint disagreed); finishing it",
            req.request_id,
            tok,
        )
        return Stop(FinishReason.STOP, None, by_token=True)
    if req.grammar.is_terminated():  # the grammar's stop token: the output is complete
        stop_reason = tok if tok in req.params.stop_token_ids else None
        return Stop(FinishReason.STOP, stop_reason, by_token=True)
    return None


def make_output(
    req: Request,
    new_ids: list[int],
    text: str,
    logprobs: list[TokenLogprob] | None = None,
) -> EngineOutput:
    """What the caller sees of `req` after a step: its new tokens and text, and once, with the
    first token, its prompt logprobs."""
    finished = req.finished
    prompt_logprobs = None
    out = req.out
    if out.prompt_logprobs is not None and not out.prompt_logprobs_sent and new_ids:
        prompt_logprobs = out.prompt_logprobs
        out.prompt_logprobs_sent = True
    return EngineOutput(
        request_id=req.request_id,
        new_token_ids=new_ids,
        new_text=text,
        finished=finished,
        finish_reason=req.finish_reason.value if finished and req.finish_reason else None,
        stop_reason=req.stop_reason,
        num_prompt_tokens=req.num_prompt_tokens,
        num_output_tokens=len(req.output_token_ids),
        logprobs=logprobs,
        cumulative_logprob=out.cumulative_logprob,
        prompt_logprobs=prompt_logprobs,
        times=req.times,
    )
