"""OutputProcessor: output kinds, parallel sampling, logprobs, stop strings, aborts, stats."""

from __future__ import annotations

import math

import pytest

from tests.engine.test_input_processor import make_config
from tokenmill.core.engine_io import EngineCoreOutput, FinishReason, LogprobsLists
from tokenmill.engine.input_processor import InputProcessor
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.outputs import Logprob, RequestOutput
from tokenmill.sampling_params import RequestOutputKind, SamplingParams

CUMULATIVE, DELTA, FINAL_ONLY = (
    RequestOutputKind.CUMULATIVE,
    RequestOutputKind.DELTA,
    RequestOutputKind.FINAL_ONLY,
)
TEXT = " Hello world, the answer is 42."


class ListQueue:
    def __init__(self) -> None:
        self.items: list[RequestOutput] = []

    def put(self, output: RequestOutput) -> None:
        self.items.append(output)


@pytest.fixture
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


@pytest.fixture
def inputs(tok) -> InputProcessor:
    return InputProcessor(make_config(), tok, max_logprobs=20)


def add(proc, inputs, request_id, params, prompt="Q:", queue=None, arrival_time=100.0):
    processed = inputs.process(request_id, prompt, params, arrival_time=arrival_time)
    proc.add_request(processed, params, queue)
    return processed


def step(proc, request_id, token_ids, finish=None, stop_reason=None, t=None, **kwargs):
    out = EngineCoreOutput(request_id, list(token_ids), finish_reason=finish,
                           stop_reason=stop_reason, **kwargs)  # fmt: skip
    return proc.process_outputs([out], t)


def stream(proc, request_id, token_ids, finish=FinishReason.LENGTH):
    """One token per step, the last one finishing; all request outputs in order."""
    outputs = []
    for i, token_id in enumerate(token_ids):
        last = i == len(token_ids) - 1
        outputs += step(proc, request_id, [token_id], finish if last else None).request_outputs
    return outputs


def test_cumulative(tok, inputs):
    proc = OutputProcessor(tok)
    add(proc, inputs, "r", SamplingParams(output_kind=CUMULATIVE))
    ids = tok.encode(TEXT)
    outs = stream(proc, "r", ids)
    assert len(outs) == len(ids)
    for i, out in enumerate(outs):
        assert out.outputs[0].token_ids == ids[: i + 1]
        assert out.outputs[0].text == tok.decode(ids[: i + 1])
        assert out.finished == (i == len(ids) - 1)
    final = outs[-1]
    assert (final.prompt, final.prompt_token_ids) == ("Q:", tok.encode("Q:"))
    assert final.outputs[0].finish_reason == "length"
    assert final.outputs[0].stop_reason is None
    assert final.outputs[0].logprobs is None and final.outputs[0].cumulative_logprob is None
    assert not proc.has_unfinished_requests()


def test_delta_concatenates_to_final_text(tok, inputs):
    proc = OutputProcessor(tok)
    add(proc, inputs, "r", SamplingParams(output_kind=DELTA))
    ids = tok.encode(" Smile 😀 done")
    emoji_first_byte = ids.index(tok.encode(" 😀")[0])
    outs = stream(proc, "r", ids)
    # Every step emits its token; the one holding half of the emoji has no text yet and
    # the emoji comes whole with the next (as vLLM streams it).
    assert len(outs) == len(ids)
    assert "".join(o.outputs[0].text for o in outs) == " Smile 😀 done"
    assert [o.outputs[0].token_ids for o in outs] == [[t] for t in ids]
    assert outs[emoji_first_byte].outputs[0].text == ""
    assert outs[emoji_first_byte + 1].outputs[0].text.endswith("😀")
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]


