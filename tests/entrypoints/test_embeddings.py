"""POST /v1/embeddings on a real ``tokenmill serve`` of all-MiniLM-L6-v2, through the ``openai``
SDK, against sentence-transformers' embeddings of the same texts."""

from __future__ import annotations

import asyncio
import base64
import re
from collections.abc import Iterator

import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F

from tests.entrypoints.conftest import RemoteServer, server_fixture
from tests.model.minilm import SENTENCES, minilm_folder, sentence_transformers_embeddings

pytestmark = pytest.mark.slow

MODEL = "all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    yield from server_fixture([minilm_folder(), "--served-model-name", MODEL])


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


@pytest.fixture(scope="module")
def reference() -> torch.Tensor:
    return sentence_transformers_embeddings(SENTENCES)


def _cosines(data, reference: torch.Tensor) -> torch.Tensor:
    ours = torch.tensor([d.embedding for d in data])
    return F.cosine_similarity(ours, reference)


def test_list_of_strings_matches_sentence_transformers(client, reference):
    response = client.embeddings.create(model=MODEL, input=SENTENCES, encoding_format="float")
    assert response.model == MODEL and response.object == "list"
    assert [d.index for d in response.data] == list(range(len(SENTENCES)))
    assert all(len(d.embedding) == 384 for d in response.data)
    cosine = _cosines(response.data, reference)
    assert cosine.min().item() >= 0.9999, cosine


def test_usage_counts_every_input_token(client, server):
    texts = SENTENCES[:3]
    counts = [server.post("/tokenize", {"prompt": t}).json()["count"] for t in texts]
    response = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    assert response.usage.prompt_tokens == sum(counts)
    assert response.usage.total_tokens == sum(counts)


def test_single_string(client, reference):
    response = client.embeddings.create(model=MODEL, input=SENTENCES[3], encoding_format="float")
    assert len(response.data) == 1
    assert _cosines(response.data, reference[3:4]).item() >= 0.9999


def test_token_ids_equal_text(client, server):
    ids = server.post("/tokenize", {"prompt": SENTENCES[0]}).json()["tokens"]
    text = client.embeddings.create(model=MODEL, input=SENTENCES[0], encoding_format="float")
    one = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    many = client.embeddings.create(model=MODEL, input=[ids, ids[:3]], encoding_format="float")
    assert one.data[0].embedding == text.data[0].embedding
    # Batched with another input: the CPU's matrix products may round differently for
    # another batch shape (oneDNN picks kernels by shape and ISA), so equal to float32 noise.
    np.testing.assert_allclose(many.data[0].embedding, text.data[0].embedding, rtol=0, atol=1e-6)
    assert len(many.data) == 2 and many.usage.prompt_tokens == len(ids) + 3


def test_base64_decodes_to_the_float_vector(client, server):
    floats = client.embeddings.create(model=MODEL, input=SENTENCES[:2], encoding_format="float")
    raw = server.post(
        "/v1/embeddings", {"model": MODEL, "input": SENTENCES[:2], "encoding_format": "base64"}
    )
    assert raw.status_code == 200
    # Two requests may differ in the last bit of a few values (the CPU GEMM's blocking can
    # follow the buffers' alignment), so the vectors are compared to float32 resolution.
    for item, expected in zip(raw.json()["data"], floats.data, strict=True):
        vector = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
        assert vector.shape == (len(expected.embedding),)
        np.testing.assert_allclose(
            vector, np.asarray(expected.embedding, dtype=np.float32), rtol=1e-5, atol=1e-6
        )
    # The SDK asks for base64 when no format is given, and decodes it itself.
    default = client.embeddings.create(model=MODEL, input=SENTENCES[:2])
    np.testing.assert_allclose(
        [d.embedding for d in default.data], [d.embedding for d in floats.data], rtol=1e-6
    )


def test_concurrent_requests_each_get_their_embedding(server, reference):
    async def run():
        client = server.async_openai()
        return await asyncio.gather(
            *(
                client.embeddings.create(model=MODEL, input=s, encoding_format="float")
                for s in SENTENCES
            )
        )

    responses = asyncio.run(run())
    cosine = _cosines([r.data[0] for r in responses], reference)
    assert cosine.min().item() >= 0.9999, cosine


def test_truncate_prompt_tokens(client, server):
    response = client.embeddings.create(
        model=MODEL,
        input="word " * 400,
        encoding_format="float",
        extra_body={"truncate_prompt_tokens": 255},
    )
    assert response.usage.prompt_tokens == 255
    # the request's log line shows the truncation it asked for
    assert any("Received request" in line and "truncate_prompt_tokens=255" in line
               for line in server.log_text(1_000_000).splitlines())  # fmt: skip


@pytest.mark.parametrize(
    "body,param,match",
    [
        ({"input": ""}, "input", "empty"),
        ({"input": []}, "input", "empty"),
        ({"input": ["a", ""]}, "input[1]", "empty"),
        ({"input": [[]]}, "input", "empty"),
        ({"input": [101, 30522, 102]}, "input", "vocabulary"),
        ({"input": "word " * 300}, "input", "maximum input length is 256 tokens.*302 tokens"),
        ({"input": "hello", "dimensions": 64}, "dimensions", "dimensions"),
        ({"input": "hello", "encoding_format": "int8"}, "encoding_format", ""),
        ({"input": 5}, "input", ""),
    ],
)
def test_invalid_requests_are_400(server, body, param, match):
    response = server.post("/v1/embeddings", {"model": MODEL, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert re.search(match, error["message"]), error["message"]


def test_too_long_input_through_the_sdk(client):
    with pytest.raises(openai.BadRequestError, match="maximum input length"):
        client.embeddings.create(model=MODEL, input="word " * 300)


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.embeddings.create(model="no-such-model", input="hello")


def test_generation_routes_say_it_is_an_embedding_model(client, server):
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}])
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        client.completions.create(model=MODEL, prompt="hello")
    response = server.post("/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 400 and "embedding model" in response.json()["error"]["message"]


def test_models_and_health(server):
    assert server.get("/health").status_code == 200
    models = server.get("/v1/models").json()["data"]
    assert [(m["id"], m["max_model_len"]) for m in models] == [(MODEL, 256)]


def test_embeddings_on_a_generative_model_is_400(no_template_server):
    response = no_template_server.post("/v1/embeddings", {"input": "hello"})
    assert response.status_code == 400
    assert "not an embedding model" in response.json()["error"]["message"]
    unknown = no_template_server.post("/v1/embeddings", {"input": "hello", "model": "nope"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
