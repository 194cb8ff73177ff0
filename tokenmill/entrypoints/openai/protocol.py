"""Request and response models of the OpenAI-compatible API (pydantic).

Field names, types and defaults follow the OpenAI API reference for chat completions and
(legacy) completions, plus the extra sampling fields vLLM accepts (``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``priority``...),
so clients written for either keep working. Requests are validated strictly (``"5"`` is not an
integer, ``"yes"`` is not a boolean); unknown fields are ignored, as the OpenAI API does. The
bounds ``SamplingParams`` enforces are declared on the fields too, so the OpenAPI document
carries them (rules across fields, such as ``best_of >= n``, are checked after).
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tokenmill.entrypoints.openai.protocol_tools import (
    ChatCompletionToolsParam,
    DeltaToolCall,
    ToolCall,
    ToolCallParam,
)
from tokenmill.sampling_params import INT64_MAX, INT64_MIN, MAX_BAD_WORDS, MAX_N, MAX_STOP_STRINGS

# Field bounds, as SamplingParams checks them.
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
NumSequences = Annotated[int, Field(ge=1, le=MAX_N)]
LogprobCount = Annotated[int, Field(ge=-1, description="-1: the whole vocabulary")]
TokenId = Annotated[int, Field(ge=0)]
Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]


def _items(most: int | None, least: int = 0) -> Any:
    """A list's length bounds, for the document only: SamplingParams checks them with its
    own messages."""
    extra: dict[str, Any] = {"minItems": least} if least else {}
    if most is not None:
        extra["maxItems"] = most
    return Field(json_schema_extra=extra)


TruncateTokens = Annotated[
    int, Field(ge=-1, description="-1: as many as leave room for max_tokens; not 0")
]


def random_id(prefix: str) -> str:
    """A unique id such as ``chatcmpl-3f2a...`` (32 hex digits)."""
    return f"{prefix}-{uuid.uuid4().hex}"


logger = logging.getLogger(__name__)


class OpenAIBaseModel(BaseModel):
    """Base of every request model: strict types, unknown fields ignored with a warning in
    the log (as vLLM's: a client's misspelt or misplaced field is then visible)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _log_ignored_fields(cls, data: Any) -> Any:
        if isinstance(data, dict) and cls.model_config.get("extra") != "allow":
            known = set(cls.model_fields) | {
                f.alias for f in cls.model_fields.values() if f.alias is not None
            }
            ignored = [str(k) for k in data if k not in known]
            if ignored:
                shown = ", ".join(repr(k[:40]) for k in ignored[:8])
                more = f" and {len(ignored) - 8} more" if len(ignored) > 8 else ""
                logger.warning(
                    "%s: fields present in the request but ignored: %s%s",
                    cls.__name__, shown, more,
                )  # fmt: skip
        return data


