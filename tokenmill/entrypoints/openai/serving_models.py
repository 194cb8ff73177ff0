"""The served models: the base model's names and its LoRA adapters, which requests name in
``"model"`` (vLLM's ``OpenAIServingModels``), and the routes that load and unload adapters at
run time: ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``, served only when
``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is true, as in vLLM.

Errors follow vLLM's: a name or path missing, an adapter name already loaded (or the base
model's name), or a folder that cannot be served (no such folder, a rank above
``--max-lora-rank``, DoRA, ...) is a 400; unloading an unknown adapter a 404. Unloading an
adapter stops new requests from naming it at once; the requests already using it finish
with it, and the engine frees it after the last one.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from http import HTTPStatus

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel

from tokenmill.engine.async_llm import AsyncLLM
from tokenmill.entrypoints.openai.errors import OpenAIError, bad_request, model_not_found
from tokenmill.entrypoints.openai.openapi import errors
from tokenmill.entrypoints.openai.protocol import ModelCard
from tokenmill.lora.config import startup_lora_requests
from tokenmill.lora.request import LoRARequest

logger = logging.getLogger("tokenmill.entrypoints.openai.server")


class LoadLoRAAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter."""

    lora_name: str | None = None
    lora_path: str | None = None
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter."""

    lora_name: str | None = None
    lora_int_id: int | None = None


class ServingModels:
    """The names requests may give in ``"model"``, and the adapter each adapter name means.

    Args:
        engine: the running engine.
    """

    def __init__(self, engine: AsyncLLM) -> None:
        self.engine = engine
        self.model_config = engine.model_config
        self.lora_config = engine.config.lora_config
        self.adapters: dict[str, LoRARequest] = {}
        start = len(self.lora_config.lora_modules) + 1 if self.lora_config else 1
        self._ids = itertools.count(start)
        self._lock = asyncio.Lock()

    def check(self, model: str | None) -> None:
        """Raises a 404 unless ``model`` is None, a served name or an adapter's name."""
        self.lora_request(model)

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter ``model`` names; None for the base model.

        Raises:
            OpenAIError: 404, ``model`` names neither (an adapter unloaded since the request
                was checked on arrival, while its prompt was rendered).
        """
        if model is None or model in self.model_config.served_model_names:
            return None
        lora = self.adapters.get(model)
        if lora is None:
            raise model_not_found(model)
        return lora

    def cards(self) -> list[ModelCard]:
        """The base model's cards (one per served name), then one per adapter whose
        ``parent`` is its base model."""
        mc = self.model_config
        cards = [
            ModelCard(id=name, root=mc.model, max_model_len=mc.max_model_len)
            for name in mc.served_model_names
        ]
        for lora in self.adapters.values():
            parent = lora.base_model_name or mc.served_model_name
            cards.append(ModelCard(id=lora.lora_name, root=lora.lora_path, parent=parent))
        return cards

    async def load_startup_adapters(self) -> None:
        """Load the ``--lora-modules`` adapters.

        Raises:
            ValueError: one of them cannot be served (the message names it).
        """
        for lora in startup_lora_requests(self.lora_config):
            error = await self.engine.add_lora(lora)
            if error is not None:
                raise ValueError(f"--lora-modules {lora.lora_name}={lora.lora_path}: {error}")
            self.adapters[lora.lora_name] = lora

    async def load(self, request: LoadLoRAAdapterRequest) -> str:
        """Load an adapter; returns the success message.

        Raises:
            OpenAIError: 400 (see the module docstring).
        """
        name, path = request.lora_name, request.lora_path
        if not name or not path:
            raise bad_request(
                "Both 'lora_name' and 'lora_path' must be provided.",
                "lora_path" if name else "lora_name",
            )
        if self.lora_config is None:
            raise bad_request("LoRA is not enabled: start the server with --enable-lora.")
        if name in self.model_config.served_model_names:
            raise bad_request(
                f"'{name}' is the base model's name.", "lora_name", code="InvalidUserInput"
            )
        async with self._lock:
            if name in self.adapters and not request.load_inplace:
                raise bad_request(
                    f"The lora adapter '{name}' has already been loaded.", "lora_name",
                    code="InvalidUserInput",
                )  # fmt: skip
            old = self.adapters.get(name)
            lora = LoRARequest(name, next(self._ids), path)
            error = await self.engine.add_lora(lora)
            if error is not None:
                raise bad_request(f"Failed to load the lora adapter '{name}': {error}", "lora_path")
            self.adapters[name] = lora
            if old is not None:
                await self.engine.remove_lora(old.lora_int_id)
        logger.info("Loaded LoRA adapter %s from %s", name, path)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, request: UnloadLoRAAdapterRequest) -> str:
        """Unload an adapter (its running requests finish first); returns the message.

        Raises:
            OpenAIError: 400 without a name, 404 for an adapter that is not loaded.
        """
        name = request.lora_name
        if not name:
            raise bad_request(
                "'lora_name' needs to be provided to unload a LoRA adapter.", "lora_name"
            )
        async with self._lock:
            lora = self.adapters.pop(name, None)
            if lora is None:
                raise OpenAIError(
                    f"The lora adapter '{name}' cannot be found.", HTTPStatus.NOT_FOUND,
                    "lora_name", "NotFoundError", err_type="NotFoundError",  # vLLM's type
                )  # fmt: skip
            await self.engine.remove_lora(lora.lora_int_id)
        logger.info("Unloading LoRA adapter %s once its requests finish", name)
        return f"Success: LoRA adapter '{name}' removed successfully."


lora_router = APIRouter()


@lora_router.post(
    "/v1/load_lora_adapter",
    response_class=PlainTextResponse,
    responses={200: {"description": "Loaded (a text message)."}, **errors(400)},
)
async def load_lora_adapter(request: LoadLoRAAdapterRequest, raw_request: Request) -> Response:
    models: ServingModels = raw_request.app.state.models
    return PlainTextResponse(await models.load(request))


@lora_router.post(
    "/v1/unload_lora_adapter",
    response_class=PlainTextResponse,
    responses={200: {"description": "Unloaded (a text message)."}, **errors(400, 404)},
)
async def unload_lora_adapter(request: UnloadLoRAAdapterRequest, raw_request: Request) -> Response:
    models: ServingModels = raw_request.app.state.models
    return PlainTextResponse(await models.unload(request))
