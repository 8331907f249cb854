"""The Sampler end to end: greedy, seeds and batch invariance, resume, validation, no host sync."""

from __future__ import annotations

import pytest
import torch

from pagedserve.sample import Sampler
from pagedserve.sampling_params import SamplingParams
from tests.sample.sampling_helpers import add_request, batch_of, make_sampler

V = 64


def run_steps(
    sampler: Sampler,
    slots: list[int],
    logits_per_step: list[torch.Tensor],
) -> list[list[int]]:
    """Sample and advance every slot for each step; the token ids per step, in batch order."""
    idx_mapping, idx_np = batch_of(slots, logits_per_step[0].device)
    tokens = []
    for logits in logits_per_step:
        sampled = sampler(logits, idx_mapping, idx_np).sampled_token_ids
        sampler.update_after_sampling(idx_mapping, sampled)
        tokens.append(sampled.tolist())
    return tokens


def test_greedy_is_argmax(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(16, V, generator=gen).to(device=device, dtype=torch.bfloat16)
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1  # a tie: the first index wins
    sampler = make_sampler(32, V, device)
    slots = list(range(31, 15, -1))
    for slot in slots:
        add_request(sampler, slot, SamplingParams(temperature=0.0), [1], [])
    idx_mapping, idx_np = batch_of(slots, device)
    sampled = sampler(logits, idx_mapping, idx_np).sampled_token_ids
    assert sampled.dtype == torch.int64
    assert torch.equal(sampled, logits.float().argmax(dim=-1))
    assert int(sampled[3]) == 10


def test_greedy_rows_of_a_mixed_batch_are_argmax(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, V, generator=gen).to(device)
    sampler = make_sampler(6, V, device)
    for slot in range(6):
        temperature = 0.0 if slot % 2 == 0 else 1.5
        params = SamplingParams(temperature=temperature, top_k=3, top_p=0.5)
        add_request(sampler, slot, params, [1], [])
    idx_mapping, idx_np = batch_of(list(range(6)), device)
    sampled = sampler(logits, idx_mapping, idx_np).sampled_token_ids.cpu()
    argmax = logits.argmax(dim=-1).cpu()
    assert torch.equal(sampled[0::2], argmax[0::2])
    top3 = logits.topk(3, dim=-1).indices.cpu()
    assert all(int(sampled[r]) in top3[r].tolist() for r in (1, 3, 5))


SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, presence_penalty=0.5)
OTHERS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=0.7, min_p=0.1, seed=99),
    SamplingParams(temperature=1.0, repetition_penalty=1.3, logprobs=3),
    SamplingParams(temperature=0.5, top_p=0.5, logit_bias={3: 4.0}),
    SamplingParams(temperature=1.0, min_tokens=4, stop_token_ids=[2]),
    SamplingParams(temperature=2.0, frequency_penalty=0.7),
    SamplingParams(temperature=0.8, top_k=3, allowed_token_ids=[0, 9, 33, 50, 63]),
    SamplingParams(temperature=0.6, bad_words_token_ids=[[4, 7], [9], [1, 4, 11]]),
]


def test_seeded_request_samples_the_same_alone_and_in_a_batch(device: torch.device) -> None:
    num_steps = 12
    gen = torch.Generator().manual_seed(7)
    target_logits = [torch.randn(V, generator=gen) for _ in range(num_steps)]

    alone = make_sampler(4, V, device, seed=0)
    add_request(alone, 2, SEEDED, [5, 6, 7], [])
    alone_tokens = run_steps(alone, [2], [x.view(1, V).to(device) for x in target_logits])

    # The same request in slot 9, at row 6 of 16, among 15 others with other params; another
    # engine seed, so the unseeded neighbours draw differently too.
    batch = make_sampler(24, V, device, seed=5)
    slots = [0, 1, 3, 4, 5, 8, 9, 10, 11, 13, 14, 17, 18, 20, 22, 23]
    row = slots.index(9)
    for slot in slots:
        params = SEEDED if slot == 9 else OTHERS[slot % len(OTHERS)]
        add_request(batch, slot, params, [5, 6, 7], [], eos_token_id=2)
    steps = []
    for x in target_logits:
        logits = torch.randn(len(slots), V, generator=gen)
        logits[row] = x
        steps.append(logits.to(device))
    batch_tokens = run_steps(batch, slots, steps)

    assert [step[row] for step in batch_tokens] == [step[0] for step in alone_tokens]


def test_different_seeds_give_different_tokens() -> None:
    """The seed matters (so the test above can fail)."""
    logits = [torch.zeros(1, V)] * 8
    draws = []
    for seed in (1, 2):
        sampler = make_sampler(1, V, torch.device("cpu"))
        add_request(sampler, 0, SamplingParams(seed=seed), [1], [])
        draws.append(run_steps(sampler, [0], logits))
    assert draws[0] != draws[1]