class StreamOptions(OpenAIBaseModel):
    """``stream_options``: ``include_usage`` adds a final chunk with token counts."""

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingFields(OpenAIBaseModel):
    """Sampling fields shared by chat and completions requests (None: the model's default)."""

    model: str | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    n: NumSequences | None = 1
    seed: Seed | None = None
    stop: str | Annotated[list[str], _items(MAX_STOP_STRINGS)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    user: str | None = None
    # Extra fields (vLLM's), not in the OpenAI API.
    top_k: Annotated[int, Field(ge=-1, description="-1 or 0: no top-k")] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stop_token_ids: list[TokenId] | None = None
    best_of: NumSequences | None = None
    prompt_logprobs: LogprobCount | None = None
    priority: int = 0
    # vLLM's extensions (see SamplingParams): sample only among these token ids; never
    # complete these words; keep only the prompt's last this many tokens.
    allowed_token_ids: Annotated[list[TokenId], _items(None, 1)] | None = None
    bad_words: Annotated[list[str], _items(MAX_BAD_WORDS)] | None = None
    truncate_prompt_tokens: TruncateTokens | None = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older
    # guided_* fields (see structured_outputs.structured_outputs_of).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    # vLLM's beam search: n beams, ranked by cumulative logprob over length**length_penalty.
    use_beam_search: bool | None = None
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    # With logprobs: tokens named "token_id:<id>" (None: the server's
    # --return-tokens-as-token-ids).
    return_tokens_as_token_ids: bool | None = None
    # Accepted so that they can be rejected with a clear message (not implemented):
    # ignored, they would silently change what a client asked for.
    prompt_embeds: Any = None
    logits_processors: Any = None


# vLLM's request fields that tokenmill does not implement yet (400 when given).
UNIMPLEMENTED_FIELDS = ("logits_processors", "prompt_embeds")


# ---- chat completions ------------------------------------------------------------------------


class ContentPart(OpenAIBaseModel):
    """One part of a message's content: ``{"type": "text", "text": ...}``, or for models
    that take images ``{"type": "image_url", "image_url": {"url": ...}}``."""

    model_config = ConfigDict(strict=True, extra="allow")

    type: str
    text: str | None = None
    image_url: dict[str, Any] | str | None = None


class ChatMessage(OpenAIBaseModel):
    """A message of the conversation; content is a string or a list of text parts. An
    assistant message may carry the ``tool_calls`` it made (and its ``reasoning_content``);
    a ``tool`` message answers the call ``tool_call_id``."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    # An assistant message's refusal text, as OpenAI's SDK sends a response's message back
    # in the next turn: known, not rendered (no chat template has a place for it).
    refusal: str | None = None


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions (OpenAI's request, plus vLLM's sampling extras).

    ``max_completion_tokens`` is the current name of ``max_tokens`` and wins when both are
    given; without either, the answer may fill the rest of the context.
    """

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = False
    top_logprobs: LogprobCount | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    tools: list[ChatCompletionToolsParam] | None = None
    # "none", "auto", "required" or {"type": "function", "function": {"name": ...}}: checked
    # by chat_tools.plan_tool_calls, whose 400 says which forms there are.
    tool_choice: Any = None
    parallel_tool_calls: bool | None = True
    # Accepted so that they can be rejected with a clear message (not implemented).
    functions: Any = None  # OpenAI's legacy tool calling
    function_call: Any = None
    echo: Any = None  # vLLM's: prepend the last message to the answer
    # Refused: the server's template (--chat-template, or the model's) applies.
    chat_template: Any = None
    # Extra fields (vLLM's).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's reasoning effort, handed to the chat template as its ``reasoning_effort``
    # variable (gpt-oss' template writes it into the system message); a 400 for a template
    # that does not read it.
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    # Refused: the image processor's arguments are the server's (--mm-processor-kwargs).
    mm_processor_kwargs: Any = None


class ChatCompletionLogProb(BaseModel):
    """The log-probability of one token: its text, natural-log probability and UTF-8 bytes."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    """An output position: the chosen token plus the most likely alternatives."""

    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(BaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatCompletionMessage(BaseModel):
    role: str
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    # The thinking before the answer, split off by --reasoning-parser (vLLM's field).
    reasoning_content: str | None = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatCompletionMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    # The stop string or stop token id that ended the answer (vLLM's extra field).
    stop_reason: int | str | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    """Token counts of a request: prompt, generated (all choices) and their sum."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    # vLLM's extension, as in completions: per prompt position, {token id: {"logprob",
    # "rank", "decoded_token"}}, None for the first.
    prompt_logprobs: list[dict[int, dict[str, Any]] | None] | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


# ---- completions -----------------------------------------------------------------------------


class CompletionRequest(SamplingFields):
    """POST /v1/completions (OpenAI's legacy completions, plus vLLM's sampling extras).

    ``prompt`` is a string, a list of strings, a list of token ids or a list of token-id
    lists; each prompt yields ``n`` choices (index ``prompt_index * n + i``). ``max_tokens``
    defaults to 16 as in the OpenAI API; ``null`` lets the answer fill the context.
    """

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    logprobs: LogprobCount | None = None
    max_tokens: Annotated[int, Field(ge=0, description="0 only with echo")] | None = 16
    suffix: str | None = None


class CompletionLogProbs(BaseModel):
    """Legacy logprobs: one entry per token of ``text`` (``text_offset`` in characters)."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # vLLM's extension for ``prompt_logprobs``: per prompt position, {token id: {"logprob",
    # "rank", "decoded_token"}} (None for the first token); only in a choice's first chunk.
    prompt_logprobs: list[dict[int, dict[str, Any]] | None] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# ---- embeddings ------------------------------------------------------------------------------


class EmbeddingRequest(OpenAIBaseModel):
    """POST /v1/embeddings (OpenAI's request, plus vLLM's ``truncate_prompt_tokens``).

    ``input`` is a string, a list of strings, a list of token ids or a list of token-id
    lists. ``encoding_format`` "base64" returns each vector as the base64 of its
    little-endian float32 bytes.
    """

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None
    # Extra fields (vLLM's).
    truncate_prompt_tokens: TruncateTokens | None = None
    add_special_tokens: bool = True


class EmbeddingData(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    """Token counts of an embedding request (every input token is a prompt token)."""

    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


# ---- models, tokenizer -----------------------------------------------------------------------


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tokenmill"
    root: str | None = None
    # A LoRA adapter's base model (vLLM's field); None for the base model itself.
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(OpenAIBaseModel):
    """POST /tokenize: a text ``prompt``, or chat ``messages`` rendered with the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    """POST /detokenize: token ids -> text."""

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The body of every error: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo
