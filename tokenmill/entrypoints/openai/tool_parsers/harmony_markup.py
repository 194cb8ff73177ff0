"""Reading gpt-oss' output in OpenAI's harmony format, whole or any prefix of it.

A harmony output is a sequence of messages; the prompt ends with ``<|start|>assistant``, so
the first message's header starts at ``<|channel|>``::

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
    <|message|>{"city": "Paris"}<|call|>

A header names the channel (``analysis``: reasoning; ``commentary``: tool calls and
preambles; ``final``: the answer) and may name a recipient (``to=functions.NAME``, either
before ``<|channel|>`` or after the channel's name). A body ends at ``<|end|>``, ``<|call|>``,
``<|return|>``, the next ``<|start|>``, or the end of the output (the stop tokens ``<|call|>``
and ``<|return|>`` are usually not in the output's text). Text outside any message (what a
reasoning parser left of the answer) is plain text.

The markers are special tokens of gpt-oss' tokenizer (o200k_harmony): they are in the text
only when it is decoded with ``skip_special_tokens=False``, which the parsers ask for.
Format: https://cookbook.openai.com/articles/openai-harmony
"""

from __future__ import annotations

import re
from dataclasses import dataclass

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
# Where a body ends.
BODY_ENDS = (END, CALL, RETURN, START)
# Every marker a prefix of the output may end in the middle of.
MARKERS = (START, CHANNEL, MESSAGE, END, CALL, RETURN, "<|constrain|>")
FUNCTIONS = "functions."
# The answer begins after these tokens (structured outputs apply from there).
FINAL_HEADER = f"{CHANNEL}final{MESSAGE}"

_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")


@dataclass
class HarmonyPart:
    """One message, or a run of plain text (``channel`` None).

    Attributes:
        channel: ``analysis``, ``commentary``, ``final`` (another name is kept as given);
            None for plain text.
        recipient: ``functions.NAME`` and the like, or None.
        body: the message's text (plain text: the text), as far as the output goes.
        raw: the part's text in the output, markers included.
        closed: the body ended with a marker (or more output follows it).
    """

    channel: str | None
    recipient: str | None
    body: str
    raw: str
    closed: bool

    @property
    def function(self) -> str | None:
        """The function a ``to=functions.NAME`` message calls, else None."""
        if self.recipient and self.recipient.startswith(FUNCTIONS):
            return self.recipient[len(FUNCTIONS) :] or None
        return None


def _next_header(text: str, pos: int) -> int:
    """Where the next message starts at or after ``pos`` (``len(text)`` if none)."""
    found = [i for i in (text.find(START, pos), text.find(CHANNEL, pos)) if i >= 0]
    return min(found) if found else len(text)


def parse_harmony(text: str, final: bool) -> list[HarmonyPart]:
    """The messages and plain text of ``text`` in order.

    A message whose header is not complete yet is left out (or, when ``final``, dropped: an
    output cut inside a header carries nothing). Plain text and open bodies hold back a
    suffix that may begin a marker unless ``final``, so what is read from a prefix of an
    output is a prefix of what is read from the whole.
    """
    parts: list[HarmonyPart] = []
    pos = 0
    while pos < len(text):
        start = _next_header(text, pos)
        if start > pos:
            plain = text[pos:start]
            if start == len(text) and not final:
                plain = _visible(plain)
            if plain:
                parts.append(HarmonyPart(None, None, plain, plain, start < len(text)))
            pos = start
            continue
        header_end = text.find(MESSAGE, start)
        if header_end < 0:
            break
        header = text[start:header_end]
        body_start = header_end + len(MESSAGE)
        ends = [(i, m) for m in BODY_ENDS if (i := text.find(m, body_start)) >= 0]
        if ends:
            end, marker = min(ends)
            after = end if marker == START else end + len(marker)
            body = text[body_start:end]
        else:
            end = after = len(text)
            body = text[body_start:] if final else _visible(text[body_start:])
        channel = _CHANNEL_NAME.search(header)
        recipient = _RECIPIENT.search(header)
        parts.append(HarmonyPart(
            channel.group(1) if channel else "final",
            recipient.group(1) if recipient else None,
            body,
            text[start:after] if ends or final else text[start:body_start] + body,
            bool(ends),
        ))  # fmt: skip
        pos = after
    return parts


def _visible(text: str) -> str:
    """``text`` without a suffix that may be the start of a marker."""
    for size in range(min(len(text), max(map(len, MARKERS)) - 1), 0, -1):
        tail = text[-size:]
        if any(m.startswith(tail) for m in MARKERS):
            return text[:-size]
    return text
