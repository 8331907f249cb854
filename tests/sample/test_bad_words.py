"""bad_words in the sampler: a word's last token is blocked exactly when the output so far ends
with its other tokens, step after step, per slot; other rows and the logprobs stay as they are."""

from __future__ import annotations

import torch

from pagedserve.sample import Sampler
from pagedserve.sampling_params import SamplingParams
from tests.sample.sampling_helpers import add_request, batch_of, make_sampler

V = 32
GREEDY = 0.0
SECOND = 20
"""Every crafted row's second-best token: what a greedy row takes when its best is blocked."""


def _logits(best: list[int], device: torch.device) -> torch.Tensor:
    """fp32 [len(best), V]: row i peaks at best[i], then at SECOND, the rest is noise below."""
    logits = torch.linspace(-1.0, 0.0, V).repeat(len(best), 1)  # [num_rows, V]
    logits[:, SECOND] = 4.0
    logits[torch.arange(len(best)), torch.tensor(best)] = 5.0
    return logits.to(device)


def _step(sampler: Sampler, slots: list[int], best: list[int], device: torch.device) -> list[int]:
    """Sample one step of the slots from crafted logits and keep the tokens."""
    idx_mapping, idx_np = batch_of(slots, device)
    sampled = sampler.sample(_logits(best, device), idx_mapping, idx_np)
    sampler.update_after_sampling(idx_mapping, sampled)
    return sampled.tolist()


def _words(*words: list[int], temperature: float = GREEDY) -> SamplingParams:
    return SamplingParams(temperature=temperature, bad_words_token_ids=list(words))


def test_a_one_token_word_is_never_sampled(device: torch.device) -> None:
    sampler = make_sampler(4, V, device)
    add_request(sampler, 0, _words([5]), [1], [])
    add_request(sampler, 1, SamplingParams(temperature=GREEDY), [1], [])
    for _ in range(3):
        assert _step(sampler, [0, 1], [5, 5], device) == [SECOND, 5]


def test_a_two_token_word_blocks_its_last_token_only_after_its_first(
    device: torch.device,
) -> None:
    sampler = make_sampler(4, V, device)
    add_request(sampler, 2, _words([3, 7]), [3], [])  # the prompt's 3 does not count
    best = [7, 3, 7, 7, 3, 3, 7]
    taken = [_step(sampler, [2], [b], device)[0] for b in best]
    assert taken == [7, 3, SECOND, 7, 3, 3, SECOND]


def test_a_longer_word_matches_its_whole_prefix(device: torch.device) -> None:
    sampler = make_sampler(4, V, device)
    add_request(sampler, 0, _words([2, 3, 9]), [1], [])
    best = [2, 3, 9, 3, 9, 2, 2, 3, 9]
    taken = [_step(sampler, [0], [b], device)[0] for b in best]
    assert taken == [2, 3, SECOND, 3, 9, 2, 2, 3, SECOND]


def test_two_matching_words_on_one_token_stay_minus_infinity(device: torch.device) -> None:
    """-inf twice on the same logit is still -inf (not NaN): the row takes its second best."""
    sampler = make_sampler(2, V, device)
    add_request(sampler, 0, _words([4, 6], [6], [5, 4, 6]), [1], [5, 4])
    idx_mapping, idx_np = batch_of([0], device)
    processed = sampler.process_logits(_logits([6], device), idx_mapping, idx_np)
    assert processed[0, 6] == float("-inf") and not processed.isnan().any()
    assert _step(sampler, [0], [6], device) == [SECOND]


def test_rows_without_words_are_unchanged(device: torch.device) -> None:
    """A seeded random row and a greedy row sample the same next to a row with words as in a
    batch without it."""
    plain = [SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=GREEDY)]
    alone = make_sampler(4, V, device)
    mixed = make_sampler(4, V, device)
    for slot, params in enumerate(plain):
        add_request(alone, slot, params, [1], [])
        add_request(mixed, slot, params, [1], [])
    add_request(mixed, 2, _words([3], [3, 7], temperature=1.0), [1], [])
    torch.manual_seed(0)
    for _ in range(6):
        logits = torch.randn(3, V, device=device)
        ref = alone.sample(logits[:2], *batch_of([0, 1], device))
        alone.update_after_sampling(batch_of([0, 1], device)[0], ref)
        idx_mapping, idx_np = batch_of([0, 1, 2], device)
        got = mixed.sample(logits, idx_mapping, idx_np)
        mixed.update_after_sampling(idx_mapping, got)
        assert got[:2].tolist() == ref.tolist() and got[2].item() != 3


def test_a_reused_slot_forgets_the_words(device: torch.device) -> None:
    sampler = make_sampler(2, V, device)
    add_request(sampler, 0, _words([5], [3, 7]), [1], [])
    assert _step(sampler, [0], [5], device) == [SECOND]
    add_request(sampler, 0, SamplingParams(temperature=GREEDY), [1], [3])
    assert sampler.bad_words.num_words[0] == 0
    assert _step(sampler, [0], [5], device) == [5]
    assert _step(sampler, [0, 1], [7, 7], device)[0] == 7
    add_request(sampler, 0, _words([7]), [1], [])
    assert _step(sampler, [0], [5], device) == [5]  # 5 is no word of this request


def test_a_resumed_request_matches_the_outputs_it_brings_back(device: torch.device) -> None:
    """Preempted after outputs ending with a word's first token: its next token is blocked;
    the same tokens in the prompt block nothing."""
    sampler = make_sampler(3, V, device)
    add_request(sampler, 0, _words([3, 7], [2, 3, 8]), [1], [9, 2, 3])
    add_request(sampler, 1, _words([3, 7], [2, 3, 8]), [9, 2, 3], [])
    add_request(sampler, 2, _words([3, 7], [2, 3, 8]), [1], [2, 3, 1])
    assert _step(sampler, [0, 1, 2], [7, 7, 7], device) == [SECOND, 7, 7]
    add_request(sampler, 0, _words([3, 7], [2, 3, 8]), [1], [9, 2, 3])
    assert _step(sampler, [0], [8], device) == [SECOND]


def test_a_wider_table_keeps_the_recent_tokens_of_running_requests(
    device: torch.device,
) -> None:
    """A request with a longer word widens the tables while another one runs: the running one's
    last output token is still there, right-aligned."""
    sampler = make_sampler(3, V, device)
    add_request(sampler, 0, _words([3, 7]), [1], [])
    assert _step(sampler, [0], [3], device) == [3]
    assert sampler.bad_words.prefix_len == 1
    add_request(sampler, 1, _words([1, 2, 3, 4, 5], *[[10 + i] for i in range(5)]), [1], [])
    assert (sampler.bad_words.prefix_len, sampler.bad_words.width) == (4, 8)
    assert _step(sampler, [0, 1], [7, 12], device) == [SECOND, SECOND]


def test_logprobs_stay_raw(device: torch.device) -> None:
    sampler = make_sampler(2, V, device)
    add_request(sampler, 0, SamplingParams(temperature=GREEDY, logprobs=2,
                                           bad_words_token_ids=[[5]]), [1], [])
    logits = _logits([5], device)
    out = sampler(logits, *batch_of([0], device))
    assert out.sampled_token_ids.tolist() == [SECOND]
    assert out.logprobs is not None
    assert out.logprobs.token_ids[0, 1:].tolist() == [5, SECOND]  # the two most likely, raw
    raw = torch.log_softmax(logits.float(), dim=-1)[0, 5]
    assert torch.isclose(out.logprobs.logprobs[0, 1], raw)