@pytest.mark.parametrize("interval", [3, 100])
def test_stream_interval_sends_chunks(tok, inputs, interval):
    """--stream-interval: the first token at once, then chunks of ``interval`` tokens (their
    text and logprobs with them), the rest with the finish; nothing lost or repeated."""
    proc = OutputProcessor(tok, stream_interval=interval)
    add(proc, inputs, "r", SamplingParams(output_kind=DELTA, logprobs=1))
    ids = tok.encode(TEXT)  # 10 tokens
    logprobs = [_lists([[(t, -0.5), (t + 1, -1.0)]], [1]) for t in ids]
    outs = []
    for i, token_id in enumerate(ids):
        finish = FinishReason.LENGTH if i == len(ids) - 1 else None
        outs += step(proc, "r", [token_id], finish, new_logprobs=logprobs[i]).request_outputs
    sizes = [len(o.outputs[0].token_ids) for o in outs]
    expected = [1, 3, 3, 3] if interval == 3 else [1, len(ids) - 1]
    assert sizes == expected and sum(sizes) == len(ids)
    assert [t for o in outs for t in o.outputs[0].token_ids] == ids
    assert "".join(o.outputs[0].text for o in outs) == tok.decode(ids)
    assert sum(len(o.outputs[0].logprobs) for o in outs) == len(ids)
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]


def test_final_only(tok, inputs):
    proc = OutputProcessor(tok)
    add(proc, inputs, "r", SamplingParams(output_kind=FINAL_ONLY))
    ids = tok.encode(TEXT)
    [out] = stream(proc, "r", ids)
    assert out.finished and out.outputs[0].text == TEXT and out.outputs[0].token_ids == ids


def test_eos_finish(tok, inputs):
    proc = OutputProcessor(tok)
    add(proc, inputs, "r", SamplingParams(output_kind=FINAL_ONLY, skip_special_tokens=False))
    ids = tok.encode(" Hi") + [tok.eos_token_id]
    [out] = stream(proc, "r", ids, finish=FinishReason.STOP)
    assert (out.outputs[0].text, out.outputs[0].token_ids) == (" Hi", ids)
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", None)


def test_stop_string_aborts_in_core(tok, inputs):
    proc = OutputProcessor(tok)
    add(proc, inputs, "r", SamplingParams(stop=["answer"], output_kind=DELTA))
    ids = tok.encode(TEXT)
    texts, aborted = [], []
    for token_id in ids:
        result = step(proc, "r", [token_id])
        texts += [o.outputs[0] for o in result.request_outputs]
        aborted += result.reqs_to_abort
    assert aborted == ["r"]
    assert "".join(c.text for c in texts) == " Hello world, the "
    assert (texts[-1].finish_reason, texts[-1].stop_reason) == ("stop", "answer")
    assert not proc.has_unfinished_requests()  # later outputs of "r" are ignored


def test_stop_string_on_engine_finished_step_needs_no_abort(tok, inputs):
    proc = OutputProcessor(tok)
    add(proc, inputs, "r", SamplingParams(stop=["world"]))
    result = step(proc, "r", tok.encode(TEXT), finish=FinishReason.LENGTH)
    assert result.reqs_to_abort == []
    completion = result.request_outputs[0].outputs[0]
    assert (completion.text, completion.finish_reason, completion.stop_reason) == (
        " Hello ",
        "stop",
        "world",
    )


def _lists(rows: list[list[tuple[int, float]]], ranks: list[int]) -> LogprobsLists:
    return LogprobsLists(
        token_ids=[[t for t, _ in row] for row in rows],
        logprobs=[[lp for _, lp in row] for row in rows],
        ranks=ranks,
    )


