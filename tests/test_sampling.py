"""The logits processors against their plain references, and choose(): which tokens each
parameter allows, the logprobs it reports, and greedy without parameters staying the argmax."""

from __future__ import annotations

import pytest
import torch

from pocketllm.engine.sampling import (
    PROMPT_LOGPROB_ROWS,
    SamplingParams,
    apply_penalties_,
    apply_penalties_reference,
    choose,
    draw,
    draw_reference,
    likeliest,
    likeliest_reference,
    min_p_filter,
    min_p_filter_reference,
    prompt_logprobs,
    top_k_filter,
    top_k_filter_reference,
    top_p_filter,
    top_p_filter_reference,
)

V = 64


def logits_row(seed: int) -> torch.Tensor:
    return torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("repetition,frequency,presence", [(1.3, 0, 0), (0.7, 0, 0), (1, 0.5, 0), (1, 0, -0.8), (1.6, 0.4, 0.9)],
                         ids=["rep>1", "rep<1", "frequency", "presence<0", "all"])
def test_penalties_match_the_reference(repetition, frequency, presence):
    prompt, output = [1, 5, 5, 9, 30], [9, 12, 12, 12, 40, 1]
    x = logits_row(0)
    got = apply_penalties_(x.clone(), prompt, output, repetition, frequency, presence)
    want = apply_penalties_reference(x.clone(), prompt, output, repetition, frequency, presence)
    torch.testing.assert_close(got, want)
    untouched = [t for t in range(V) if t not in prompt + output]
    assert torch.equal(got[untouched], x[untouched])
    if repetition != 1:
        # Prompt-only tokens are penalized by the repetition penalty alone.
        assert got[5] != x[5] and got[30] != x[30]


def test_a_nucleus_past_the_first_likeliest_looked_at_is_found_whole(monkeypatch):
    """top_p_filter looks for the nucleus among the k likeliest, k growing while their mass is
    under top_p: held to 3 to start, nuclei of one token to the whole row, flat and peaked."""
    import pocketllm.engine.sampling as sampling

    monkeypatch.setattr(sampling, "NUCLEUS_FIRST", 3)
    monkeypatch.setattr(sampling, "NUCLEUS_GROWTH", 2)
    for scale in (0.1, 3.0):
        probs = torch.softmax(torch.randn(1000, generator=torch.Generator().manual_seed(7)) * scale, dim=-1)
        for p in (1e-46, 0.1, 0.5, 0.93, 0.999999, 1.0 - 1e-9):
            assert torch.equal(top_p_filter(probs, p), top_p_filter_reference(probs, p)), (scale, p)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_filters_match_their_references(seed):
    probs = torch.softmax(logits_row(seed), dim=-1)
    for p in (0.1, 0.5, 0.93):
        kept = top_p_filter(probs, p)
        assert torch.equal(kept, top_p_filter_reference(probs, p)) and kept.sum() >= p
    # Below float32's least value a valid top_p compares as 0 in the tensors: the likeliest token
    # is kept all the same (nothing was, and the draw indexed an empty list).
    kept = top_p_filter(probs, 1e-46)
    assert torch.equal(kept, top_p_filter_reference(probs, 1e-46)) and int((kept > 0).sum()) == 1
    for p in (0.05, 0.3):
        assert torch.equal(min_p_filter(probs, p), min_p_filter_reference(probs, p))
    for k in (1, 5, V - 1):
        (kept, ids), (want, want_ids) = top_k_filter(probs, k), top_k_filter_reference(probs, k)
        assert torch.equal(kept, want) and torch.equal(ids, want_ids)


def test_greedy_without_parameters_is_the_argmax_and_logprobs_are_the_raw_log_softmax():
    x = logits_row(3)
    gen = torch.Generator()
    assert SamplingParams().plain_greedy and choose(x, SamplingParams(), [1], [], (), gen) == (int(x.argmax()), None)
    token, lp = choose(x, SamplingParams(logprobs=4, repetition_penalty=1.5), [1], [int(x.argmax())], (), gen)
    logprobs = torch.log_softmax(x, dim=-1)
    # The logprobs are the model's, before the penalty that changed the choice.
    assert token != int(x.argmax()) and lp.logprob == pytest.approx(float(logprobs[token]))
    assert [t for t, _ in lp.top] == torch.topk(logprobs, 4).indices.tolist()
    assert [v for _, v in lp.top] == pytest.approx(torch.topk(logprobs, 4).values.tolist())


