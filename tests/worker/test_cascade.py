"""Finding the prompt prefix that a step's decode requests share in their block tables."""

from __future__ import annotations

import numpy as np
import pytest

from tokenmill.worker import cascade
from tokenmill.worker.cascade import (
    CASCADE_MIN_DECODES,
    CASCADE_MIN_PREFIX_TOKENS,
    CASCADE_MIN_SAVED_TOKENS,
    CASCADE_MIN_SAVED_TOKENS_WITHOUT_GRAPH,
    common_prefix_len,
)

BS = 16


@pytest.fixture
def no_saving_bar(monkeypatch):
    """Tests of where the prefix ends: any shared prefix counts, however few reads it saves."""
    monkeypatch.setattr(cascade, "CASCADE_MIN_SAVED_TOKENS", 0)
    monkeypatch.setattr(cascade, "CASCADE_MIN_SAVED_TOKENS_WITHOUT_GRAPH", 0)


def tables(num_reqs: int, shared_blocks: int, width: int = 60, seed: int = 0) -> np.ndarray:
    """Random distinct block ids per request, the first ``shared_blocks`` columns equal."""
    rng = np.random.default_rng(seed)
    ids = rng.permutation(num_reqs * width + 1000)[: num_reqs * width].reshape(num_reqs, width)
    ids[:, :shared_blocks] = ids[0, :shared_blocks]
    return ids.astype(np.int32)


def test_shared_blocks_are_found(no_saving_bar):
    bt = tables(64, 40)
    seq = np.full(64, 900)
    assert common_prefix_len(bt, seq, 64, BS, replaces_graph=False) == 40 * BS


def test_prefix_stops_below_the_shortest_context_last_position(no_saving_bar):
    # All 60 columns equal, but a request at 401 tokens: its block 25 holds position 400,
    # which this step writes; the prefix stops at 25 blocks.
    bt = tables(16, 60)
    seq = np.full(16, 900)
    seq[5] = 401
    assert common_prefix_len(bt, seq, 16, BS, replaces_graph=False) == 25 * BS
    seq[5] = 400  # last position 399 sits in block 24
    assert common_prefix_len(bt, seq, 16, BS, replaces_graph=False) == 24 * BS


def test_only_the_decode_requests_count(no_saving_bar):
    bt = tables(20, 30)
    bt[16:, :] = 7  # prompt requests after the decodes share nothing with them
    seq = np.full(20, 800)
    assert common_prefix_len(bt, seq, 16, BS, replaces_graph=False) == 30 * BS


@pytest.mark.parametrize(
    "num_decodes,shared_blocks",
    [
        (CASCADE_MIN_DECODES - 1, 40),  # too few requests
        (16, CASCADE_MIN_PREFIX_TOKENS // BS - 1),  # too short a prefix
        (16, 0),  # nothing shared
    ],
)
def test_too_little_to_share(num_decodes, shared_blocks):
    bt = tables(num_decodes, shared_blocks)
    seq = np.full(num_decodes, 900)
    assert common_prefix_len(bt, seq, num_decodes, BS, replaces_graph=False) == 0


def test_one_differing_request_ends_the_prefix(no_saving_bar):
    bt = tables(16, 40)
    bt[9, 20] += 1
    seq = np.full(16, 900)
    assert common_prefix_len(bt, seq, 16, BS, replaces_graph=False) == 20 * BS


def test_enough_saved_reads_with_and_without_a_graph_to_give_up():
    n = 16
    blocks = CASCADE_MIN_SAVED_TOKENS // (n * BS)  # exactly the bar of a mixed step
    assert n * blocks * BS < CASCADE_MIN_SAVED_TOKENS_WITHOUT_GRAPH
    bt = tables(n, blocks + 5, width=blocks + 10)
    bt[1:, blocks] += 1  # the prefix ends at ``blocks``
    seq = np.full(n, 2500)
    assert common_prefix_len(bt, seq, n, BS, replaces_graph=False) == blocks * BS
    assert common_prefix_len(bt, seq, n, BS, replaces_graph=True) == 0
    bt = tables(64, 68, width=80)  # 64 x 1,088 tokens
    assert common_prefix_len(bt, np.full(64, 1200), 64, BS, replaces_graph=True) == 68 * BS
    small = tables(CASCADE_MIN_DECODES, CASCADE_MIN_PREFIX_TOKENS // BS)
    seq = np.full(CASCADE_MIN_DECODES, 900)
    assert common_prefix_len(small, seq, CASCADE_MIN_DECODES, BS, replaces_graph=False) == 0
