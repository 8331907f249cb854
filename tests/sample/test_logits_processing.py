"""logit_bias, min_tokens, allowed_token_ids and penalties change the logits exactly as specified
(vLLM's rules)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve.sample import Sampler
from pagedserve.sampling_params import SamplingParams
from tests.sample.sampling_helpers import add_request, batch_of, make_sampler

V = 8
RAW = [1.5, -0.5, 2.0, -1.0, 0.25, 0.0, -2.0, 3.0]


def reference_penalties(
    logits: list[float],
    prompt: list[int],
    output: list[int],
    rep: float,
    freq: float,
    pres: float,
) -> np.ndarray:
    """Token-by-token statement of the rules, in float64."""
    out = np.array(logits, dtype=np.float64)
    for tok in range(len(out)):
        count = output.count(tok)
        if tok in prompt or count > 0:
            out[tok] = out[tok] / rep if out[tok] > 0 else out[tok] * rep
        out[tok] -= freq * count + pres * (count > 0)
    return out


def processed(sampler: Sampler, logits: torch.Tensor, slots: list[int]) -> np.ndarray:
    idx_mapping, idx_np = batch_of(slots, logits.device)
    return sampler.process_logits(logits, idx_mapping, idx_np).cpu().numpy()


def test_penalties_follow_the_rules(device: torch.device) -> None:
    prompt, output = [0, 1, 5], [2, 3, 3]
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.3, presence_penalty=0.2)
    sampler = make_sampler(4, V, device)
    add_request(sampler, 2, params, prompt, output)
    logits = torch.tensor([RAW], device=device)
    expected = reference_penalties(RAW, prompt, output, 1.5, 0.3, 0.2)
    np.testing.assert_allclose(processed(sampler, logits, [2])[0], expected, rtol=1e-6)

    # A sampled token is counted on the device and penalised from the next step on.
    idx_mapping, _ = batch_of([2], device)
    sampler.update_after_sampling(idx_mapping, torch.tensor([7], device=device))
    expected = reference_penalties(RAW, prompt, output + [7], 1.5, 0.3, 0.2)
    np.testing.assert_allclose(processed(sampler, logits, [2])[0], expected, rtol=1e-6)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(repetition_penalty=0.7),
        SamplingParams(frequency_penalty=-1.0),
        SamplingParams(presence_penalty=1.5),
    ],
    ids=["repetition", "frequency", "presence"],
)
def test_each_penalty_alone(params: SamplingParams) -> None:
    prompt, output = [4, 6], [4, 1, 1]
    sampler = make_sampler(2, V, torch.device("cpu"))
    add_request(sampler, 0, params, prompt, output)
    expected = reference_penalties(
        RAW,
        prompt,
        output,
        params.repetition_penalty,
        params.frequency_penalty,
        params.presence_penalty,
    )
    np.testing.assert_allclose(processed(sampler, torch.tensor([RAW]), [0])[0], expected, rtol=1e-6)


def test_logit_bias_is_added_before_penalties_and_other_rows_are_untouched(
    device: torch.device,
) -> None:
    bias = {1: 1.0, 7: -100.0, 0: 2.5}
    sampler = make_sampler(4, V, device)
    add_request(sampler, 0, SamplingParams(logit_bias=bias, repetition_penalty=2.0), [1], [])
    add_request(sampler, 3, SamplingParams(temperature=0.5, top_k=2), [1, 2], [])
    logits = torch.tensor([RAW, RAW], device=device, dtype=torch.bfloat16)
    got = processed(sampler, logits, [3, 0])
    np.testing.assert_array_equal(got[0], logits[0].float().cpu().numpy())
    biased = [x + bias.get(tok, 0.0) for tok, x in enumerate(logits[1].float().tolist())]
    # Token 1: -0.5 + 1.0 = 0.5 > 0, so the repetition penalty divides (it would multiply if
    # the bias came after the penalty).
    expected = reference_penalties(biased, [1], [], 2.0, 0.0, 0.0)
    np.testing.assert_allclose(got[1], expected, rtol=1e-6)
    assert got[1][1] == pytest.approx(0.25)


def test_process_logits_leaves_the_input_alone() -> None:
    sampler = make_sampler(1, V, torch.device("cpu"))
    add_request(sampler, 0, SamplingParams(logit_bias={2: 3.0}, presence_penalty=1.0), [], [2])
    logits = torch.tensor([RAW])
    processed(sampler, logits, [0])
    assert logits[0].tolist() == RAW


def test_min_tokens_blocks_eos_and_stop_token_ids(device: torch.device) -> None:
    """Greedy on logits that favour eos (7), then stop token 4: both blocked for 3 tokens."""
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[4])
    sampler = make_sampler(2, V, device)
    add_request(sampler, 1, params, [0], [], eos_token_id=7)
    logits = torch.tensor([[0.0, 1.0, 0.0, 0.0, 4.0, 0.0, 0.0, 5.0]], device=device)
    idx_mapping, idx_np = batch_of([1], device)
    tokens = []
    for _ in range(4):
        sampled = sampler(logits, idx_mapping, idx_np).sampled_token_ids
        sampler.update_after_sampling(idx_mapping, sampled)
        tokens.append(int(sampled[0]))
    assert tokens == [1, 1, 1, 7]


def test_min_tokens_counts_resumed_output_and_respects_ignore_eos() -> None:
    sampler = make_sampler(2, V, torch.device("cpu"))
    params = SamplingParams(min_tokens=3, stop_token_ids=[4])
    add_request(sampler, 0, params, [0], [1, 1], eos_token_id=7)  # resumed: 1 token to go
    add_request(
        sampler,
        1,
        SamplingParams(min_tokens=3, stop_token_ids=[4], ignore_eos=True),
        [0],
        [],
        eos_token_id=7,
    )
    got = processed(sampler, torch.zeros(2, V), [0, 1])
    blocked = np.isneginf(got)
    assert blocked[0].tolist() == [t in (4, 7) for t in range(V)]
    assert blocked[1].tolist() == [t == 4 for t in range(V)]
    idx_mapping, _ = batch_of([0], torch.device("cpu"))
    sampler.update_after_sampling(idx_mapping, torch.tensor([2]))
    assert not np.isneginf(processed(sampler, torch.zeros(1, V), [0])).any()


def test_a_new_request_in_a_used_slot_starts_clean() -> None:
    sampler = make_sampler(1, V, torch.device("cpu"))
    add_request(
        sampler,
        0,
        SamplingParams(logit_bias={3: 5.0}, frequency_penalty=1.0, min_tokens=2),
        [0],
        [6],
        eos_token_id=7,
    )
    sampler.states.remove_request(0)  # what RequestStates.remove_request does
    add_request(sampler, 0, SamplingParams(presence_penalty=0.5), [1], [])
    got = processed(sampler, torch.tensor([RAW]), [0])
    np.testing.assert_array_equal(got[0], np.array(RAW, dtype=np.float32))


def test_logit_bias_table_grows_without_losing_rows() -> None:
    sampler = make_sampler(3, V, torch.device("cpu"))
    add_request(sampler, 0, SamplingParams(logit_bias={5: 1.0}), [0], [])
    add_request(sampler, 2, SamplingParams(logit_bias={t: float(t) for t in range(6)}), [0], [])
    got = processed(sampler, torch.zeros(2, V), [0, 2])
    assert got[0].tolist() == [0, 0, 0, 0, 0, 1, 0, 0]
    assert got[1].tolist() == [0, 1, 2, 3, 4, 5, 0, 0]


def allowed_only(logits: list[float], allowed: list[int]) -> np.ndarray:
    """The rule: -inf everywhere but at the allowed ids, whose logits are unchanged."""
    return np.array([x if t in allowed else -np.inf for t, x in enumerate(logits)], np.float32)


def test_allowed_token_ids_mask_every_other_token_and_pad_without_token_0(
    device: torch.device,
) -> None:
    """Rows of 1 and 3 ids in a table of width 4: their padding must not let token 0 through
    (unless it is allowed), and an unrestricted row in the same batch is untouched."""
    rows = {0: [0], 1: [6, 0, 3], 2: [5], 3: None, 4: [2, 7, 1, 4]}
    sampler = make_sampler(5, V, device)
    for slot, allowed in rows.items():
        add_request(sampler, slot, SamplingParams(allowed_token_ids=allowed), [0], [])
    assert sampler.logit_bias.allowed.width == 4
    got = processed(sampler, torch.tensor([RAW] * 5, device=device), [4, 3, 2, 1, 0])
    np.testing.assert_array_equal(got[0], allowed_only(RAW, [1, 2, 4, 7]))
    np.testing.assert_array_equal(got[1], np.array(RAW, dtype=np.float32))
    np.testing.assert_array_equal(got[2], allowed_only(RAW, [5]))
    np.testing.assert_array_equal(got[3], allowed_only(RAW, [0, 3, 6]))
    np.testing.assert_array_equal(got[4], allowed_only(RAW, [0]))


def test_allowed_token_ids_after_logit_bias_and_min_tokens() -> None:
    """The bias moves an allowed logit; min_tokens still blocks an allowed stop token."""
    params = SamplingParams(allowed_token_ids=[1, 4, 7], logit_bias={4: 2.0, 5: 9.0},
                            min_tokens=2, repetition_penalty=2.0)
    sampler = make_sampler(1, V, torch.device("cpu"))
    add_request(sampler, 0, params, [1], [], eos_token_id=7)
    got = processed(sampler, torch.tensor([RAW]), [0])[0]
    # Token 1: -0.5 in the prompt, multiplied by the repetition penalty.
    expected = [-np.inf, -1.0, -np.inf, -np.inf, 2.25, -np.inf, -np.inf, -np.inf]
    np.testing.assert_array_equal(got, np.array(expected, dtype=np.float32))


def test_allowed_token_ids_cleared_when_the_slot_is_reused() -> None:
    sampler = make_sampler(2, V, torch.device("cpu"))
    add_request(sampler, 1, SamplingParams(allowed_token_ids=[3, 4]), [0], [])
    sampler.states.remove_request(1)
    add_request(sampler, 1, SamplingParams(logit_bias={2: 1.0}), [0], [])
    expected = np.array(RAW, dtype=np.float32)
    expected[2] += 1.0
    np.testing.assert_array_equal(processed(sampler, torch.tensor([RAW]), [1])[0], expected)
    # A restricted request in the slot again, alone in a batch after the table grew.
    add_request(sampler, 0, SamplingParams(allowed_token_ids=list(range(5))), [0], [])
    add_request(sampler, 1, SamplingParams(allowed_token_ids=[6]), [0], [])
    np.testing.assert_array_equal(processed(sampler, torch.tensor([RAW]), [1])[0],
                                  allowed_only(RAW, [6]))


def test_allowed_token_ids_table_grows_without_losing_rows() -> None:
    """A row written at width 1 keeps only its own token once the table is 8 wide (the new
    columns repeat its id, not token 0)."""
    sampler = make_sampler(3, V, torch.device("cpu"))
    add_request(sampler, 0, SamplingParams(allowed_token_ids=[5]), [0], [])
    add_request(sampler, 1, SamplingParams(), [0], [])
    add_request(sampler, 2, SamplingParams(allowed_token_ids=[1, 2, 3, 4, 6]), [0], [])
    assert sampler.logit_bias.allowed.width == 8
    got = processed(sampler, torch.tensor([RAW] * 3), [0, 1, 2])
    np.testing.assert_array_equal(got[0], allowed_only(RAW, [5]))
    np.testing.assert_array_equal(got[1], np.array(RAW, dtype=np.float32))
    np.testing.assert_array_equal(got[2], allowed_only(RAW, [1, 2, 3, 4, 6]))
