"""``use_beam_search`` on completions and chat (vLLM's request fields): the request's
checks and its ``BeamSearchParams``.

As in vLLM, ``n`` is the beam width and every beam is returned as a choice, best first;
``length_penalty`` and ``early_stopping`` shape the search (``tokenmill.core.beam_search``).
Beam search is deterministic: ``temperature``, ``top_p``, ``top_k``, ``min_p`` and ``seed``
have no effect on it (nor do they in vLLM). Fields whose effect it cannot give are refused.
"""

from __future__ import annotations

from typing import Any

from tokenmill.entrypoints.openai.errors import bad_request
from tokenmill.entrypoints.openai.protocol import SamplingFields
from tokenmill.entrypoints.openai.structured_outputs import structured_outputs_of
from tokenmill.sampling_params import BeamSearchParams, SamplingParamsError

# Request fields whose meaning beam search cannot honour: (field, value that is harmless).
_REFUSED: tuple[tuple[str, Any], ...] = (
    ("best_of", None),
    ("echo", False),
    ("prompt_logprobs", None),
    ("stop_token_ids", None),
    ("presence_penalty", 0.0),
    ("frequency_penalty", 0.0),
    ("repetition_penalty", 1.0),
    ("logit_bias", None),
    ("allowed_token_ids", None),
    ("bad_words", None),
    ("min_tokens", 0),
    ("tools", None),  # chat: calls forced by a grammar, or parsed from one sampled answer
)


def check_beam_search_request(request: SamplingFields) -> None:
    """Raise a 400 naming the first field that cannot go with ``use_beam_search``.

    Raises:
        OpenAIError: ``stream`` (the beams are known only when the search ends), stop
            strings, logprobs, ``echo``, ``best_of``, penalties, logit bias, allowed or
            banned tokens, ``min_tokens``, ``tools`` or an output constraint.
    """
    if request.stream:
        raise bad_request(
            "use_beam_search cannot be used with stream: the beams are known only when the "
            "search ends.",
            "stream",
        )
    if request.stop:
        raise bad_request("stop strings cannot be used with use_beam_search.", "stop")
    logprobs = getattr(request, "logprobs", None)
    if logprobs not in (None, False):
        raise bad_request("logprobs cannot be used with use_beam_search.", "logprobs")
    for name, harmless in _REFUSED:
        value = getattr(request, name, harmless)
        if value not in (harmless, None) and value != [] and value != {}:
            raise bad_request(f"{name} cannot be used with use_beam_search.", name)
    if structured_outputs_of(request) is not None:
        raise bad_request(
            "an output constraint cannot be used with use_beam_search.", "structured_outputs"
        )


def beam_search_params(request: SamplingFields, max_tokens: int) -> BeamSearchParams:
    """The request's beam search: width ``n``, at most ``max_tokens`` tokens per beam.

    Raises:
        OpenAIError: 400 naming the field that is out of range.
    """
    try:
        return BeamSearchParams(
            beam_width=request.n if request.n is not None else 1,
            max_tokens=max_tokens,
            ignore_eos=request.ignore_eos,
            temperature=request.temperature if request.temperature is not None else 0.0,
            length_penalty=request.length_penalty,
            include_stop_str_in_output=request.include_stop_str_in_output,
            early_stopping=request.early_stopping,
        )
    except SamplingParamsError as e:
        param = "n" if e.param == "beam_width" else e.param
        raise bad_request(str(e).replace("beam_width", "n (the beam width)", 1), param) from None
