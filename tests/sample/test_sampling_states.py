"""The sampling columns of the request slots: staged host rows, device twins, batch questions."""

from __future__ import annotations

import numpy as np
import torch

from pagedserve.sample.states import NO_LOGPROBS, SamplingStates
from pagedserve.sampling_params import SamplingParams

CPU = torch.device("cpu")
V = 16


def test_a_row_reaches_the_device_with_the_staging_copy() -> None:
    states = SamplingStates(4, V, CPU)
    states.add_request(1, SamplingParams(temperature=0.7, top_p=0.9, min_p=0.1, seed=5,
                                         repetition_penalty=1.2, min_tokens=3), 2)
    assert states.temperature_np[1] == np.float32(0.7)
    assert states.temperature[1].item() == 0.0  # the device twin waits for the copy
    states.staging.copy_to_device()
    assert states.temperature[1].item() == np.float32(0.7)
    assert states.top_p[1].item() == np.float32(0.9) and states.min_p[1].item() == np.float32(0.1)
    assert states.seeds[1].item() == 5 and states.min_tokens[1].item() == 3
    assert states.repetition_penalty[1].item() == np.float32(1.2)
    assert states.num_output_tokens[1].item() == 2  # device-owned, set at once
    # Slots no request wrote hold the neutral values.
    assert states.temperature[0].item() == 1.0 and states.top_p[0].item() == 1.0
    assert states.repetition_penalty[0].item() == 1.0


def test_greedy_rows_divide_by_one_and_top_k_past_the_vocabulary_is_off() -> None:
    states = SamplingStates(3, V, CPU)
    states.add_request(0, SamplingParams(temperature=0.0), 0)
    states.add_request(1, SamplingParams(top_k=V), 0)
    states.add_request(2, SamplingParams(top_k=V - 1), 0)
    assert states.greedy_np.tolist() == [True, False, False]
    assert states.temperature_np[0] == 1.0
    assert states.top_k_np.tolist() == [0, 0, V - 1]
    batch = np.array([0, 1], dtype=np.int32)
    assert states.any_greedy(batch) and not states.all_greedy(batch)
    assert states.max_top_k(batch) == 0 and states.max_top_k(np.array([2])) == V - 1


def test_unseeded_requests_draw_their_seeds_from_the_engine_seed() -> None:
    def seeds(engine_seed: int) -> list[int]:
        states = SamplingStates(2, V, CPU, seed=engine_seed)
        for slot in range(2):
            states.add_request(slot, SamplingParams(), 0)
        return states.seeds_np.tolist()

    assert seeds(3) == seeds(3) and seeds(3) != seeds(4)


def test_logprobs_and_penalties_per_row() -> None:
    states = SamplingStates(3, V, CPU)
    states.add_request(0, SamplingParams(logprobs=0), 0)
    states.add_request(1, SamplingParams(presence_penalty=0.5, logprobs=4), 0)
    states.add_request(2, SamplingParams(), 0)
    assert states.num_logprobs(np.array([2, 1, 0])) == [None, 4, 0]
    assert states.max_num_logprobs(np.array([2])) == NO_LOGPROBS
    assert states.any_penalties(np.array([1])) and not states.any_penalties(np.array([0, 2]))
    states.remove_request(1)
    assert states.num_logprobs_np[1] == NO_LOGPROBS and not states.any_penalties(np.array([1]))
