"""Tokenizer loading (Hugging Face folders and GGUF files), chat templates, token decoding.

Tokenizers are Hugging Face *fast* tokenizers (Rust ``tokenizers`` backend) loaded from local
files only: tokenmill never downloads. A GGUF file's tokenizer is rebuilt by transformers from
the file's metadata, which takes seconds, so the result is saved once under
``$TOKENMILL_CACHE_DIR/tokenizers/<key>`` and read back from there afterwards.

transformers is imported inside the functions that need it: modules that only decode
(the detokenizer, the output processor) stay light.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tokenmill import envs
from tokenmill.hf_config import ModelLoadError

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# Root of tokenmill's on-disk caches (default ~/.cache/tokenmill).
CACHE_DIR_ENV = "TOKENMILL_CACHE_DIR"
# Bump when the layout of a cached tokenizer changes, so that old entries are not reused.
_CACHE_FORMAT = 1


class ChatTemplateError(ValueError):
    """A chat template is missing, unreadable or cannot render the messages."""


def get_cache_dir() -> str:
    """The root of tokenmill's on-disk caches: ``$TOKENMILL_CACHE_DIR`` or ~/.cache/tokenmill."""
    return envs.cache_dir()


def get_tokenizer(model: str, tokenizer: str | None = None) -> PreTrainedTokenizerBase:
    """Load the fast tokenizer of a model from local files.

    Args:
        model: a Hugging Face model folder or a ``.gguf`` file.
        tokenizer: where the tokenizer lives, if not in ``model`` (a folder or a ``.gguf``).

    Returns:
        A transformers fast tokenizer (``backend_tokenizer`` is a ``tokenizers.Tokenizer``).

    Raises:
        ModelLoadError: the path does not exist, holds no tokenizer, or only a slow
            (Python) tokenizer could be built.
    """
    # NOTE: set before transformers / huggingface_hub are imported, so that nothing
    # tries the network even where a code path ignores local_files_only.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    source = tokenizer or model
    if not os.path.exists(source):
        raise ModelLoadError(
            f"tokenizer path {source!r} does not exist (tokenmill loads tokenizers from a "
            f"local folder or .gguf file; it never downloads)"
        )
    if os.path.isfile(source):
        if not source.endswith(".gguf"):
            raise ModelLoadError(f"tokenizer path {source} is a file but not a .gguf file")
        tok = _load_gguf_tokenizer(source)
    else:
        if not _has_tokenizer_files(source):
            raise ModelLoadError(
                f"{source} holds no tokenizer ({', '.join(TOKENIZER_FILES)}); pass "
                "--tokenizer with a tokenizer folder or a .gguf file"
            )
        tok = _from_pretrained(source)
    if not getattr(tok, "is_fast", False) or get_backend_tokenizer(tok) is None:
        raise ModelLoadError(
            f"{source} has only a slow (Python) tokenizer; tokenmill needs a fast one "
            f"(tokenizer.json)"
        )
    return tok


# A folder with none of these (nor a sentencepiece ``*.model`` or a ``*.tiktoken`` file)
# has no tokenizer for transformers to load.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
)


def _has_tokenizer_files(folder: str) -> bool:
    try:
        names = os.listdir(folder)
    except OSError:
        return True  # let transformers report what is wrong with the folder
    return any(n in TOKENIZER_FILES or n.endswith((".model", ".tiktoken")) for n in names)


def _from_pretrained(path: str, **kwargs: Any) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(
            path, local_files_only=True, use_fast=True, trust_remote_code=False, **kwargs
        )
    except Exception as e:  # noqa: BLE001 - transformers and huggingface_hub raise many kinds
        # (a GGUF file's metadata is also validated as a model config here): one line.
        reason = " ".join(str(e).split())[:300] or type(e).__name__
        raise ModelLoadError(f"cannot load a tokenizer from {path}: {reason}") from e


def gguf_tokenizer_cache_key(path: str) -> str:
    """Cache key of a GGUF file's tokenizer: its absolute path, size and mtime.

    The transformers version is part of the key too: it is what converts the metadata.
    """
    import transformers

    st = os.stat(path)
    ident = (
        f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}|"
        f"{transformers.__version__}|{_CACHE_FORMAT}"
    )
    digest = hashlib.sha256(ident.encode()).hexdigest()[:24]
    stem = os.path.splitext(os.path.basename(path))[0]
    return f"{stem}-{digest}"


def _load_gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    cache_root = os.path.join(get_cache_dir(), "tokenizers")
    cached = os.path.join(cache_root, gguf_tokenizer_cache_key(path))
    if os.path.isdir(cached):
        try:
            return _from_pretrained(cached)
        except ModelLoadError as e:
            logger.warning("ignoring unreadable cached tokenizer %s: %s", cached, e)
    tok = _from_pretrained(os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path))
    _save_atomically(tok, cache_root, cached)
    return tok


def _save_atomically(tok: PreTrainedTokenizerBase, cache_root: str, target: str) -> None:
    """Write ``tok`` to ``target`` via a temporary folder and one rename.

    A folder rename is atomic on POSIX, so a reader sees either no entry or a complete
    one; when two processes race, the loser's copy is discarded.
    """
    try:
        os.makedirs(cache_root, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.", dir=cache_root)
    except OSError as e:
        logger.warning("cannot cache the tokenizer under %s: %s", cache_root, e)
        return
    try:
        tok.save_pretrained(tmp)
        os.rename(tmp, target)
    except OSError:
        # Another process finished first (target exists), or the disk is read-only /
        # full: either way the tokenizer in memory is good and the cache stays valid.
        shutil.rmtree(tmp, ignore_errors=True)


def get_backend_tokenizer(tokenizer: PreTrainedTokenizerBase) -> Tokenizer | None:
    """The Rust ``tokenizers.Tokenizer`` under a transformers fast tokenizer, or None."""
    return getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)


