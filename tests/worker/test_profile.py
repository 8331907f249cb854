"""The profile step's plan, and the start-up warm-up that runs it again on the real cache."""

from __future__ import annotations

from pagedserve.worker.profile import (
    PROFILE_SAMPLING,
    WARM_UP_SAMPLING,
    profile_step,
    warm_caching_allocator,
)
from tests.worker.conftest import RunnerFactory


def test_profile_step_fills_the_budget_with_every_request_sampling() -> None:
    step = profile_step(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=32,
                        block_size=4)
    lens = [r.num_prompt_tokens for r in step.run.scheduled_new_reqs]
    assert lens == [8] * 8 and step.run.total_num_scheduled_tokens == 64
    assert step.num_blocks == 1 + 8 * 2  # block 0 is the null block
    assert all(r.sampling_params is PROFILE_SAMPLING for r in step.run.scheduled_new_reqs)
    assert step.finish.finished_req_ids == set(step.run.num_scheduled_tokens)


def test_warm_up_runs_the_largest_step_and_leaves_the_runner_as_it_was(
    make_runner: RunnerFactory,
) -> None:
    runner = make_runner(max_num_seqs=8, max_num_batched_tokens=64, num_blocks=64)
    seed_state = runner.sampler.states.seed_rng.bit_generator.state
    plans = []
    execute_model = runner.execute_model
    runner.execute_model = lambda so: (plans.append(so), execute_model(so))[1]
    warm_caching_allocator(runner)
    assert [p.total_num_scheduled_tokens for p in plans] == [64, 0]  # the step, then the finish
    assert all(r.sampling_params is WARM_UP_SAMPLING for r in plans[0].scheduled_new_reqs)
    assert runner.states.req_id_to_index == {}  # every slot free again
    assert sorted(runner.states.free_slots) == list(range(8))
    # Seeded requests: the seeds of later unseeded requests are the ones they would have been.
    assert runner.sampler.states.seed_rng.bit_generator.state == seed_state


def test_warm_up_skips_a_cache_smaller_than_the_largest_step(make_runner: RunnerFactory) -> None:
    runner = make_runner(max_num_seqs=8, max_num_batched_tokens=64, num_blocks=8)
    calls = []
    runner.execute_model = calls.append
    warm_caching_allocator(runner)
    assert calls == []


def test_warm_up_is_a_no_op_on_the_cpu(make_runner: RunnerFactory) -> None:
    runner = make_runner()
    calls = []
    runner.execute_model = calls.append
    runner.warm_up()
    assert calls == []


def test_an_engine_samples_the_same_tokens_after_a_warm_up(tiny_llama_dir) -> None:  # noqa: ANN001
    """Unseeded sampling (seeds drawn from the engine's stream) is unchanged by a warm-up run
    between start-up and the first request (on CUDA it runs at every start-up)."""
    from pagedserve import LLM, SamplingParams

    def engine() -> LLM:
        return LLM(model=str(tiny_llama_dir), dtype="float32", max_model_len=128,
                   num_gpu_blocks_override=200, max_num_seqs=8, max_num_batched_tokens=256,
                   skip_tokenizer_init=True, seed=3)

    prompts = [[1 + (i * 7 + j) % 90 for j in range(10 + 5 * i)] for i in range(6)]
    params = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in engine().generate(prompts, params, use_tqdm=False)]
    warmed = engine()
    warm_caching_allocator(warmed.engine_core.model_runner)
    outputs = warmed.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
