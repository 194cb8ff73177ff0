"""Structured outputs in the engine: constraints kept under chunked prefill and async
scheduling beside plain requests; the parameters' checks; the grammar bitmask in the
sampler's mask; the scheduler's stop and abort on a grammar's verdict."""

from __future__ import annotations

import json
import re
import time

import numpy as np
import pytest
import torch

from tests.core.test_scheduler import make_request, make_scheduler, step, worker_for
from tokenmill import LLM, SamplingParams, StructuredOutputsParams
from tokenmill.core import grammar_masks
from tokenmill.core.engine_io import EngineCoreRequest, FinishReason
from tokenmill.core.grammar_compilation import GrammarCompilation
from tokenmill.core.grammar_workers import WorkerProcess
from tokenmill.core.request import RequestStatus
from tokenmill.sampling_params import SamplingParamsError
from tokenmill.structured_output import choice_grammar, validate
from tokenmill.worker.sampling_metadata import SamplingRow, build_sampling_metadata


@pytest.fixture(scope="module")
def llm(smollm2_gguf_path):
    """Chunked prompts (32 tokens per step) and async scheduling, as a GPU server runs."""
    return LLM(
        smollm2_gguf_path,
        kv_cache_memory=128 << 20,
        max_model_len=512,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        async_scheduling=True,
    )


LONG = "Here is a long introduction to make the prompt span several chunks of tokens. " * 3


@pytest.mark.slow
def test_constraints_hold_beside_plain_requests(llm):
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [LONG + "Code:", LONG + "Answer:", "The capital of France is", "Say yes or no:"]
    params = [
        SamplingParams(
            temperature=0,
            max_tokens=20,
            structured_outputs=StructuredOutputsParams(regex="[a-z]{4}"),
        ),
        plain,
        plain,
        SamplingParams(
            temperature=0.8,
            seed=1,
            max_tokens=20,
            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
        ),
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert re.fullmatch("[a-z]{4}", outs[0].outputs[0].text)
    assert outs[3].outputs[0].text in ("yes", "no")
    assert [o.outputs[0].finish_reason for o in (outs[0], outs[3])] == ["stop", "stop"]
    alone = llm.generate(prompts[1:3], plain, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[1:3]] == [o.outputs[0].token_ids for o in alone]


@pytest.mark.slow
def test_json_schema_output_parses(llm):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
    }
    params = SamplingParams(
        temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema)
    )
    out = llm.generate("The capital of France as JSON:", params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert isinstance(json.loads(out.text)["city"], str)


def step_until_outputs(core, max_steps: int = 500, failures: list[int] | None = None):
    """The first outputs of ``core``'s steps (grammars compile beside the loop); each step's
    count of requests ended for their constraint goes to ``failures``."""
    for _ in range(max_steps):
        step = core.step()
        if failures is not None and step.scheduler_stats is not None:
            failures.append(step.scheduler_stats.num_constraint_failures)
        if step.outputs:
            return step.outputs
    raise AssertionError(f"no output in {max_steps} steps")


@pytest.mark.slow
def test_a_constraint_that_does_not_compile_aborts_its_request_only(llm):
    """Past the front end's check (here: sent to the engine core directly), a constraint
    that does not compile aborts its request, reported by a later step; the engine goes
    on serving."""
    core = llm.llm_engine.engine_core
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="(a"))
    core.add_request(EngineCoreRequest("bad", [1, 2, 3], params, time.time()))
    assert core.has_unfinished_requests()
    failures: list[int] = []
    outputs = step_until_outputs(core, failures=failures)
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("bad", FinishReason.ABORT)]
    assert sum(failures) == 1  # the metric tokenmill:structured_output_failures counts it
    assert outputs[0].stop_reason.startswith("structured_outputs: the constraint does not")
    assert not core.has_unfinished_requests()
    out = llm.generate("Hi", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3


@pytest.mark.slow
def test_a_constraint_whose_masks_are_too_costly_aborts_its_request_only(llm, monkeypatch):
    """The compile worker fills a grammar's first token mask and refuses a constraint that
    takes longer than MAX_MASK_S (an ambiguous regex: 19.7 s a mask, on the engine loop,
    stalled every stream); here the bound is 0, so any constraint is too costly."""
    monkeypatch.setattr(grammar_masks, "MAX_MASK_S", 0.0)
    core = llm.llm_engine.engine_core
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[ab]+"))
    core.add_request(EngineCoreRequest("costly", [1, 2, 3], params, time.time()))
    outputs = step_until_outputs(core)
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("costly", FinishReason.ABORT)]
    assert "too costly to follow" in outputs[0].stop_reason
    assert not core.has_unfinished_requests()
    monkeypatch.undo()
    out = llm.generate(
        "Hi",
        SamplingParams(max_tokens=3, structured_outputs=StructuredOutputsParams(regex="[ab]+")),
        use_tqdm=False,
    )[0]
    assert re.fullmatch("[ab]+", out.outputs[0].text)
    # An ambiguous pattern, costly from its first mask (~0.5 s of CPU): refused at compile.
    costly = StructuredOutputsParams(regex="((a|b)*(c|d)*)*" * 80)
    core.add_request(
        EngineCoreRequest("ambiguous", [1, 2, 3], SamplingParams(structured_outputs=costly), 0)
    )
    [output] = step_until_outputs(core)
    assert output.finish_reason == FinishReason.ABORT
    assert "too costly to follow" in output.stop_reason