def decode_token_texts(tokenizer: PreTrainedTokenizerBase, token_ids: Sequence[int]) -> list[str]:
    """The text of each token on its own, special tokens included (for logprobs).

    A token holding part of a multi-byte UTF-8 character decodes to U+FFFD.
    """
    backend = get_backend_tokenizer(tokenizer)
    if backend is None:
        return [tokenizer.decode([t], skip_special_tokens=False) for t in token_ids]
    return backend.decode_batch([[t] for t in token_ids], skip_special_tokens=False)


def decode_with_context(
    tokenizer: PreTrainedTokenizerBase,
    context_ids: Sequence[int],
    token_ids: Sequence[int],
    skip_special_tokens: bool,
) -> str | None:
    """The text ``token_ids`` add after ``context_ids`` (decoded together, context removed).

    Decoding with a little context keeps what decoders do at the start of a text (drop a
    SentencePiece word-start space, strip) from touching the first generated token.

    Returns:
        The added text, or None when the decoded context is not a prefix of the whole.
    """
    backend = get_backend_tokenizer(tokenizer)
    if backend is None:
        base = tokenizer.decode(list(context_ids), skip_special_tokens=skip_special_tokens)
        full = tokenizer.decode(
            list(context_ids) + list(token_ids), skip_special_tokens=skip_special_tokens
        )
    else:
        base = backend.decode(list(context_ids), skip_special_tokens=skip_special_tokens)
        full = backend.decode(
            list(context_ids) + list(token_ids), skip_special_tokens=skip_special_tokens
        )
    return full[len(base) :] if full.startswith(base) else None


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase, text: str, add_special_tokens: bool = True
) -> list[int]:
    """Token ids of ``text``, as ``tokenizer.encode`` gives them.

    Goes straight to the Rust tokenizer when there is one: the same result, without
    transformers' per-call Python overhead (a third of the time of a 2k-token prompt),
    which matters on the server's event loop.
    """
    backend = get_backend_tokenizer(tokenizer)
    if backend is None or getattr(tokenizer, "split_special_tokens", False):
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return backend.encode(text, add_special_tokens=add_special_tokens).ids


def load_chat_template(value: str) -> str:
    """A chat template given as a file path or as the Jinja text itself, checked to compile
    as transformers compiles it for rendering (so a typo fails at start-up, not on every
    chat request).

    Raises:
        ChatTemplateError: ``value`` is neither a readable file nor Jinja text, or its
            Jinja does not compile.
    """
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                template = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ChatTemplateError(f"cannot read chat template file {value}: {e}") from e
    elif "{{" in value or "{%" in value:
        template = value
    else:
        raise ChatTemplateError(
            f"chat template {value!r} is neither an existing file nor a Jinja template "
            f"(no '{{{{' or '{{%' in it)"
        )
    _check_chat_template_syntax(template)
    return template


def _check_chat_template_syntax(template: str) -> None:
    import jinja2

    try:  # transformers' own environment (its extensions, e.g. the generation tag)
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # pragma: no cover - a transformers without it renders unchecked
        return
    try:
        _compile_jinja_template(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(
            f"the chat template is not valid Jinja: line {e.lineno}: {e.message}"
        ) from None


def _flatten_content(content: Any, index: int) -> Any:
    """Join OpenAI-style content parts (``[{"type": "text", "text": ...}, ...]``) by newlines."""
    if not isinstance(content, list):
        return content
    if any(isinstance(p, dict) and p.get("type") == "image" for p in content):
        return content  # the template writes each image part's placeholder itself
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type", "text") == "text":
            texts.append(part.get("text", ""))
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ChatTemplateError(
                f"message {index}: content part of type {kind!r} is not supported "
                f"(only 'text' parts)"
            )
    return "\n".join(texts)


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    **kwargs: Any,
) -> list[int]:
    """Render chat messages with a Jinja chat template and tokenize the result.

    The text is ``render_chat_template``'s, encoded without added special tokens: the
    template already wrote any BOS / role tokens, and adding them again would double the
    BOS on tokenizers that prepend one.
    """
    text = render_chat_template(
        tokenizer, messages, chat_template, add_generation_prompt, **kwargs
    )
    return encode_prompt(tokenizer, text, add_special_tokens=False)


def render_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    **kwargs: Any,
) -> str:
    """Render chat messages with a Jinja chat template (the model's, or ``chat_template``).

    Args:
        tokenizer: the model's tokenizer (its own template is used if ``chat_template``
            is None).
        messages: dicts with ``role`` and ``content``; content is a string or a list of
            ``{"type": "text", "text": ...}`` parts, joined with newlines.
        chat_template: template text that replaces the tokenizer's own.
        add_generation_prompt: end with the header of an assistant turn.
        **kwargs: passed to the template (e.g. ``tools``, ``enable_thinking``).

    Returns:
        The prompt text, special tokens written by the template (encode it without adding
        special tokens).

    Raises:
        ChatTemplateError: there is no template, or it fails on these messages.
    """
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ChatTemplateError(
            "The tokenizer has no chat template and none was given: pass one with "
            "--chat-template (a file or the template text), or use the completions API."
        )
    normalized = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise ChatTemplateError(f"message {i} must be a dict with a 'role' key")
        message = dict(message)
        message["content"] = _flatten_content(message.get("content"), i)
        normalized.append(message)
    try:
        text = tokenizer.apply_chat_template(
            normalized,
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **kwargs,
        )
    except Exception as e:  # jinja2 raises TemplateError / UndefinedError / TypeError ...
        raise ChatTemplateError(f"the chat template failed on these messages: {e}") from e
    return text
