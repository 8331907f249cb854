"""The beam bookkeeping of pagedserve/beam_search.py on scripted candidates: which beams stay
live, which complete, how they are ranked, when the search ends."""

from __future__ import annotations

import math

import pytest

from pagedserve.beam_search import (
    MAX_BEAM_WIDTH,
    Beam,
    BeamSearch,
    BeamSearchParams,
    beam_output,
    search_sequences,
)

EOS = 9
PROMPT = [1, 2]


def _search(width: int, max_tokens: int, length_penalty: float = 1.0,
            eos: frozenset[int] = frozenset({EOS})) -> BeamSearch:
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens,
                              length_penalty=length_penalty)
    return BeamSearch(PROMPT, params, max_tokens, eos)


def _lp(p: float) -> float:
    return math.log(p)


def test_rounds_keep_the_width_best_and_complete_eos_beams():
    search = _search(width=2, max_tokens=3)
    assert search.pending() == [PROMPT]
    # Round 1: four candidates (2 x width); the best two non-EOS stay live, EOS completes.
    search.advance([{5: _lp(0.4), EOS: _lp(0.3), 6: _lp(0.2), 7: _lp(0.05), 8: _lp(0.01)}])
    assert [b.tokens for b in search.live] == [[5], [6]]
    assert [(b.tokens, b.eos_id) for b in search.complete] == [([EOS], EOS)]
    assert search.pending() == [PROMPT + [5], PROMPT + [6]]
    # 8 was the fifth candidate: not taken.
    search.advance([{5: _lp(0.9), EOS: _lp(0.1)}, {7: _lp(0.99), 5: _lp(0.01)}])
    # By mean log-probability: [6, 7] = log(0.2 * 0.99) / 2, [5, 5] = log(0.4 * 0.9) / 2.
    assert [b.tokens for b in search.live] == [[5, 5], [6, 7]]
    assert [b.tokens for b in search.complete] == [[EOS], [5, EOS]]
    search.advance([{EOS: _lp(1.0)}, {EOS: _lp(0.5), 3: _lp(0.5)}])
    assert search.pending() == []  # max_tokens rounds: the live beams are final
    best = search.best()
    # Scores: [5, 5, EOS] log(0.36) / 2 = -0.51; [5, EOS] log(0.04) / 1 = -3.2; [EOS] -1.2;
    # [6, 7, 3] log(0.099) / 3 = -0.77; [6, 7, EOS] log(0.099) / 2 = -1.16.
    assert [b.tokens for b in best] == [[5, 5, EOS], [6, 7, 3]]
    assert best[0].cum_logprob == pytest.approx(math.log(0.4 * 0.9 * 1.0))


def test_length_penalty_zero_ranks_by_the_sum():
    search = _search(width=1, max_tokens=2, length_penalty=0.0)
    search.advance([{3: _lp(0.6), EOS: _lp(0.4)}])
    search.advance([{4: _lp(0.5), 5: _lp(0.4)}])
    # Sum: [EOS] log(0.4) = -0.92 beats [3, 4] log(0.3) = -1.2 (by the mean it would not).
    assert [b.tokens for b in search.best()] == [[EOS]]


def test_the_search_ends_when_no_beam_is_live():
    search = _search(width=1, max_tokens=50)
    search.advance([{EOS: _lp(0.7), 4: _lp(0.2)}])
    search.advance([{EOS: _lp(0.9)}])
    assert search.pending() == [] and search.rounds == 2
    assert [b.tokens for b in search.best()] == [[EOS]]


def test_without_eos_ids_every_token_extends():
    search = _search(width=2, max_tokens=1, eos=frozenset())
    search.advance([{EOS: _lp(0.6), 4: _lp(0.3)}])
    assert [(b.tokens, b.eos_id) for b in search.best()] == [([EOS], None), ([4], None)]


def test_outputs_leave_eos_out_of_the_text_and_say_why_they_stopped():
    decoded: list[list[int]] = []

    def decode(ids: list[int]) -> str:
        decoded.append(ids)
        return "".join(chr(ord("a") + i) for i in ids)

    assert beam_output(Beam([3, EOS], -1.0, EOS), 0, EOS, decode).finish_reason == "stop"
    assert decoded[-1] == [3]
    extra = beam_output(Beam([3, 7], -1.0, 7), 1, EOS, decode)
    assert (extra.finish_reason, extra.stop_reason, extra.text) == ("stop", 7, "d")
    cut = beam_output(Beam([3, 4], -2.0), 2, EOS, decode)
    assert (cut.finish_reason, cut.stop_reason, cut.token_ids, cut.text) == (
        "length", None, [3, 4], "de")
    search = _search(width=1, max_tokens=1)
    search.advance([{4: _lp(0.5)}])
    (sequence,) = search_sequences(search, EOS, decode).sequences
    assert sequence.tokens == PROMPT + [4] and sequence.text == "e"


@pytest.mark.parametrize("kwargs, field", [
    ({"beam_width": 0}, "beam_width"),
    ({"beam_width": MAX_BEAM_WIDTH + 1}, "beam_width"),
    ({"beam_width": 2, "max_tokens": 0}, "max_tokens"),
    ({"beam_width": 2, "temperature": 0.7}, "temperature"),
    ({"beam_width": 2, "length_penalty": math.inf}, "length_penalty"),
])
def test_params_are_checked_by_name(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        BeamSearchParams(**kwargs)


def test_only_the_width_best_complete_beams_are_kept():
    """A complete beam's score never changes, so the worse ones are dropped each round (a long
    search would otherwise hold every EOS candidate of every round)."""
    search = _search(width=1, max_tokens=20, eos=frozenset({EOS, 8}))
    for _ in range(5):
        search.advance([{3: _lp(0.5), EOS: _lp(0.3), 8: _lp(0.2)}])
        assert len(search.complete) == 1
    # By the mean per token (EOS not counted): (4 log 0.5 + log 0.3) / 4 beats log 0.3.
    assert search.complete[0].tokens == [3, 3, 3, 3, EOS]
