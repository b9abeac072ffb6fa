"""A request's way out: each sampled token appended, the end decided (EOS, stop tokens, the
grammar, stop strings, length: vLLM's rules), the text it releases decoded, and the
`EngineOutput` the caller gets."""

from __future__ import annotations

import logging

from .outputs import EngineOutput
from .request import FinishReason, Request
from .sampling.logprobs import TokenLogprob

logger = logging.getLogger(__name__)


def process_token(
    req: Request, tok: int, lp: TokenLogprob | None, eos_token_ids: set[int]
) -> tuple[str, FinishReason | None]:
    """Appends a sampled token to `req` and returns the text it releases and the reason the
    request ends, if it does (the caller finishes it in the scheduler)."""
    p = req.params
    req.output_token_ids.append(tok)
    req.sampling.on_token(tok)
    if lp is not None:
        req.logprobs.append(lp)
        req.cumulative_logprob += lp.logprob
    num_out = len(req.output_token_ids)
    reason: FinishReason | None = None
    # EOS and stop tokens count once min_tokens are out (they are masked before that).
    if num_out >= p.min_tokens:
        if not p.ignore_eos and tok in eos_token_ids:
            reason = FinishReason.STOP
        elif tok in p.stop_token_ids:
            reason = FinishReason.STOP
            req.stop_reason = tok
    if req.grammar is not None:
        if req.grammar_open:
            reason = _advance_grammar(req, tok, reason)
        else:
            after = p.structured_after
            req.grammar_open = req.output_token_ids[-len(after) :] == list(after)
    stopped_by_token = reason is not None
    # The text of the token that stopped the request is not output (vLLM), unless asked.
    text = "" if stopped_by_token and not p.include_stop_str_in_output else None
    if text is None:
        text = req.detokenizer.add([tok])
    if reason is None and req.num_tokens >= req.max_total_tokens:
        reason = FinishReason.LENGTH
    if reason is not None:
        # An output that ends inside a multi-byte character still shows what it has.
        text += req.detokenizer.flush()
    matcher = req.stop_matcher
    if matcher is not None:
        if stopped_by_token:
            text = matcher.flush() + text
        else:
            text, hit = matcher.feed(text, active=num_out >= p.min_tokens)
            if hit is not None:
                reason = FinishReason.STOP
                req.stop_reason = hit
            elif reason is not None:
                text += matcher.flush()
    if text:
        req.text_chunks.append(text)
    if reason is not None:
        req.finish_reason = reason
    return text, reason


def _advance_grammar(req: Request, tok: int, reason: FinishReason | None) -> FinishReason | None:
    """Moves the request's grammar past `tok`; a token the grammar refuses, or the grammar's
    own end, finishes the request."""
    if reason is not None:
        req.grammar.accept_token(tok)
        return reason
    if not req.grammar.accept_token(tok):
        logger.warning(
            "request %s: token %d breaks its grammar (another constraint disagreed); finishing it",
            req.request_id,
            tok,
        )
        return FinishReason.STOP
    if req.grammar.is_terminated():  # the grammar's stop token: the output is complete
        if tok in req.params.stop_token_ids:
            req.stop_reason = tok
        return FinishReason.STOP
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
    if req.prompt_logprobs is not None and not req.prompt_logprobs_sent and new_ids:
        prompt_logprobs = req.prompt_logprobs
        req.prompt_logprobs_sent = True
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
        cumulative_logprob=req.cumulative_logprob,
        prompt_logprobs=prompt_logprobs,
    )
