"""When a request stops: the finished status a newly generated token puts it in.

Torch-free: token ids and counts only.
"""

from __future__ import annotations

import logging

from tokenmill.core.engine_io import CONSTRAINT_FAILURE_PREFIX
from tokenmill.core.request import Request, RequestStatus

logger = logging.getLogger(__name__)


def stop_status(request: Request, token_id: int, max_context_len: int) -> RequestStatus | None:
    """The finished status ``token_id`` (just appended) puts the request in, if any.

    A request with structured outputs also advances its grammar: it stops once the grammar
    is complete, and is aborted by a token the grammar does not allow (which the sampler's
    mask rules out). EOS and stop tokens end it once ``min_tokens`` are generated; so do
    ``max_tokens`` and ``max_context_len`` (the most tokens a request may reach).
    """
    params = request.sampling_params
    grammar = request.grammar
    if grammar is not None and not grammar.accept(token_id):
        logger.warning("request %s: token %d breaks its grammar", request.request_id, token_id)
        # The sampler only lifts the grammar's mask when it allows no token at all.
        request.stop_reason = (
            f"{CONSTRAINT_FAILURE_PREFIX} the constraint admits no token after "
            f"{request.num_output_tokens - 1} generated (it may admit no output at all)."
        )
        return RequestStatus.FINISHED_ABORTED
    if token_id in request.eos_and_stop_ids and request.num_output_tokens >= params.min_tokens:
        request.stop_reason = token_id if token_id in (params.stop_token_ids or ()) else None
        return RequestStatus.FINISHED_STOPPED
    if grammar is not None and grammar.is_complete:
        return RequestStatus.FINISHED_STOPPED
    if request.max_tokens is not None and request.num_output_tokens >= request.max_tokens:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    if request.num_tokens >= max_context_len:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None


def append_until_stop(
    request: Request, token_ids: list[int], max_context_len: int
) -> list[int] | None:
    """Append sampled tokens to ``request`` one at a time until one ends it (its status set
    by ``stop_status``).

    Returns:
        The tokens kept (those after a stop are dropped); None when the request's grammar
        had failed while its mask was filled (the tokens were drawn without the mask): the
        request is then aborted with the failure as its stop reason and keeps no token.
    """
    grammar = request.grammar
    if token_ids and grammar is not None and grammar.failure is not None:
        request.stop_reason = f"{CONSTRAINT_FAILURE_PREFIX} {grammar.failure}"
        request.status = RequestStatus.FINISHED_ABORTED
        return None
    kept: list[int] = []
    for token_id in token_ids:
        request.append_output_token_ids([token_id])
        kept.append(token_id)
        status = stop_status(request, token_id, max_context_len)
        if status is not None:
            request.status = status
            break
    return kept