def test_resumed_request_continues_its_stream(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(3)
    logits = [torch.randn(1, V, generator=gen).to(device) for _ in range(10)]
    full = make_sampler(2, V, device)
    add_request(full, 0, SEEDED, [5, 6], [])
    tokens = [step[0] for step in run_steps(full, [0], logits)]

    resumed = make_sampler(2, V, device)
    add_request(resumed, 1, SEEDED, [5, 6], tokens[:6])
    assert [step[0] for step in run_steps(resumed, [1], logits[6:])] == tokens[6:]


ALLOWED = [0, 5, 17, 40, 41]
"""Token 0 among them: the table's padding must not be what lets it through."""


def _steps_favouring_a_forbidden_token(num_rows: int, num_steps: int,
                                       device: torch.device) -> list[torch.Tensor]:
    """Random logits whose argmax is token 63, far ahead (a row that ignores its allowed ids
    picks it almost always, greedy or not)."""
    gen = torch.Generator().manual_seed(8)
    steps = [torch.randn(num_rows, V, generator=gen) for _ in range(num_steps)]
    for logits in steps:
        logits[:, 63] = 12.0
    return [logits.to(device) for logits in steps]


def test_allowed_token_ids_restrict_greedy_and_random_rows(device: torch.device) -> None:
    """A batch of restricted rows (greedy, and random ones at temperature 1 with several seeds,
    one also with top-k and top-p) among unrestricted ones, whose tokens are those they get
    without any restricted row beside them."""
    restricted = {
        0: SamplingParams(temperature=0.0, allowed_token_ids=ALLOWED),
        2: SamplingParams(temperature=0.0, allowed_token_ids=[0]),
        3: SamplingParams(temperature=1.0, seed=1, allowed_token_ids=ALLOWED),
        5: SamplingParams(temperature=1.0, seed=2, allowed_token_ids=ALLOWED),
        6: SamplingParams(temperature=1.0, allowed_token_ids=ALLOWED),  # the engine seed's
        7: SamplingParams(temperature=1.0, seed=3, top_k=2, top_p=0.99,
                          allowed_token_ids=[9, 10, 11]),
    }
    free = {
        1: SamplingParams(temperature=0.0),
        4: SamplingParams(temperature=1.0, seed=4),
        8: SamplingParams(temperature=1.5, seed=5, top_k=10),
    }
    slots = [0, 1, 2, 3, 4, 5, 6, 7, 8]
    steps = _steps_favouring_a_forbidden_token(len(slots), 24, device)
    mixed = make_sampler(9, V, device, seed=6)
    for slot in slots:
        add_request(mixed, slot, {**restricted, **free}[slot], [1], [])
    tokens = run_steps(mixed, slots, steps)

    for step, logits in zip(tokens, steps, strict=True):
        best = logits[0, ALLOWED].argmax().item()
        assert step[0] == ALLOWED[best] and step[2] == 0
    for row in (3, 5, 6):
        drawn = {step[row] for step in tokens}
        assert drawn <= set(ALLOWED) and len(drawn) > 1, drawn
    for step, logits in zip(tokens, steps, strict=True):  # top-k of the allowed logits
        top2 = [9 + t for t in logits[7, 9:12].topk(2).indices.tolist()]
        assert step[7] in top2

    alone = make_sampler(9, V, device, seed=6)
    for slot in free:
        add_request(alone, slot, free[slot], [1], [])
    rows = [slots.index(slot) for slot in free]
    free_tokens = run_steps(alone, list(free), [x[rows] for x in steps])
    assert [[step[r] for r in rows] for step in tokens] == free_tokens
    assert all(step[rows[0]] == 63 for step in tokens)  # the argmax, unrestricted


def test_allowed_token_ids_gone_when_the_slot_is_reused(device: torch.device) -> None:
    steps = _steps_favouring_a_forbidden_token(1, 4, device)
    sampler = make_sampler(2, V, device)
    add_request(sampler, 1, SamplingParams(temperature=0.0, allowed_token_ids=ALLOWED), [1], [])
    assert all(step[0] in ALLOWED for step in run_steps(sampler, [1], steps))
    sampler.states.remove_request(1)
    add_request(sampler, 1, SamplingParams(temperature=0.0, logit_bias={2: 1.0}), [1], [])
    assert run_steps(sampler, [1], steps) == [[63]] * 4


def test_logprobs_of_a_restricted_row_stay_raw() -> None:
    """The token is an allowed one; its logprob and the top ones are the model's."""
    logits = _steps_favouring_a_forbidden_token(1, 1, torch.device("cpu"))[0]
    sampler = make_sampler(1, V, torch.device("cpu"))
    add_request(sampler, 0, SamplingParams(temperature=0.0, allowed_token_ids=ALLOWED,
                                           logprobs=1), [1], [])
    idx_mapping, idx_np = batch_of([0], torch.device("cpu"))
    out = sampler(logits, idx_mapping, idx_np)
    assert out.logprobs is not None
    raw = torch.log_softmax(logits.float(), dim=-1)[0]
    token = int(out.sampled_token_ids[0])
    assert token in ALLOWED
    assert out.logprobs.token_ids[0].tolist() == [token, 63]
    torch.testing.assert_close(out.logprobs.logprobs[0], raw[[token, 63]])


def test_engine_seed_makes_unseeded_requests_reproducible() -> None:
    logits = [torch.zeros(3, V)] * 6

    def run(engine_seed: int) -> list[list[int]]:
        sampler = make_sampler(3, V, torch.device("cpu"), seed=engine_seed)
        for slot in range(3):
            add_request(sampler, slot, SamplingParams(), [1], [])
        return run_steps(sampler, [0, 1, 2], logits)

    assert run(11) == run(11)
    assert run(11) != run(12)


@pytest.mark.parametrize(
    ("params", "eos", "field"),
    [
        (SamplingParams(logit_bias={V: 1.0}), None, "logit_bias"),
        (SamplingParams(allowed_token_ids=[3, V]), None, "allowed_token_ids"),
        (SamplingParams(allowed_token_ids=[-2]), None, "allowed_token_ids"),
        (SamplingParams(bad_words_token_ids=[[3], [1, V]]), None, "bad_words_token_ids"),
        (SamplingParams(min_tokens=2, stop_token_ids=[-1]), None, "stop_token_ids"),
        (SamplingParams(min_tokens=2), V + 5, "stop_token_ids"),
        (SamplingParams(repetition_penalty=1.1), None, "prompt_token_ids"),
    ],
)
def test_bad_token_ids_name_their_field(
    params: SamplingParams, eos: int | None, field: str
) -> None:
    sampler = make_sampler(2, V, torch.device("cpu"))
    prompt = [1, V] if field == "prompt_token_ids" else [1]
    with pytest.raises(ValueError, match=field):
        add_request(sampler, 0, params, prompt, [], eos_token_id=eos)


def test_bad_slot_and_shapes_are_rejected() -> None:
    sampler = make_sampler(2, V, torch.device("cpu"))
    with pytest.raises(ValueError, match="slot"):
        sampler.add_request(2, SamplingParams(), [1], [])
    add_request(sampler, 0, SamplingParams(), [1], [])
    idx_mapping, idx_np = batch_of([0], torch.device("cpu"))
    with pytest.raises(ValueError, match="logits"):
        sampler(torch.zeros(1, V + 1), idx_mapping, idx_np)
    with pytest.raises(ValueError, match="idx_mapping"):
        sampler(torch.zeros(2, V), idx_mapping, idx_np)


def _forbid(*_args: object, **_kwargs: object) -> None:
    raise AssertionError("the sampling path read a device value on the host")


def test_sampling_path_never_reads_device_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """No .item()/.tolist()/bool()/int()/float() of a tensor, no multinomial, in a full step."""
    sampler = make_sampler(len(OTHERS) + 1, V, torch.device("cpu"))
    for slot, params in enumerate([SEEDED, *OTHERS]):
        add_request(sampler, slot, params, [1, 2, 3], [4], eos_token_id=2)
    idx_mapping, idx_np = batch_of(list(range(len(OTHERS) + 1)), torch.device("cpu"))
    logits = torch.randn(len(idx_np), V)
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, _forbid)
    monkeypatch.setattr(torch, "multinomial", _forbid)
    out = sampler(logits, idx_mapping, idx_np)
    sampler.update_after_sampling(idx_mapping, out.sampled_token_ids)
    monkeypatch.undo()
    assert out.sampled_token_ids.shape == (len(idx_np),)
    assert out.logprobs is not None and out.logprobs.token_ids.shape == (len(idx_np), 4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_step_does_not_synchronize() -> None:
    device = torch.device("cuda")
    sampler = make_sampler(len(OTHERS) + 1, V, device)
    for slot, params in enumerate([SEEDED, *OTHERS]):
        add_request(sampler, slot, params, [1, 2, 3], [4], eos_token_id=2)
    idx_mapping, idx_np = batch_of(list(range(len(OTHERS) + 1)), device)
    logits = torch.randn(len(idx_np), V, device=device, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            out = sampler(logits, idx_mapping, idx_np)
            sampler.update_after_sampling(idx_mapping, out.sampled_token_ids)
        add_request(sampler, 0, SEEDED, [1, 2, 3], [4, 5])
        # Wider bad-words tables, and a ring seeded from the outputs, without a wait either.
        add_request(sampler, 1, SamplingParams(bad_words_token_ids=[[1, 2, 3, 4, 5]] * 9),
                    [1, 2, 3], [4, 5])
        out = sampler(logits, idx_mapping, idx_np)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.sampled_token_ids.shape == (len(idx_np),)