def test_logprobs_conversion(tok, inputs):
    proc = OutputProcessor(tok)
    add(proc, inputs, "r", SamplingParams(logprobs=2, output_kind=DELTA))
    hello, world, comma, the = tok.encode(" Hello world, the")
    # Position 0: the chosen token is also the top-1; the core sent 3 top entries, 2 asked.
    first = _lists([[(hello, -0.5), (hello, -0.5), (world, -1.5), (comma, -3.0)]], [1])
    # Position 1: the chosen token ranks 7th, outside the top 2.
    second = _lists([[(world, -4.0), (comma, -0.2), (the, -1.0), (hello, -2.0)]], [7])
    out1 = step(proc, "r", [hello], new_logprobs=first).request_outputs[0].outputs[0]
    assert out1.logprobs == [
        {hello: Logprob(-0.5, 1, " Hello"), world: Logprob(-1.5, 2, " world")},
    ]
    out2 = step(proc, "r", [world], FinishReason.LENGTH, new_logprobs=second)
    completion = out2.request_outputs[0].outputs[0]
    [entry] = completion.logprobs  # DELTA: only the new position
    assert list(entry) == [world, comma, the]  # the chosen token first
    assert entry[world] == Logprob(-4.0, 7, " world")
    assert entry[comma] == Logprob(-0.2, 1, ",")
    assert entry[the] == Logprob(-1.0, 2, " the")
    assert math.isclose(completion.cumulative_logprob, -4.5)


def test_logprobs_without_detokenize_have_no_text(tok, inputs):
    proc = OutputProcessor(tok)
    add(proc, inputs, "r", SamplingParams(logprobs=0, detokenize=False))
    lists = _lists([[(5, -0.1), (5, -0.1)]], [1])
    result = step(proc, "r", [5], FinishReason.LENGTH, new_logprobs=lists)
    completion = result.request_outputs[0].outputs[0]
    assert completion.text == ""
    assert completion.logprobs == [{5: Logprob(-0.1, 1, None)}]


@pytest.mark.parametrize("kind", [CUMULATIVE, DELTA])
def test_prompt_logprobs(tok, inputs, kind):
    proc = OutputProcessor(tok)
    prompt = tok.encode(" a b c")  # three tokens: two positions have logprobs
    add(proc, inputs, "r", SamplingParams(prompt_logprobs=1, output_kind=kind), prompt=prompt)
    chunk1 = _lists([[(prompt[1], -1.0), (9, -0.3)]], [4])
    chunk2 = _lists([[(prompt[2], -2.0), (prompt[2], -2.0)]], [1])
    # Chunked prefill: the first chunk has no token yet, so no output.
    assert step(proc, "r", [], new_prompt_logprobs=chunk1).request_outputs == []
    first = step(proc, "r", tok.encode(" x"), new_prompt_logprobs=chunk2).request_outputs[0]
    expected = [
        None,
        {prompt[1]: Logprob(-1.0, 4, " b"), 9: Logprob(-0.3, 1, tok.decode([9]))},
        {prompt[2]: Logprob(-2.0, 1, " c")},
    ]
    assert first.prompt_logprobs == expected
    last = step(proc, "r", [8], FinishReason.LENGTH).request_outputs[0]
    assert last.prompt_logprobs == (None if kind == DELTA else expected)


def test_parallel_sampling_cumulative(tok, inputs):
    proc = OutputProcessor(tok)
    add(proc, inputs, "r", SamplingParams(n=2, output_kind=CUMULATIVE))
    a, b = tok.encode(" a"), tok.encode(" b")
    res = proc.process_outputs([EngineCoreOutput("0_r", a), EngineCoreOutput("1_r", b)], 1.0)
    [out] = res.request_outputs  # one RequestOutput per step, not one per child
    assert out.request_id == "r" and not out.finished
    assert [(c.index, c.text) for c in out.outputs] == [(0, " a"), (1, " b")]
    [out] = step(proc, "0_r", b, FinishReason.LENGTH).request_outputs
    assert [(c.text, c.finish_reason) for c in out.outputs] == [(" a b", "length"), (" b", None)]
    assert not out.finished
    [out] = step(proc, "1_r", [tok.eos_token_id], FinishReason.STOP).request_outputs
    assert [(c.text, c.finish_reason) for c in out.outputs] == [(" a b", "length"), (" b", "stop")]
    assert out.finished
    assert not proc.has_unfinished_requests()
    assert proc.get_num_unfinished_requests() == 0


