"""Recorded tool-calling outputs of each model family, in the formats their published chat
templates and model cards give, for the tool-parser tests.

Each sample: (output, expected calls as (name, arguments dict), expected content). An
expected ``None`` for the calls means the output is not read as calls: the whole output is
content.
"""

from __future__ import annotations

from typing import Any

Sample = tuple[str, list[tuple[str, dict[str, Any]]] | None, str | None]

WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather of a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "hours": {"type": "array", "items": {"type": "integer"}},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "filters": {"type": "object"}},
            },
        },
    },
]

PARIS = ("get_weather", {"city": "Paris"})

SAMPLES: dict[str, list[Sample]] = {
    # Qwen2.5 / Qwen3 / Hermes 2 Pro: <tool_call> JSON </tool_call>.
    "hermes": [
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
            [PARIS],
            None,
        ),
        (
            "Let me check both cities.\n<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n'
            '<tool_call>\n{"name": "search", "arguments": {"query": "caf\\u00e9 \\"Le Dôme\\"",'
            ' "filters": {"open": true, "tags": ["a", "b"]}}}\n</tool_call>',
            [
                ("get_weather", {"city": "Paris", "days": 3}),
                (
                    "search",
                    {"query": 'café "Le Dôme"', "filters": {"open": True, "tags": ["a", "b"]}},
                ),
            ],
            "Let me check both cities.",
        ),
        # Qwen sometimes leaves out the closing tag at the end of its output.
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}', [PARIS], None),
        # Arguments given as a JSON string.
        (
            '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}\n'
            "</tool_call>",
            [PARIS],
            None,
        ),
        ("The capital of France is Paris. 2 < 3 and <b>bold</b>.", None, None),
        # Malformed: not JSON inside the tags.
        ("<tool_call>\nget_weather(Paris)\n</tool_call>", None, None),
        # Cut by max_tokens inside the arguments.
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', None, None),
    ],
    # Llama 3.1 / 3.2 / 3.3 JSON tool calling.
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', [PARIS], None),
        (
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
            '{"name": "search", "parameters": {"query": "louvre"}}',
            [PARIS, ("search", {"query": "louvre"})],
            None,
        ),
        (
            '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}',
            [("get_weather", {"city": "Paris", "days": 2})],
            None,
        ),
        ("Paris is the capital of France.", None, None),
        ('{"answer": 42}', None, None),
        ('{"name": "get_weather", "parameters": {"city": ', None, None),
    ],
    # Mistral: [TOOL_CALLS] then a JSON array (tokenizer v3-v7) or name[ARGS]{...} (v11+).
    "mistral": [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', [PARIS], None),
        (
            'Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
            '{"name": "search", "arguments": {"query": "louvre"}}]',
            [PARIS, ("search", {"query": "louvre"})],
            "Checking.",
        ),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', [PARIS], None),
        (
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "hours": [9, 12]}'
            '[TOOL_CALLS]search[ARGS]{"query": "x"}',
            [("get_weather", {"city": "Paris", "hours": [9, 12]}), ("search", {"query": "x"})],
            None,
        ),
        ("Bonjour ! [Paris] est la capitale.", None, None),
        ("[TOOL_CALLS]get_weather", None, None),
    ],
    # Qwen3-Coder: XML-style functions and parameters.
    "qwen3_coder": [
        (
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "</function>\n</tool_call>",
            [PARIS],
            None,
        ),
        (
            "I'll look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n"
            "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n"
            "</parameter>\n<parameter=hours>\n[9, 12]\n</parameter>\n</function>\n"
            "</tool_call>\n<tool_call>\n<function=search>\n<parameter=query>\nline one\n"
            'line two <b>\n</parameter>\n<parameter=filters>\n{"open": true}\n</parameter>\n'
            "</function>\n</tool_call>",
            [
                ("get_weather", {"city": "New York", "days": 3, "metric": True, "hours": [9, 12]}),
                ("search", {"query": "line one\nline two <b>", "filters": {"open": True}}),
            ],
            "I'll look.",
        ),
        # A parameter without its closing tag ends at the function's end.
        (
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n"
            "</tool_call>",
            [PARIS],
            None,
        ),
        ("Plain answer with <b>tags</b>.", None, None),
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", None, None),
    ],
    # Llama 3.2 / Llama 4 pythonic tool calling.
    "pythonic": [
        ('[get_weather(city="Paris")]', [PARIS], None),
        (
            "[get_weather(city='Paris', days=3, metric=True, hours=[9, 12]), "
            'search(query="a, (b)", filters={"open": None})]',
            [
                ("get_weather", {"city": "Paris", "days": 3, "metric": True, "hours": [9, 12]}),
                ("search", {"query": "a, (b)", "filters": {"open": None}}),
            ],
            None,
        ),
        ('<|python_start|>[get_weather(city="Paris")]<|python_end|>', [PARIS], None),
        ("Paris, in France.", None, None),
        ("[1, 2, 3]", None, None),
        ('[get_weather("Paris")]', None, None),
    ],
}
SAMPLES["qwen3_xml"] = SAMPLES["qwen3_coder"]

# Text that no parser may read as calls.
PLAIN_TEXTS = [
    "Hello! How can I help you today?",
    "  Leading spaces, trailing newline.\n",
    "Use < and > freely: a<b, [x], {y}.",
]