def test_min_tokens_masks_every_stop_token_until_reached_and_ignore_eos_drops_eos():
    x = logits_row(4)
    order = torch.argsort(x, descending=True).tolist()
    eos, stop = order[0], order[1]
    params = SamplingParams(min_tokens=3, stop_token_ids=(stop,))
    gen = torch.Generator()
    assert choose(x, params, [1], [7, 8], (eos,), gen)[0] == order[2]
    assert choose(x, params, [1], [7, 8, 9], (eos,), gen)[0] == eos
    assert params.stop_ids((eos,)) == {eos, stop}
    assert SamplingParams(ignore_eos=True, stop_token_ids=(stop,)).stop_ids((eos,)) == {stop}


def test_logit_bias_moves_the_argmax():
    x = logits_row(5)
    low = int(x.argmin())
    assert choose(x, SamplingParams(logit_bias=((low, 100.0),)), [1], [], (), torch.Generator())[0] == low


def test_top_k_and_min_p_keep_sampling_within_their_sets():
    x = logits_row(6)
    top3 = set(torch.topk(x, 3).indices.tolist())
    gen = torch.Generator().manual_seed(0)
    hot = SamplingParams(temperature=2.0, top_k=3, seed=0)
    assert {choose(x, hot, [1], [], (), gen)[0] for _ in range(200)} == top3
    # min_p 1: only the likeliest token is as likely as the likeliest.
    assert {choose(x, SamplingParams(temperature=2.0, min_p=1.0), [1], [], (), gen)[0] for _ in range(20)} == {int(x.argmax())}


@pytest.mark.parametrize("seed", range(4))
def test_draw_matches_its_reference_and_never_takes_a_zero(seed):
    probs = torch.softmax(logits_row(seed), dim=0)
    probs[::3] = 0.0  # unnormalized, with holes
    a, b = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
    got = [draw(probs, a) for _ in range(300)]
    assert got == [draw_reference(probs, b) for _ in range(300)]
    assert all(probs[i] > 0 for i in got)


def test_draw_follows_the_distribution():
    probs = torch.tensor([0.5, 0.0, 0.3, 0.2, 0.0])
    gen = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.tensor([draw(probs, gen) for _ in range(4000)]), minlength=5).double() / 4000
    # Four thousand draws: each share within four standard deviations (at most ~0.032).
    assert counts[1] == 0 and counts[4] == 0
    assert torch.allclose(counts, probs.double(), atol=0.032), counts.tolist()


def test_likeliest_matches_its_reference():
    inf, nan = float("inf"), float("nan")
    rows = [logits_row(7), torch.tensor([1.0, 3.0, 3.0, -inf, nan]), torch.tensor([2.0, inf, 0.0, inf]),
            torch.tensor([-inf, nan, -inf]), torch.tensor([nan, 1.0])]
    for row in rows:
        got, want = likeliest(row), likeliest_reference(row)
        assert (got is None and want is None) or torch.equal(got, want), (row, got, want)


def test_logits_a_softmax_cannot_take_still_give_a_token():
    """A temperature so small that logits over it overflow, a repetition penalty near 0 that makes
    a seen token's logit +inf, and every token masked: each row gives a token where a draw from a
    NaN softmax would fail, the first two the tokens their limits allow."""
    x = logits_row(8)
    gen = torch.Generator().manual_seed(0)
    cold = SamplingParams(temperature=1e-45, seed=0)
    assert {choose(x, cold, [1], [], (), gen)[0] for _ in range(20)} == {int(x.argmax())}
    seen = [int(i) for i in torch.nonzero(x > 0).flatten()[:3]]
    near_zero = SamplingParams(temperature=1.0, repetition_penalty=1e-300, seed=0)
    assert {choose(x, near_zero, seen, [], (), gen)[0] for _ in range(50)} == set(seen)
    masked = SamplingParams(temperature=1.0, min_tokens=2, stop_token_ids=tuple(range(V)), seed=0)
    assert 0 <= choose(x, masked, [1], [], (), gen)[0] < V


def test_prompt_logprobs_of_many_rows_are_each_rows_log_softmax():
    # More rows than are taken at a time, in bf16 as a pass's logits come: each row's own fp32
    # log_softmax, the following token's entry and the n likeliest, wherever the blocks are cut.
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(2 * PROMPT_LOGPROB_ROWS + 7, 500, generator=g) * 4).bfloat16()
    following = torch.randint(0, 500, (len(logits),), generator=g).tolist()
    got = prompt_logprobs(logits, following, 3)
    assert len(got) == len(logits)
    for row, token, lp in zip(logits, following, got):
        want = torch.log_softmax(row.float(), dim=-1)
        values, ids = torch.topk(want, 3)
        assert (lp.token, lp.logprob) == (token, float(want[token]))
        assert lp.top == list(zip(ids.tolist(), values.tolist()))