def test_parallel_sampling_delta_and_final_only(tok, inputs):
    proc = OutputProcessor(tok)
    add(proc, inputs, "d", SamplingParams(n=3, output_kind=DELTA))
    add(proc, inputs, "f", SamplingParams(n=2, output_kind=FINAL_ONLY))
    assert proc.get_num_unfinished_requests() == 2
    [out] = step(proc, "1_d", tok.encode(" x")).request_outputs
    assert [(c.index, c.text) for c in out.outputs] == [(1, " x")]  # only the one that moved
    assert step(proc, "0_f", tok.encode(" y"), FinishReason.LENGTH).request_outputs == []
    [out] = step(proc, "1_f", tok.encode(" z"), FinishReason.LENGTH).request_outputs
    assert out.finished and [c.text for c in out.outputs] == [" y", " z"]
    finish = [EngineCoreOutput(f"{i}_d", [5], finish_reason=FinishReason.LENGTH) for i in range(3)]
    [out] = proc.process_outputs(finish).request_outputs
    assert out.finished and [c.index for c in out.outputs] == [0, 1, 2]
    assert out.outputs[1].token_ids == [5]


@pytest.mark.parametrize("user_logprobs", [None, 1])
def test_best_of_selects_highest_cumulative_logprob(tok, inputs, user_logprobs):
    proc = OutputProcessor(tok)
    params = SamplingParams(n=2, best_of=3, logprobs=user_logprobs, output_kind=DELTA)
    add(proc, inputs, "r", params)
    scores = {"0_r": -3.0, "1_r": -1.0, "2_r": -2.0}
    words = [" cat", " dog", " fish"]
    for i, (child, lp) in enumerate(scores.items()):
        [token] = tok.encode(words[i])
        lists = _lists([[(token, lp), (token, lp)]], [1])
        outs = step(proc, child, [token], FinishReason.LENGTH, new_logprobs=lists).request_outputs
        if i < 2:
            assert outs == []  # nothing before every child has finished
    [out] = outs
    assert out.finished
    assert [c.index for c in out.outputs] == [0, 1]
    assert [c.text for c in out.outputs] == [" dog", " fish"]  # -1.0 then -2.0
    if user_logprobs is None:
        assert all(c.logprobs is None and c.cumulative_logprob is None for c in out.outputs)
    else:
        assert [c.cumulative_logprob for c in out.outputs] == [-1.0, -2.0]
        assert len(out.outputs[0].logprobs) == 1


def test_stop_string_in_child(tok, inputs):
    proc = OutputProcessor(tok)
    add(proc, inputs, "r", SamplingParams(n=2, stop=["world"], output_kind=FINAL_ONLY))
    res = step(proc, "1_r", tok.encode(TEXT))
    assert res.reqs_to_abort == ["1_r"]
    [out] = step(proc, "0_r", tok.encode(" ok"), FinishReason.LENGTH).request_outputs
    assert [(c.text, c.stop_reason) for c in out.outputs] == [(" ok", None), (" Hello ", "world")]


def test_queue_delivery_and_abort(tok, inputs):
    proc = OutputProcessor(tok)
    queue = ListQueue()
    add(proc, inputs, "q", SamplingParams(output_kind=DELTA), queue=queue)
    add(proc, inputs, "p", SamplingParams(n=2, output_kind=DELTA), queue=queue)
    assert step(proc, "q", tok.encode(" Hi")).request_outputs == []  # went to the queue
    assert [o.outputs[0].text for o in queue.items] == [" Hi"]
    assert sorted(proc.abort_requests(["q", "p", "unknown"])) == ["0_p", "1_p", "q"]
    final_q, final_p = queue.items[1:]
    assert final_q.finished and final_q.outputs[0].finish_reason == "abort"
    assert final_p.finished and [c.finish_reason for c in final_p.outputs] == ["abort"] * 2
    assert not proc.has_unfinished_requests()
    # Outputs that were in flight when the abort happened are ignored.
    assert step(proc, "q", [5]).request_outputs == []
    assert len(queue.items) == 3


