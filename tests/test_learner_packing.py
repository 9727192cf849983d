"""Sequence packing: the plan places every sequence once within its budgets, and
log-probs computed on packed rows equal those of each sequence run alone."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from helpers import build_tiny_qwen, trajs

from asyncrl.learner.batch import collate
from asyncrl.learner.logprobs import to_rows, token_logprobs
from asyncrl.learner.model import policy_forward
from asyncrl.learner.packing import SequenceTooLong, build_packed, plan

# fp32, same weights, different attention layouts (block-diagonal rows vs one sequence):
# measured <= 5e-7 here.
PACKED_LOGP_ATOL = 1e-5


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    d = build_tiny_qwen(tmp_path_factory.mktemp("m"))
    return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()


def alone(model, t) -> torch.Tensor:
    """Log-probs of one trajectory's response, the sequence run by itself."""
    ids = torch.tensor(np.concatenate([t.prompt_ids, t.response_ids]), dtype=torch.long)[None]
    logp = model(input_ids=ids).logits[0].log_softmax(-1)
    p, r = len(t.prompt_ids), len(t.response_ids)
    return logp[p - 1 : p - 1 + r].gather(-1, torch.as_tensor(t.response_ids).long()[:, None])[:, 0]


@pytest.mark.parametrize("row_tokens", [None, 24, 64])
@torch.no_grad()
def test_packed_logprobs_equal_sequence_by_sequence(model, row_tokens):
    torch.set_num_threads(1)
    ts = trajs(20, seed=5, max_prompt=9, max_response=10)
    batch = collate(ts)
    pl = plan((batch.resp_start + batch.resp_len).tolist(), 1, 64, row_tokens)
    rows_seen = 0
    for rows in pl.ranks[0]:
        pk = build_packed(batch, rows)
        rows_seen += len(rows)
        logits, _ = policy_forward(model, None, pk.input_ids, pk.position_ids, pk.flat_pos)
        T = int(batch.resp_len.max())
        lp = to_rows(token_logprobs(logits, pk.targets, 1.0), pk.seq, pk.tok, (len(pk.seqs), T))
        for b, i in enumerate(pk.seqs):
            want = alone(model, ts[i])
            torch.testing.assert_close(lp[b, : len(want)], want, atol=PACKED_LOGP_ATOL, rtol=0)
            assert (lp[b, len(want) :] == 0).all()
    assert rows_seen < len(ts)  # several sequences really shared rows


def test_restarting_positions_are_what_isolates_sequences(model):
    """Control: the same rows with running positions give different log-probs."""
    ts = trajs(6, seed=2)
    batch = collate(ts)
    pk = build_packed(batch, [[0, 1, 2, 3, 4, 5]])
    running = torch.arange(pk.input_ids.shape[1])[None]
    with torch.no_grad():
        a, _ = policy_forward(model, None, pk.input_ids, pk.position_ids, pk.flat_pos)
        b, _ = policy_forward(model, None, pk.input_ids, running, pk.flat_pos)
    assert (a - b).abs().max() > 1e-3


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_plan_places_every_sequence_once_within_budgets(world_size):
    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 60, 200).tolist()
    pl = plan(lengths, world_size, micro_batch_tokens=256, row_tokens=128)
    seen = [i for micro in pl.ranks for mb in micro for row in mb for i in row]
    assert sorted(seen) == list(range(200))
    loads = []
    for micro in pl.ranks:
        for mb in micro:
            fills = [sum(lengths[i] for i in row) for row in mb]
            assert max(fills) <= 128 and len(mb) * max(fills) <= 256
        loads.append(sum(lengths[i] for mb in micro for row in mb for i in row))
    assert max(loads) - min(loads) <= max(lengths)  # split by tokens, not by count
    assert pl.efficiency() > 0.9


def test_packing_efficiency_on_the_default_task():
    from asyncrl.tasks.arithmetic import AdditionTask

    task, rng = AdditionTask(max_operand=19), random.Random(0)
    lengths = []
    for _ in range(16 * 8):  # one default batch: 16 groups x 8 samples
        p = task.sample(rng)
        lengths.append(len(p.text) + len(p.answer) + 1)  # character tokens + eos
    for ws in (1, 2):
        assert plan(lengths, ws, 4096).efficiency() >= 0.95


def test_too_long_sequence_is_rejected_with_the_key():
    with pytest.raises(SequenceTooLong, match=r"sequence 1 has 50 tokens.*micro_batch_tokens=40"):
        plan([10, 50, 3], 1, 40)


def test_rank_without_sequences_gets_a_dummy():
    pl = plan([5], 2, 100)
    assert pl.num_micro == 1 and pl.ranks[1] == []
    pk = build_packed(collate(trajs(1)), [])
    assert pk.seqs == [] and pk.input_ids.shape == (1, 1)
