"""LoRARequest's checks and the server's adapter lookup (fast: no model)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from tokenmill.lora.request import LoRARequest


@pytest.mark.parametrize("lora_id", [0, -3, 7.5, True, 2**63, 2**64, "3"])
def test_an_id_the_engine_cannot_hold_is_refused(lora_id):
    """Ids go into the engine's int64 arrays: a float, a bool, a string or an int outside
    [1, 2**63) is refused when the request is made, not in a step."""
    with pytest.raises(ValueError, match="lora_int_id must be an int from 1 to 2\\*\\*63 - 1"):
        LoRARequest("a", lora_id, "/x")


def test_the_home_folder_is_expanded():
    assert LoRARequest("a", 2**63 - 1, "~/adapters/a").lora_path == os.path.expanduser(
        "~/adapters/a"
    )


def test_an_adapter_unloaded_while_its_request_renders_is_a_404():
    """``check`` accepts the adapter on arrival; unloaded before the prompt is submitted, the
    lookup is a 404, never the base model under the adapter's name."""
    from tokenmill.entrypoints.openai.errors import OpenAIError
    from tokenmill.entrypoints.openai.serving_models import ServingModels

    engine = SimpleNamespace(
        model_config=SimpleNamespace(served_model_names=["base"]),
        config=SimpleNamespace(lora_config=None),
    )
    models = ServingModels(engine)
    models.adapters["sql"] = LoRARequest("sql", 1, "/adapters/sql")
    models.check("sql")
    assert models.lora_request("sql").lora_int_id == 1
    assert models.lora_request("base") is None and models.lora_request(None) is None
    del models.adapters["sql"]
    with pytest.raises(OpenAIError) as e:
        models.lora_request("sql")
    assert e.value.status == 404 and e.value.code == "model_not_found"


def test_slots_past_the_free_memory_are_a_config_error():
    """Slots that cannot fit are a user error (ConfigError: one line, no traceback) naming
    the flags that size them."""
    import torch

    from tokenmill.config import ConfigError, LoRAConfig
    from tokenmill.lora.manager import check_slots_fit

    config = LoRAConfig(max_loras=64, max_lora_rank=512)
    with pytest.raises(ConfigError, match="lower --max-loras or --max-lora-rank"):
        check_slots_fit(2**62, torch.device("cpu"), config)


def test_load_and_unload_errors_name_the_field_at_fault():
    """Each 400 of the adapter routes names the request field at fault in ``param``, as
    OpenAI's error body does (the unknown adapter's 404 names ``lora_name``)."""
    import asyncio

    from tokenmill.config import LoRAConfig
    from tokenmill.entrypoints.openai.errors import OpenAIError
    from tokenmill.entrypoints.openai.serving_models import (
        LoadLoRAAdapterRequest,
        ServingModels,
        UnloadLoRAAdapterRequest,
    )

    async def add_lora(lora):
        return None if lora.lora_path == "/ok" else "no adapter folder at '/bad'"

    async def remove_lora(lora_id):
        return None

    engine = SimpleNamespace(
        model_config=SimpleNamespace(served_model_names=["base"]),
        config=SimpleNamespace(lora_config=LoRAConfig()),
        add_lora=add_lora,
        remove_lora=remove_lora,
    )
    models = ServingModels(engine)
    asyncio.run(models.load(LoadLoRAAdapterRequest(lora_name="sql", lora_path="/ok")))
    cases = [
        ({}, "lora_name"),
        ({"lora_path": "/ok"}, "lora_name"),
        ({"lora_name": "a"}, "lora_path"),
        ({"lora_name": "base", "lora_path": "/ok"}, "lora_name"),  # the base model's name
        ({"lora_name": "sql", "lora_path": "/ok"}, "lora_name"),  # already loaded
        ({"lora_name": "b", "lora_path": "/bad"}, "lora_path"),  # a folder not served
    ]
    for body, param in cases:
        with pytest.raises(OpenAIError) as e:
            asyncio.run(models.load(LoadLoRAAdapterRequest(**body)))
        assert (e.value.status, e.value.param) == (400, param), body
    for body, status in [({}, 400), ({"lora_name": "zzz"}, 404)]:
        with pytest.raises(OpenAIError) as e:
            asyncio.run(models.unload(UnloadLoRAAdapterRequest(**body)))
        assert (e.value.status, e.value.param) == (status, "lora_name"), body