def test_abort_keeps_finished_children_out(tok, inputs):
    proc = OutputProcessor(tok)
    add(proc, inputs, "p", SamplingParams(n=2))
    step(proc, "0_p", [5], FinishReason.LENGTH)
    assert proc.abort_requests(["p"]) == ["1_p"]


def test_fail_all(tok, inputs):
    proc = OutputProcessor(tok)
    queue = ListQueue()
    add(proc, inputs, "a", SamplingParams(output_kind=CUMULATIVE))
    add(proc, inputs, "b", SamplingParams(n=2, output_kind=FINAL_ONLY), queue=queue)
    step(proc, "a", tok.encode(" partial"))
    [out] = proc.fail_all("engine core died")
    assert out.request_id == "a" and out.finished
    assert (out.outputs[0].text, out.outputs[0].finish_reason) == (" partial", "abort")
    [queued] = queue.items
    assert queued.request_id == "b" and queued.finished
    assert [c.finish_reason for c in queued.outputs] == ["abort", "abort"]
    assert not proc.has_unfinished_requests() and proc.get_num_unfinished_requests() == 0


def test_duplicate_request_id(tok, inputs):
    proc = OutputProcessor(tok)
    add(proc, inputs, "r", SamplingParams())
    with pytest.raises(ValueError, match="already in use"):
        add(proc, inputs, "r", SamplingParams())


def test_iteration_stats(tok, inputs):
    proc = OutputProcessor(tok)
    prompt = tok.encode("Q: what?")
    add(proc, inputs, "r", SamplingParams(), prompt=prompt, arrival_time=100.0)
    add(proc, inputs, "s", SamplingParams(), prompt=[1, 2], arrival_time=101.0)
    res = proc.process_outputs([], 100.5, first_scheduled={"r": 100.25})
    assert res.iteration_stats.num_prompt_tokens == 0
    res = proc.process_outputs(
        [EngineCoreOutput("r", [5]), EngineCoreOutput("s", [6])], 102.0, {"s": 101.5}
    )
    stats = res.iteration_stats
    assert stats.iteration_timestamp == 102.0
    assert stats.num_prompt_tokens == len(prompt) + 2
    assert stats.num_generation_tokens == 2
    assert sorted(stats.time_to_first_tokens) == [1.0, 2.0]
    assert stats.inter_token_latencies == []
    last = EngineCoreOutput("r", [7, 8], finish_reason=FinishReason.LENGTH)
    res = proc.process_outputs([last], 102.5)
    stats = res.iteration_stats
    assert (stats.num_prompt_tokens, stats.num_generation_tokens) == (0, 2)
    assert stats.inter_token_latencies == [0.5]
    [done] = stats.finished_requests
    assert (done.request_id, done.finish_reason) == ("r", "length")
    assert (done.e2e_latency, done.queue_time) == (2.5, 0.25)
    assert (done.num_prompt_tokens, done.num_generation_tokens) == (len(prompt), 3)
    metrics = res.request_outputs[0].metrics
    assert (metrics.arrival_time, metrics.first_scheduled_time) == (100.0, 100.25)
    assert (metrics.first_token_time, metrics.last_token_time) == (102.0, 102.5)
    assert metrics.finished_time == 102.5


def test_stats_off(tok, inputs):
    proc = OutputProcessor(tok, log_stats=False)
    add(proc, inputs, "r", SamplingParams())
    res = step(proc, "r", [5], FinishReason.LENGTH)
    assert res.iteration_stats is None and res.request_outputs[0].finished


def test_num_cached_tokens(tok, inputs):
    proc = OutputProcessor(tok)
    add(proc, inputs, "r", SamplingParams())
    out = step(proc, "r", [5], num_cached_tokens=16).request_outputs[0]
    assert out.num_cached_tokens == 16
