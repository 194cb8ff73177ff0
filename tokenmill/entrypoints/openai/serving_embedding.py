"""POST /v1/embeddings: OpenAI's embeddings API over the embedding engine.

Inputs (a string, strings, token ids or lists of token ids) are tokenized and validated
here, all before any is run, so a bad input fails the whole request with a 400 naming it;
the engine then embeds them with whatever other requests are in flight. Vectors are
returned as JSON floats or, with ``encoding_format: "base64"``, as the base64 of their
little-endian float32 bytes (what the OpenAI SDK asks for by default).
"""

from __future__ import annotations

import base64
import time
from http import HTTPStatus
from typing import TYPE_CHECKING

import numpy as np
from fastapi import Request
from fastapi.responses import Response

from tokenmill.entrypoints.openai.errors import OpenAIError, bad_request, model_not_found
from tokenmill.entrypoints.openai.protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    UsageInfo,
    random_id,
)
from tokenmill.entrypoints.openai.serving_engine import RequestLogger, to_openai_error

if TYPE_CHECKING:
    from tokenmill.engine.embedding_engine import AsyncEmbeddingEngine

# The most inputs one request may carry (the OpenAI API's limit).
MAX_INPUTS = 2048


def encode_base64(embedding: list[float]) -> str:
    """A vector as OpenAI's base64 encoding: little-endian float32 bytes, base64."""
    return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")


def not_generative(model_name: str) -> OpenAIError:
    """The 400 for a text-generation route on a server that serves an embedding model."""
    return bad_request(
        f"The model `{model_name}` is an embedding model: it does not generate text. Use "
        "POST /v1/embeddings.",
        "model",
        code="model_not_generative",
    )


class OpenAIServingEmbedding:
    """Serves /v1/embeddings (and tokenization) for an embedding model.

    Args:
        engine: the running AsyncEmbeddingEngine.
        request_logger: logs arrivals and finishes; None disables request logs.
    """

    def __init__(
        self, engine: AsyncEmbeddingEngine, request_logger: RequestLogger | None = None
    ) -> None:
        self.engine = engine
        self.model_config = engine.model_config
        self.model_name = engine.model_config.served_model_name
        self.tokenizer = engine.get_tokenizer()
        self.request_logger = request_logger

    def check_model(self, model: str | None) -> None:
        """Raises a 404 OpenAIError unless ``model`` is None or one of the served names."""
        if model is not None and model not in self.model_config.served_model_names:
            raise model_not_found(model)

    def render_prompt(self, messages: object, request: object) -> list[int]:
        """Embedding models have no chat template: /tokenize with messages is a 400."""
        raise bad_request(
            f"The model `{self.model_name}` is an embedding model and has no chat template; "
            "tokenize a prompt instead.",
            "messages",
        )

    def _tokenize_inputs(self, request: EmbeddingRequest) -> list[list[int]]:
        """Token ids of every input of the request, validated.

        Raises:
            OpenAIError: 400 for no input, too many inputs, or an input that is empty, too
                long or outside the vocabulary (``param`` names it, e.g. ``input[2]``).
        """
        inputs = request.input
        if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
            inputs = [inputs]  # type: ignore[list-item]
        if not inputs:
            raise bad_request("input must not be empty.", "input")
        if len(inputs) > MAX_INPUTS:
            raise bad_request(
                f"input has {len(inputs)} items; at most {MAX_INPUTS} are allowed.", "input"
            )
        front = self.engine.front_end
        try:
            return [
                front.tokenize(
                    item,
                    request.truncate_prompt_tokens,
                    request.add_special_tokens,
                    param="input" if len(inputs) == 1 else f"input[{i}]",
                )
                for i, item in enumerate(inputs)
            ]
        except ValueError as e:
            raise to_openai_error(e) from None

    async def create_embedding(self, request: EmbeddingRequest, raw_request: Request) -> Response:
        """Handle one POST /v1/embeddings.

        Raises:
            OpenAIError: 404 for another model's name; 400 for invalid inputs or an
                unsupported ``dimensions``; 503 when the engine is shut down; 500 when
                the forward pass fails.
        """
        self.check_model(request.model)
        start = time.monotonic()
        request_id = random_id("embd")
        token_ids = self._tokenize_inputs(request)
        try:
            self.engine.front_end.check_dimensions(request.dimensions)
        except ValueError as e:
            raise to_openai_error(e) from None
        if self.request_logger is not None:
            prompt = request.input if isinstance(request.input, str) else None
            self.request_logger.log_arrival(
                request_id,
                prompt,
                token_ids[0],
                f"dimensions={request.dimensions}, "
                f"encoding_format={request.encoding_format}, inputs={len(token_ids)}, "
                f"truncate_prompt_tokens={request.truncate_prompt_tokens}",
            )
        try:
            pooled = await self.engine.embed(token_ids)
        except Exception as e:
            error = to_openai_error(e)
            if error.status == HTTPStatus.BAD_REQUEST:  # not the client's fault here
                error = OpenAIError(error.message, HTTPStatus.INTERNAL_SERVER_ERROR)
            raise error from None
        data = []
        for i, row in enumerate(pooled):
            vector = self.engine.front_end.postprocess(row, request.dimensions)
            encoded = encode_base64(vector) if request.encoding_format == "base64" else vector
            data.append(EmbeddingData(index=i, embedding=encoded))
        num_tokens = sum(len(ids) for ids in token_ids)
        response = EmbeddingResponse(
            id=request_id,
            model=self.model_name,
            data=data,
            usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
        )
        if self.request_logger is not None:
            usage = UsageInfo(prompt_tokens=num_tokens, total_tokens=num_tokens)
            self.request_logger.log_finish(request_id, ["embedded"], usage, start)
        return Response(response.model_dump_json(), media_type="application/json")
