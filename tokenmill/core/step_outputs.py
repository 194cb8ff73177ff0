"""A request's share of a step's result: its sampled tokens appended up to its stop
condition, and the ``EngineCoreOutput`` the front end gets for them. Torch-free."""

from __future__ import annotations

from tokenmill.core.engine_io import EngineCoreOutput
from tokenmill.core.model_runner_output import ModelRunnerOutput
from tokenmill.core.request import Request
from tokenmill.core.stop_conditions import append_until_stop


def request_step_output(
    request: Request, step_tokens: list[int], runner: ModelRunnerOutput, max_context_len: int
) -> tuple[EngineCoreOutput | None, bool]:
    """Append ``step_tokens`` (the step's sampled tokens of ``request``: one, or the accepted
    drafts and a bonus token) until a stop condition, and build the request's output.

    Returns:
        ``(output, constraint_failed)``: the output, None when the step gave the request no
        token, no prompt logprobs and did not finish it; whether its grammar refused a
        token (the request then finishes with nothing appended).
    """
    new_token_ids = append_until_stop(request, step_tokens, max_context_len)
    constraint_failed = new_token_ids is None
    new_token_ids = new_token_ids or []
    req_id = request.request_id
    prompt_logprobs = runner.prompt_logprobs.get(req_id)
    if not (new_token_ids or request.is_finished() or prompt_logprobs):
        return None, constraint_failed
    logprobs = runner.logprobs.get(req_id)
    return EngineCoreOutput(
        request_id=req_id,
        new_token_ids=new_token_ids,
        new_logprobs=(
            logprobs.slice(0, len(new_token_ids)) if logprobs is not None and new_token_ids
            else None
        ),
        new_prompt_logprobs=prompt_logprobs,
        finish_reason=request.get_finished_reason(),
        stop_reason=request.stop_reason,
        num_cached_tokens=max(0, request.num_cached_tokens),
    ), constraint_failed  # fmt: skip