@pytest.mark.slow
def test_a_constraint_whose_later_masks_are_too_costly_aborts_its_request_only(llm):
    """``z{3}`` then an ambiguous pattern: the first masks are cheap, so the compile worker
    lets it through, but the mask after the z's takes ~0.5 s of CPU (22.9 s with 270
    copies). The mask filler gives the request up there; the plain request beside it runs
    to its end."""
    core = llm.llm_engine.engine_core
    regex = "z{3}" + "((a|b)*(c|d)*)*" * 80
    constrained = SamplingParams(
        temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex=regex)
    )
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    core.add_request(EngineCoreRequest("costly", [1, 2, 3], constrained, time.time()))
    core.add_request(EngineCoreRequest("plain", [4, 5, 6], plain, time.time()))
    outputs, failures = [], 0
    for _ in range(500):
        step = core.step()
        outputs += step.outputs
        if step.scheduler_stats is not None:
            failures += step.scheduler_stats.num_constraint_failures
        if not core.has_unfinished_requests():
            break
    tokens = {"costly": [], "plain": []}
    finished = {}
    for o in outputs:
        tokens[o.request_id] += o.new_token_ids
        if o.finish_reason is not None:
            finished[o.request_id] = o
    assert finished["costly"].finish_reason == FinishReason.ABORT
    assert "too costly to follow" in finished["costly"].stop_reason
    assert llm.get_tokenizer().decode(tokens["costly"]) == "zzz"
    assert failures == 1
    assert finished["plain"].finish_reason == FinishReason.LENGTH and len(tokens["plain"]) == 8


@pytest.mark.slow
def test_a_compiling_grammar_does_not_hold_up_other_requests(llm, tmp_path):
    """While a constraint compiles, plain requests are scheduled and finish; the
    constrained one runs once its grammar is ready. Aborting a request that is still
    compiling drops it."""
    core = llm.llm_engine.engine_core
    backend = core._grammars.backend
    gate = tmp_path / "gate"
    core._grammars.shutdown()
    core._grammars = GrammarCompilation(
        lambda: backend,
        lambda args: WorkerProcess("tests.core.grammar_fakes:gated_worker", (str(gate), *args)),
    )
    try:
        choice = StructuredOutputsParams(choice=["yes", "no", "perhaps"])  # not cached yet
        constrained = SamplingParams(temperature=0, max_tokens=5, structured_outputs=choice)
        plain = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        now = time.time()
        core.add_request(EngineCoreRequest("slow", [1, 2, 3], constrained, now))
        other = SamplingParams(temperature=0, max_tokens=5, structured_outputs={"regex": "x+"})
        core.add_request(EngineCoreRequest("dropped", [1, 2, 3], other, now))
        core.add_request(EngineCoreRequest("plain", [4, 5, 6], plain, now))
        with pytest.raises(ValueError, match="already in use"):
            core.add_request(EngineCoreRequest("slow", [1], constrained, now))
        finished = {}
        for _ in range(50):
            for o in core.step().outputs:
                if o.finish_reason is not None:
                    finished[o.request_id] = o.finish_reason
            if "plain" in finished:
                break
        assert finished == {"plain": FinishReason.LENGTH}
        core.abort_requests(["dropped"])
        gate.touch()
        out = step_until_outputs(core)
        while core.has_unfinished_requests():
            out += core.step().outputs
        assert {o.request_id for o in out} == {"slow"}
        ids = [t for o in out for t in o.new_token_ids]
        text = llm.get_tokenizer().decode(ids, skip_special_tokens=True)
        assert text in ("yes", "no", "perhaps")
    finally:
        gate.touch()


@pytest.mark.slow
def test_json_without_free_whitespace(llm):
    params = SamplingParams(
        temperature=0,
        max_tokens=40,
        structured_outputs={"json": {"type": "object"}, "disable_any_whitespace": True},
    )
    out = llm.generate("A JSON object:", params, use_tqdm=False)[0].outputs[0]
    assert isinstance(params.structured_outputs, StructuredOutputsParams)
    # One space after each ',' and ':' (xgrammar's separators), none elsewhere.
    value = json.loads(out.text) if out.finish_reason == "stop" else None
    assert out.finish_reason != "stop" or out.text == json.dumps(value, ensure_ascii=False)
    assert "\n" not in out.text


def test_constraints_out_of_bounds_or_unenforced_are_refused():
    refused = [
        ({"json": {"allOf": [{"type": "integer"}]}}, "'allOf' is not supported"),
        ({"json": {"properties": {"a": {}}, "required": ["a", "b"]}}, "requires 'b'"),
        ({"json": {"enum": list(range(300))}}, "enum values"),
        ({"json": '{"items":' * 40 + "{}" + "}" * 40}, "levels deep"),
        ({"regex": "a" * 5000}, "4096"),
        ({"grammar": 'root ::= "a"' + " " * 20000}, "16384"),
        ({"choice": [str(i) for i in range(300)]}, "at most 256"),
        # What xgrammar would not enforce (outputs checked against its matcher).
        ({"json": {"type": "object", "required": ["a"]}}, "requires 'a'"),
        ({"json": {"type": "string", "pattern": "a{3}", "maxLength": 1}}, "'maxLength' beside"),
        ({"json": {"type": "string", "format": "date", "minLength": 2}}, "'minLength' beside"),
        ({"json": {"enum": ["a"], "const": "b"}}, "'const' is not supported|'enum' beside"),
        ({"json": {"type": "integer", "enum": [1, 50], "maximum": 10}}, "'enum' beside"),
        ({"json": {"type": "object", "anyOf": [{"type": "object"}]}}, "'anyOf' beside 'type'"),
        ({"json": {"$ref": "#/$defs/a", "minimum": 1, "$defs": {"a": {}}}}, "'\\$ref' beside"),
        ({"json": {"$ref": "https://example.com/s.json"}}, "not local"),
        # What xgrammar would accept and then fail to compile, or compile slowly.
        ({"json": {"type": "string", "minLength": -5}}, "non-negative integer"),
        ({"json": {"type": "array", "maxItems": 1.5}}, "non-negative integer"),
        ({"json": {"type": "string", "pattern": "[a-z]{0,9998}"}}, "above 1024"),
        ({"json": {"properties": {str(i): {"pattern": "a{0,1000}"} for i in range(5)}}}, "4096"),
        ({"regex": "[a-z]{5,2000}"}, "above 1024"),
        ({"json": "[" * 1100 + "]" * 1100}, "levels deep"),
        # What xgrammar would take literally, drop, or find empty.
        ({"regex": "\\Aabc\\Z"}, "escape '\\\\A'"),
        ({"regex": "a$b"}, "only at the start and the end"),
        ({"regex": "(^a|b)c"}, "only at the start and the end"),
        ({"json": {"type": "string", "pattern": "a^b"}}, "only at the start and the end"),
        ({"json": {"type": "string", "pattern": "^(?!abc)[a-c]{3}$"}}, "lookahead"),
        ({"json": {"patternProperties": {"(?<=a)b": {}}}}, "lookahead"),
        ({"json": {"anyOf": []}}, "'anyOf' is empty"),
        ({"json": {"oneOf": []}}, "'oneOf' is empty"),
        ({"choice": ["\ud800"]}, "lone surrogate"),
        ({"regex": "a\ud800"}, "lone surrogate"),
    ]
    for fields, match in refused:
        with pytest.raises(SamplingParamsError, match=match):
            validate(StructuredOutputsParams(**fields))
    # Property names that are also keywords are names, not keywords.
    schema = {"properties": {"if": {"type": "string"}, "not": {"enum": [{"not": 1}]}}}
    validate(StructuredOutputsParams(json=schema))
    validate(StructuredOutputsParams(json=True))
    # What schema generators emit stays accepted: typed enums, described refs, nullable
    # unions, discriminated unions, escaped braces.
    for schema in (
        {"type": "string", "enum": ["a", "b"], "title": "T"},
        {"$defs": {"A": {"type": "integer"}}, "$ref": "#/$defs/A", "description": "d"},
        {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None},
        {"oneOf": [{"const": 1}, {"const": 2}], "discriminator": {"propertyName": "k"}},
        {"type": "string", "pattern": "\\{[0-9]{1,3}\\}", "description": "x"},
        {"type": "string", "pattern": "\\d+\\.\\w\\s\\\\A", "description": "known escapes"},
        {"type": "string", "pattern": "key(\\s?=\\s?)[(?=]\\a\\U0001F600\\x41"},  # no lookaround
        {"type": "string", "pattern": "^[$^]\\$\\^a$"},  # anchors at the ends, others literal
        {"type": "string", "pattern": "^[0-9]{3}$|^N/A$"},  # anchored alternatives
        {"type": "string", "const": "a", "enum": ["a"], "title": "pydantic < 2.8"},
        {"$defs": {"A": {"type": "integer"}}, "$ref": "#/$defs/A", "nullable": True},
        {"anyOf": [{"type": "string"}], "x-order": 1},
        {
            "oneOf": [{"properties": {"k": {"const": "enum"}}, "required": ["k"]}],
            "discriminator": {"propertyName": "k", "mapping": {"enum": "#/x", "string": "#/y"}},
        },
    ):
        validate(StructuredOutputsParams(json=schema))
    with pytest.raises(SamplingParamsError, match="unexpected keyword"):
        SamplingParams(structured_outputs={"xml": "<a/>"})


