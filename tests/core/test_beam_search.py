"""BeamSearch, the selection of beams (transformers' rules), on hand-made candidates."""

from __future__ import annotations

import math

import pytest

from tokenmill.core.beam_search import BeamSearch

EOS = 9


def lp(p: float) -> float:
    return math.log(p)


def test_first_step_keeps_the_best_k_and_finishes_eos_among_them():
    search = BeamSearch(beam_width=2, max_tokens=5, eos_token_ids=[EOS])
    assert search.num_candidates == 4  # max(2, 1 + 1 EOS) * 2
    cands = [[(1, lp(0.4)), (EOS, lp(0.3)), (2, lp(0.2)), (3, lp(0.1))]]
    nxt = search.step([([], 0.0)], cands)
    # EOS is the second best: it finishes (score over 1 token), and 1 and 2 run on.
    assert [(n.parent, n.token_id) for n in nxt] == [(0, 1), (0, 2)]
    assert nxt[0].cum_logprob == pytest.approx(lp(0.4))
    assert [h.token_ids for h in search.finished] == [(EOS,)]
    assert search.finished[0].score == pytest.approx(lp(0.3))
    assert search.finished[0].finish_reason == "stop"
    assert not search.done


def test_eos_outside_the_best_k_is_not_a_hypothesis():
    search = BeamSearch(beam_width=2, max_tokens=5, eos_token_ids=[EOS])
    cands = [[(1, lp(0.4)), (2, lp(0.3)), (EOS, lp(0.2)), (3, lp(0.1))]]
    nxt = search.step([([], 0.0)], cands)
    assert [n.token_id for n in nxt] == [1, 2]
    assert search.finished == []


def test_candidates_are_ranked_across_beams_by_cumulative_logprob():
    search = BeamSearch(beam_width=2, max_tokens=5)
    beams = [([1], lp(0.6)), ([2], lp(0.4))]
    cands = [
        [(5, lp(0.5)), (6, lp(0.5)), (7, -30.0), (8, -30.0)],  # log 0.3 each
        [(5, lp(0.9)), (6, lp(0.1)), (7, -30.0), (8, -30.0)],  # log 0.36 for token 5
    ]
    nxt = search.step(beams, cands)
    assert [(n.parent, n.token_id) for n in nxt] == [(1, 5), (0, 5)]
    assert nxt[0].cum_logprob == pytest.approx(lp(0.36))


def test_length_limit_finishes_the_best_k_and_ends():
    search = BeamSearch(beam_width=2, max_tokens=2, length_penalty=2.0)
    beams = [([1], lp(0.5)), ([2], lp(0.25))]
    cands = [[(3, lp(0.5)), (4, lp(0.25))], [(5, lp(0.5)), (6, lp(0.5))]]
    assert search.step(beams, cands) == []
    assert search.done
    hyps = search.results()
    # (1, 4) and (2, 5) tie at 0.125: the lower beam wins, as in a flat top-k.
    assert [h.token_ids for h in hyps] == [(1, 3), (1, 4)]
    assert hyps[0].score == pytest.approx(lp(0.25) / 2**2.0)
    assert all(h.finish_reason == "length" for h in hyps)


def test_heuristic_stop_once_no_running_beam_can_win():
    search = BeamSearch(beam_width=1, max_tokens=10, eos_token_ids=[EOS])
    # Step 1: EOS is the best candidate: it finishes with score log 0.9 / 1.
    nxt = search.step([([], 0.0)], [[(EOS, lp(0.9)), (1, lp(0.1)), (2, -30.0)]])
    assert search.done  # the running beam (log 0.1) cannot beat log 0.9 at length 1
    assert nxt == []
    assert search.results()[0].token_ids == (EOS,)


def test_early_stopping_never_compares_at_the_longest_length():
    # With length_penalty > 0, "never" divides the best running score by max_tokens**lp,
    # which can still beat a short finished hypothesis: the search goes on.
    search = BeamSearch(
        beam_width=1, max_tokens=10, eos_token_ids=[EOS], length_penalty=1.0,
        early_stopping="never",
    )  # fmt: skip
    search.step([([], 0.0)], [[(EOS, lp(0.5)), (1, lp(0.4)), (2, -30.0)]])
    assert not search.done  # log 0.4 / 10 > log 0.5 / 1
    search = BeamSearch(beam_width=1, max_tokens=10, eos_token_ids=[EOS], length_penalty=1.0)
    search.step([([], 0.0)], [[(EOS, lp(0.5)), (1, lp(0.4)), (2, -30.0)]])
    assert search.done  # False compares at the current length: log 0.4 < log 0.5


def test_early_stopping_true_ends_when_k_hypotheses_finished():
    search = BeamSearch(beam_width=1, max_tokens=10, eos_token_ids=[EOS], early_stopping=True)
    search.step([([], 0.0)], [[(EOS, lp(0.5)), (1, lp(0.4)), (2, -30.0)]])
    assert search.done


def test_results_of_a_cut_search_include_running_beams():
    search = BeamSearch(beam_width=2, max_tokens=10)
    hyps = search.results([([1, 2], lp(0.5)), ([3, 4], lp(0.25))])
    assert [h.token_ids for h in hyps] == [(1, 2), (3, 4)]
    assert hyps[0].score == pytest.approx(lp(0.5) / 2)


def test_invalid_arguments():
    with pytest.raises(ValueError):
        BeamSearch(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError):
        BeamSearch(beam_width=2, max_tokens=4, early_stopping="sometimes")
    with pytest.raises(ValueError):
        BeamSearch(beam_width=2, max_tokens=4).step([([], 0.0)], [])
