"""Prefill pacing: exact plans for a short queue while requests decode, a deep queue, no
decodes, prefix-cache hits, steps paced with their decodes counted, and the engine flags."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tests.core.test_scheduler import make_request, make_scheduler, run_to_finish, step, worker_for
from tests.model.test_loader import CONFIG
from tokenmill.config import ConfigError
from tokenmill.core.prefill_pacing import SERVING_PACING_TOKENS, PrefillPacing
from tokenmill.engine_args import EngineArgs


def _decoding(sched, worker, req_id: str = "d") -> None:
    """Start one request and step until it decodes (its prompt fits one step)."""
    sched.add_request(make_request(req_id, 4, max_tokens=40, first_token=900))
    step(sched, worker)


def test_short_queue_is_paced_while_a_request_decodes():
    sched = make_scheduler(budget=32, max_num_seqs=8, num_blocks=64, pacing=6)
    worker = worker_for(sched)
    _decoding(sched, worker)
    sched.add_request(make_request("a", 10, first_token=0))
    sched.add_request(make_request("b", 8, first_token=100))
    plans = [step(sched, worker)[0].num_scheduled_tokens for _ in range(4)]
    # 18 queued prompt tokens fit in one 32-token step: 6 per step, the decode goes on.
    assert plans == [
        {"d": 1, "a": 6},
        {"d": 1, "a": 4, "b": 2},
        {"d": 1, "a": 1, "b": 6},
        {"d": 1, "a": 1, "b": 1},
    ]


def test_step_mode_fills_each_paced_step_up_to_the_pacing_tokens_with_its_decodes():
    sched = make_scheduler(budget=32, max_num_seqs=8, num_blocks=64, pacing=8, pacing_mode="step")
    worker = worker_for(sched)
    for i in range(3):
        sched.add_request(make_request(f"d{i}", 4, max_tokens=40, first_token=900 + 10 * i))
    step(sched, worker)  # three prompts, nobody decoding yet: the whole budget
    sched.add_request(make_request("a", 12, first_token=0))
    plans = [step(sched, worker)[0].num_scheduled_tokens for _ in range(3)]
    decodes = {"d0": 1, "d1": 1, "d2": 1}
    # 8 tokens a step: the 3 decodes, then 5 of a's prompt; a decodes once it is done.
    assert plans == [{**decodes, "a": 5}, {**decodes, "a": 5}, {**decodes, "a": 2}]
    assert sched.requests["a"].num_output_tokens == 1


def test_step_mode_keeps_a_floor_of_prompt_tokens_when_decodes_fill_the_step():
    pacing = PrefillPacing(256, budget_tokens=8192, count_decodes=True)
    kv = SimpleNamespace(num_cached_prefix_tokens=lambda request: 0)
    decoding = [SimpleNamespace(num_prompt_tokens=10, num_computed_tokens=11)]
    waiting = [SimpleNamespace(num_tokens=1024)]
    assert pacing.allowance(decoding * 51, waiting, kv) == 205
    assert pacing.allowance(decoding * 300, waiting, kv) == 64  # a quarter of 256
    # A deep queue still gets its excess at once, as in the prompt mode.
    deep = [SimpleNamespace(num_tokens=20000)]
    assert pacing.allowance(decoding * 51, deep, kv) == 20000 - 2 * 8192
    assert PrefillPacing(6, budget_tokens=32, count_decodes=True).prompt_floor == 1


def test_no_decoding_request_uses_the_whole_budget():
    sched = make_scheduler(budget=32, max_num_seqs=8, num_blocks=64, pacing=6)
    worker = worker_for(sched)
    sched.add_request(make_request("a", 10, first_token=0))
    sched.add_request(make_request("b", 8, first_token=100))
    so, _ = step(sched, worker)
    assert so.num_scheduled_tokens == {"a": 10, "b": 8}


def test_queue_beyond_two_budgets_is_computed_at_once():
    sched = make_scheduler(budget=32, max_num_seqs=8, max_model_len=128, num_blocks=64, pacing=6)
    worker = worker_for(sched)
    _decoding(sched, worker)
    sched.add_request(make_request("a", 76, first_token=0))
    plans = [step(sched, worker)[0].num_scheduled_tokens for _ in range(4)]
    # 76 queued: the 12 beyond two budgets now, then the rest at 6 per step.
    assert plans == [{"d": 1, "a": 12}, {"d": 1, "a": 6}, {"d": 1, "a": 6}, {"d": 1, "a": 6}]
    # 46 + 70 queued, 52 beyond two budgets: no limit but the budget.
    sched.add_request(make_request("b", 70, first_token=300))
    so, _ = step(sched, worker)
    assert so.num_scheduled_tokens == {"d": 1, "a": 31}


def test_prefix_cache_hits_do_not_count_as_queued_work():
    sched = make_scheduler(budget=32, max_num_seqs=8, max_model_len=128, num_blocks=64, pacing=6)
    worker = worker_for(sched)
    sched.add_request(make_request("p", 41, max_tokens=40, first_token=0))
    for _ in range(3):
        step(sched, worker)  # p's prompt in two steps (40 tokens cached), then a decode
    # q shares p's first 40 tokens: 41 of its 81 to compute, a short queue, so paced (81
    # counted whole would be 17 beyond two budgets, computed at once). The look-ahead is
    # not counted as a second prefix-cache query.
    sched.add_request(make_request("q", 81, max_tokens=4, first_token=0))
    so, out = step(sched, worker)
    assert so.num_scheduled_tokens == {"p": 1, "q": 6}
    stats = out.scheduler_stats
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (81, 40)


def test_the_sum_of_the_queue_stops_once_the_excess_fills_a_step():
    pacing = PrefillPacing(256, budget_tokens=1000, queue_limit_tokens=500)
    running = [SimpleNamespace(num_prompt_tokens=10, num_computed_tokens=11)]  # decoding
    # The last request has no length: the sum must stop before reading it.
    waiting = [SimpleNamespace(num_tokens=n) for n in (400, 599, 501)] + [SimpleNamespace()]
    kv = SimpleNamespace(num_cached_prefix_tokens=lambda request: 0)
    assert pacing.allowance(running, waiting[:1], kv) == 256
    assert pacing.allowance(running, waiting[:2], kv) == 499
    assert pacing.allowance(running, waiting, kv) is None  # 1,500 = limit + budget
    with pytest.raises(ValueError, match="budget_tokens"):
        PrefillPacing(256, budget_tokens=0)


def test_paced_requests_finish_and_free_every_block():
    sched = make_scheduler(budget=16, max_num_seqs=8, max_model_len=64, num_blocks=64, pacing=3)
    worker = worker_for(sched)
    _decoding(sched, worker)
    for i in range(5):
        sched.add_request(make_request(f"r{i}", 7 + i, max_tokens=5, first_token=50 * i))
    tokens, last = run_to_finish(sched, worker, max_steps=200)
    assert all(len(tokens[f"r{i}"]) == 5 for i in range(5))
    assert sched.kv_cache_manager.num_free_blocks == sched.num_blocks


def test_pacing_without_chunked_prefill_is_rejected():
    with pytest.raises(ValueError, match="prefill_pacing_tokens"):
        make_scheduler(budget=64, chunked=False, pacing=8)


def test_engine_flag(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    model = str(tmp_path)
    config = EngineArgs(model=model, prefill_pacing_tokens=512).create_engine_config("server")
    assert config.scheduler_config.prefill_pacing_tokens == 512
    default = EngineArgs(model=model).create_engine_config("server")
    assert default.scheduler_config.prefill_pacing_tokens == 0  # a CPU server
    with pytest.raises(ConfigError, match="non-negative"):
        EngineArgs(model=model, prefill_pacing_tokens=-1).create_engine_config()
    with pytest.raises(ConfigError, match="long-prefill-token-threshold must be non-negative"):
        EngineArgs(model=model, long_prefill_token_threshold=-5).create_engine_config()
    with pytest.raises(ConfigError, match="chunked prefill"):
        EngineArgs(
            model=model, prefill_pacing_tokens=512, enable_chunked_prefill=False
        ).create_engine_config()
    for mode in ("step", "prompt"):
        args = EngineArgs(model=model, prefill_pacing_tokens=256, prefill_pacing_mode=mode)
        assert args.create_engine_config("server").scheduler_config.prefill_pacing_mode == mode
    # Paced steps count their decodes unless told otherwise.
    assert config.scheduler_config.prefill_pacing_mode == "step"
    # A mode says what the pacing tokens count: with pacing off (a CPU server's default)
    # it would do nothing, so it is refused rather than accepted and ignored.
    for mode in ("step", "prompt"):
        with pytest.raises(ConfigError, match=f"--prefill-pacing-mode {mode} needs prefill pacing"):
            EngineArgs(model=model, prefill_pacing_mode=mode).create_engine_config("server")
    with pytest.raises(ConfigError, match="--prefill-pacing-mode: 'tokens' is not one of"):
        EngineArgs(model=model, prefill_pacing_mode="tokens").create_engine_config()


def test_servers_on_cuda_pace_by_default(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    model = str(tmp_path)
    monkeypatch.setattr(EngineArgs, "_resolve_device", lambda self: "cuda")

    def pacing(usage="server", **kwargs):
        args = EngineArgs(model=model, **kwargs)
        return args.create_engine_config(usage).scheduler_config.prefill_pacing_tokens

    assert pacing() == SERVING_PACING_TOKENS == 256
    server = EngineArgs(model=model).create_engine_config("server").scheduler_config
    assert server.prefill_pacing_mode == "step"  # the step's tokens, decodes included
    assert pacing("llm") == 0  # offline runs are about throughput
    assert pacing(prefill_pacing_tokens=0) == 0
    assert pacing(prefill_pacing_tokens=1024) == 1024
    # Without chunked prefill the default is off, not an error.
    assert pacing(enable_chunked_prefill=False, max_num_batched_tokens=4096) == 0
    assert pacing(enforce_eager=True) == 0  # mixed steps would run eagerly