def test_params_take_exactly_one_constraint():
    assert StructuredOutputsParams(json={"type": "object"}).json == '{"type": "object"}'
    with pytest.raises(SamplingParamsError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(SamplingParamsError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(SamplingParamsError, match="wrong type"):
        StructuredOutputsParams(choice="yes")
    with pytest.raises(SamplingParamsError, match="invalid regular expression"):
        validate(StructuredOutputsParams(regex="(a"))
    with pytest.raises(SamplingParamsError, match="invalid JSON schema"):
        validate(StructuredOutputsParams(json='{"type": 5}'))
    validate(StructuredOutputsParams(choice=['say "hi"', "back\\slash", "日本"]))
    assert choice_grammar(["a", 'b"']) == 'root ::= "a" | "b\\""'
    assert SamplingParams(structured_outputs=StructuredOutputsParams(regex="a")).uses_full_sampler


def test_grammar_bitmask_joins_the_allowed_token_mask():
    vocab = 40
    words = [0, 0]
    for t in (1, 5, 31, 33, 39):  # bit t % 32 of word t // 32 (31: the sign bit)
        words[t // 32] |= 1 << (t % 32)
    bits = np.array(words, dtype=np.uint32).view(np.int32)
    grammar_only = SamplingRow(SamplingParams(), [1], [], bits)
    both = SamplingRow(SamplingParams(allowed_token_ids=[5, 6, 39]), [1], [], bits)
    rows = [grammar_only, SamplingRow(SamplingParams(), [1], []), both]
    mask = build_sampling_metadata(rows, vocab, torch.device("cpu")).allowed_token_mask
    assert torch.nonzero(mask[0]).flatten().tolist() == [1, 5, 31, 33, 39]
    assert bool(mask[1].all())
    assert torch.nonzero(mask[2]).flatten().tolist() == [5, 39]


class _Grammar:
    """Accepts every token (or none); complete after ``length`` of them."""

    def __init__(self, accepts: bool, length: int) -> None:
        self.accepts, self.length, self.count = accepts, length, 0
        self.failure: str | None = None

    def accept(self, token_id: int) -> bool:
        self.count += 1
        return self.accepts

    @property
    def is_complete(self) -> bool:
        return self.count >= self.length


@pytest.mark.parametrize(
    ("accepts", "status", "num_tokens"),
    [(True, RequestStatus.FINISHED_STOPPED, 2), (False, RequestStatus.FINISHED_ABORTED, 1)],
)
def test_the_grammar_ends_the_request(accepts, status, num_tokens):
    """Complete after two tokens: stopped there; a token it refuses: aborted. Either way
    every block is freed."""
    sched = make_scheduler()
    worker = worker_for(sched)
    request = make_request("g", 4, max_tokens=10, first_token=900)
    request.grammar = _Grammar(accepts, length=2)
    sched.add_request(request)
    for _ in range(4):
        step(sched, worker)
    assert request.status == status
    assert request.num_output_tokens == num_tokens
    assert sched.kv_cache_manager.num_free_blocks == sched.num_blocks


def test_a_grammar_given_up_aborts_its_request_without_the_unmasked_token():
    """The mask filler gave the grammar up: the token drawn without its mask is dropped, the
    request finishes aborted with the reason, and its blocks are freed."""
    sched = make_scheduler()
    worker = worker_for(sched)
    request = make_request("g", 4, max_tokens=10, first_token=900)
    request.grammar = _Grammar(True, length=10)
    sched.add_request(request)
    step(sched, worker)
    assert request.num_output_tokens == 1 and request.grammar.count == 1
    request.grammar.failure = "the constraint is too costly to follow: ..."
    step(sched, worker)
    assert request.status == RequestStatus.FINISHED_ABORTED
    assert request.num_output_tokens == 1 and request.grammar.count == 1
    assert request.stop_reason == "structured_outputs: the constraint is too costly to follow: ..."
    assert sched.kv_cache_manager.num_free_blocks == sched.num_blocks


def test_compile_errors_read_without_the_grammar_engines_internals():
    schema_text = '{"type": "string", "enum": ["\\ud800"]}'  # an escape JSON parsers refuse
    with pytest.raises(SamplingParamsError) as info:
        validate(StructuredOutputsParams(json=schema_text))
    message = str(info.value)
    assert message.startswith("structured_outputs: invalid JSON schema: ")
    assert "Check failed" not in message and "The JSON string is" not in message


@pytest.mark.slow
def test_a_constraint_after_reasoning_applies_from_the_token_after_its_end(llm):
    """With ``reasoning_end_token_ids`` the output is free until those tokens (a thinking
    model's ``</think>``), then constrained: here the end is the first two tokens SmolLM2
    writes anyway, and a regex holds for what follows."""
    prompt = "The capital of France is"
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    end = list(free[0].outputs[0].token_ids[:2])
    params = SamplingParams(
        temperature=0,
        max_tokens=20,
        structured_outputs=StructuredOutputsParams(regex="[0-9]{3}", reasoning_end_token_ids=end),
    )
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert list(out.token_ids[:2]) == end
    answer = llm.get_tokenizer().decode(list(out.token_ids[2:]), skip_special_tokens=True)
    assert re.fullmatch("[0-9]{3}", answer) and out.finish_reason == "stop"
    # The end never comes: the output stays free (and is the unconstrained one).
    never = StructuredOutputsParams(regex="[0-9]{3}", reasoning_end_token_ids=[0, 0, 0])
    params = SamplingParams(temperature=0, max_tokens=8, structured_outputs=never)
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free[0].outputs[0].token_ids


@pytest.mark.slow
def test_a_constraint_after_reasoning_compiles_at_once_and_keeps_the_mask_bounds(llm):
    """A constraint that waits for a reasoning's end still compiles on arrival: one that
    does not compile aborts its request before any token. Its later masks keep their
    bounds: ``z{3}`` then an ambiguous pattern, after a free first token, writes "zzz" and
    is given up there, counted once; the mask filler never held it while it reasoned."""
    core = llm.llm_engine.engine_core
    bad = StructuredOutputsParams(regex="(a", reasoning_end_token_ids=[5])
    core.add_request(
        EngineCoreRequest("bad", [1, 2, 3], SamplingParams(structured_outputs=bad), time.time())
    )
    [output] = step_until_outputs(core)
    assert (output.request_id, output.finish_reason) == ("bad", FinishReason.ABORT)
    assert output.new_token_ids == []
    assert output.stop_reason.startswith("structured_outputs: the constraint does not")

    free = llm.generate("Hi", SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    end = list(free[0].outputs[0].token_ids)
    regex = "z{3}" + "((a|b)*(c|d)*)*" * 80
    costly = StructuredOutputsParams(regex=regex, reasoning_end_token_ids=end)
    params = SamplingParams(temperature=0, max_tokens=20, structured_outputs=costly)
    core.add_request(EngineCoreRequest("costly", llm.get_tokenizer().encode("Hi"), params, 0))
    tokens, failures, finished, homes = [], 0, None, set()
    for _ in range(500):
        step = core.step()
        homes |= set(core._grammar_masks._home)
        for o in step.outputs:
            tokens += o.new_token_ids
            finished = o if o.finish_reason is not None else finished
        if step.scheduler_stats is not None:
            failures += step.scheduler_stats.num_constraint_failures
        if not core.has_unfinished_requests():
            break
    assert tokens[:1] == end
    assert llm.get_tokenizer().decode(tokens[1:]) == "zzz"
    assert finished.finish_reason == FinishReason.ABORT and failures == 1
    assert "too costly to follow" in finished.stop_reason
    assert homes == {"costly"} and core._grammar_masks._home == {}
