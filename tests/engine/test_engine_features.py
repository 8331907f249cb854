"""Engine behaviour per request: seeds, n > 1, stop strings, length limits, EOS, abort, logprobs.

One tiny Llama engine (fp32) serves every test of this module.
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.core.request import RequestStatus
from tests.engine.tiny_models import hf_log_softmax


@pytest.fixture(scope="module")
def llama(checkpoints):
    folder, model, tokenizer = checkpoints("llama")
    llm = LLM(str(folder), dtype="float32", max_num_batched_tokens=128, num_gpu_blocks_override=128)
    return llm, model, tokenizer


def _prompts(vocab_size: int, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(5, 60))] for _ in range(count)]


def _tokens(llm: LLM, prompt, params: SamplingParams) -> list[int]:
    (output,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return output.outputs[0].token_ids


def test_seeded_sampling_same_alone_and_in_a_batch(llama):
    llm, _, tokenizer = llama
    prompts = _prompts(len(tokenizer), 16, seed=2)
    seeded = SamplingParams(
        temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=12, ignore_eos=True
    )
    alone = _tokens(llm, prompts[7], seeded)
    others = [
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0.7, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=1.3, min_p=0.05, seed=99, max_tokens=9, ignore_eos=True),
    ]
    params = [others[i % 3] for i in range(16)]
    params[7] = seeded
    batch = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert batch[7].outputs[0].token_ids == alone
    assert len(set(map(tuple, (o.outputs[0].token_ids for o in batch)))) > 1


def test_n_completions_are_the_seeded_children(llama):
    llm, _, tokenizer = llama
    prompt = _prompts(len(tokenizer), 1, seed=3)[0]
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    (output,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert [c.index for c in output.outputs] == [0, 1, 2]
    completions = [c.token_ids for c in output.outputs]
    for i, tokens in enumerate(completions):
        single = SamplingParams(temperature=1.0, seed=7 + i, max_tokens=10, ignore_eos=True)
        assert tokens == _tokens(llm, prompt, single)
    assert len(set(map(tuple, completions))) > 1


def _streamed_pieces(llm: LLM, prompt, params: SamplingParams) -> list[str]:
    """The text each generated token added (empty while a character is incomplete)."""
    pieces = []
    for output in llm.stream(prompt, params):
        (completion,) = output.outputs
        pieces += [""] * (len(completion.token_ids) - 1) + [completion.text]
    return pieces


def _stop_across_a_boundary(pieces: list[str]) -> str:
    """Two characters, the last of one token's text and the first of the next one's."""
    for a, b in zip(pieces, pieces[1:], strict=False):
        if a and b and "\ufffd" not in a[-1] + b[0]:
            return a[-1] + b[0]
    raise AssertionError(f"no token boundary between two clean characters in {pieces!r}")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens(llama, include):
    llm, _, tokenizer = llama
    prompt = tokenizer.encode("The quick brown fox")
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    pieces = _streamed_pieces(llm, prompt, free)
    text = "".join(pieces)
    stop = _stop_across_a_boundary(pieces)
    params = SamplingParams(
        temperature=0.0,
        max_tokens=24,
        ignore_eos=True,
        stop=[stop],
        include_stop_str_in_output=include,
    )
    (output,) = llm.generate(prompt, params, use_tqdm=False)
    completion = output.outputs[0]
    found = text.find(stop)
    assert completion.text == text[: found + (len(stop) if include else 0)]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    # Generation ended with the token that completed the stop string.
    lengths = [len("".join(pieces[: k + 1])) for k in range(len(pieces))]
    num_tokens = next(k + 1 for k, n in enumerate(lengths) if n >= found + len(stop))
    assert len(completion.token_ids) == num_tokens
    assert llm.engine_core.get_stats().kv_cache_usage == 0.0


def test_max_tokens(llama):
    llm, _, tokenizer = llama
    (output,) = llm.generate(
        "Hello", SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False
    )
    assert len(output.outputs[0].token_ids) == 5 and output.outputs[0].finish_reason == "length"


def test_min_tokens_holds_back_eos(llama):
    llm, _, tokenizer = llama
    eos = tokenizer.eos_token_id
    params = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=5, logit_bias={eos: 100.0})
    completion = llm.generate("Hello", params, use_tqdm=False)[0].outputs[0]
    assert len(completion.token_ids) == 6 and completion.token_ids[-1] == eos
    assert eos not in completion.token_ids[:5]
    assert completion.finish_reason == "stop" and completion.stop_reason is None
    assert "<|endoftext|>" not in completion.text


def test_ignore_eos(llama):
    llm, _, tokenizer = llama
    eos = tokenizer.eos_token_id
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={eos: 100.0})
    completion = llm.generate("Hello", params, use_tqdm=False)[0].outputs[0]
    assert completion.token_ids == [eos] * 6 and completion.finish_reason == "length"
    stops = llm.generate(
        "Hello",
        SamplingParams(temperature=0.0, max_tokens=6, logit_bias={eos: 100.0}),
        use_tqdm=False,
    )
    assert stops[0].outputs[0].token_ids == [eos]


def test_abort_running_request_frees_its_blocks(llama):
    llm, _, tokenizer = llama
    core = llm.engine_core
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    processed = llm.input_processor.process_inputs("to-abort", list(range(3, 50)), params)
    for request in processed.requests:
        core.add_request(request)
    generated = 0
    while generated < 3:
        generated += sum(len(o.new_token_ids) for o in core.step())
    assert core.get_stats().kv_cache_usage > 0.0
    (aborted,) = core.abort_requests(["to-abort"])
    assert aborted.finish_reason == "abort"
    assert not core.has_unfinished_requests()
    assert core.get_stats().kv_cache_usage == 0.0


def test_closing_a_stream_aborts(llama):
    llm, _, _ = llama
    stream = llm.stream("Hello", SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    first = next(stream)
    assert first.outputs[0].token_ids and not first.finished
    stream.close()
    assert not llm.engine_core.has_unfinished_requests()
    assert not llm.output_processor.has_unfinished_requests()
    assert llm.engine_core.get_stats().kv_cache_usage == 0.0


def test_finish_requests_with_status(llama):
    llm, _, _ = llama
    core = llm.engine_core
    processed = llm.input_processor.process_inputs("x", [5, 6, 7], SamplingParams(max_tokens=20))
    core.add_request(processed.requests[0])
    core.step()
    (out,) = core.finish_requests(["x"], RequestStatus.FINISHED_STOPPED)
    assert out.finish_reason == "stop" and not core.has_unfinished_requests()


def test_logprobs_match_transformers(llama):
    llm, model, tokenizer = llama
    prompt = _prompts(len(tokenizer), 1, seed=5)[0]
    params = SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5, prompt_logprobs=3
    )
    (output,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    completion = output.outputs[0]
    ref = hf_log_softmax(model, prompt + completion.token_ids)  # [len, vocab]
    for k, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
        row = ref[len(prompt) - 1 + k]
        top = torch.topk(row, 5)
        assert entry[token].rank == 1 and token == int(top.indices[0])
        assert set(entry) == set(top.indices.tolist())
        for tok, lp in entry.items():
            assert abs(lp.logprob - float(row[tok])) < 1e-4
    expected_cumulative = sum(
        float(ref[len(prompt) - 1 + k, t]) for k, t in enumerate(completion.token_ids)
    )
    assert abs(completion.cumulative_logprob - expected_cumulative) < 1e-3
    assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(prompt)
    for j in range(1, len(prompt)):
        entry = output.prompt_logprobs[j]
        assert abs(entry[prompt[j]].logprob - float(ref[j - 1, prompt[j]])) < 1e-4
        assert len(entry) in (3, 4)  # the top-3, plus the prompt token when outside them


def test_prompt_logprobs_of_a_cached_prompt_cover_every_position(llama):
    """A prompt whose blocks are in the prefix cache is computed again for its logprobs."""
    llm, _, tokenizer = llama
    prompt = [{"prompt_token_ids": _prompts(len(tokenizer), 1, seed=5)[0] * 3}]
    assert len(prompt[0]["prompt_token_ids"]) > 2 * llm.config.cache.block_size
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    (cold,) = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=2,
                                                  prompt_logprobs=1), use_tqdm=False)
    (warm,) = llm.generate(prompt, greedy, use_tqdm=False)
    assert warm.num_cached_tokens > 0
    (again,) = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=2,
                                                   prompt_logprobs=1), use_tqdm=False)
    assert again.num_cached_tokens == 0
    assert len(again.prompt_logprobs) == len(cold.prompt_logprobs) == len(cold.prompt_token_ids)
    for a, b in zip(again.prompt_logprobs[1:], cold.prompt_logprobs[1:], strict=True):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)


def test_allowed_token_ids(llama):
    """Sampled (temperature 1) and greedy requests restricted to a few ids emit only those,
    next to an unrestricted request in the same batches that gets the tokens it gets alone."""
    llm, _, tokenizer = llama
    prompts = _prompts(len(tokenizer), 3, seed=9)
    allowed = [7, 64, 200]
    assert tokenizer.eos_token_id not in allowed
    free = SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    params = [
        SamplingParams(allowed_token_ids=allowed, max_tokens=8, temperature=1.0, seed=0),
        free,
        SamplingParams(allowed_token_ids=allowed, max_tokens=8, temperature=0.0),
    ]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    sampled, unrestricted, greedy = (o.outputs[0].token_ids for o in outputs)
    assert len(sampled) == 8 and set(sampled) <= set(allowed) and len(set(sampled)) > 1
    assert len(greedy) == 8 and set(greedy) <= set(allowed)
    assert not set(unrestricted) <= set(allowed)
    assert unrestricted == _tokens(llm, prompts[1], free)


def _has_run(tokens: list[int], run: list[int]) -> bool:
    return any(tokens[i : i + len(run)] == run for i in range(len(tokens) - len(run) + 1))


def test_bad_words_token_ids_block_a_sequence_the_greedy_output_had(llama):
    """The greedy continuation's tokens 1-2 as a bad word: token 2 changes (token 1 stays, as
    nothing blocks it alone) and the pair never occurs; a request without bad words in the same
    batch gets the tokens it gets alone."""
    llm, _, tokenizer = llama
    prompts = _prompts(len(tokenizer), 2, seed=11)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    free = SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    before = _tokens(llm, prompts[0], greedy)
    pair = before[1:3]
    assert _has_run(before, pair)
    blocked = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                             bad_words_token_ids=[pair])
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], [blocked, free],
                           use_tqdm=False)
    after, other = (o.outputs[0].token_ids for o in outputs)
    assert after[:2] == before[:2] and after[2] != before[2] and len(after) == 16
    assert not _has_run(after, pair)
    assert other == _tokens(llm, prompts[1], free)


def test_bad_words_text_blocks_a_token_of_the_greedy_output(llama):
    """A word made of one generated token's text: the output is the same up to the first token
    of the word's tokenizations, which never occurs again."""
    llm, _, tokenizer = llama
    prompt = _prompts(len(tokenizer), 2, seed=11)[1]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    before = _tokens(llm, prompt, greedy)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    # A token whose text, alone, is that token again (a byte of a character is not).
    token = next(t for t in before if encode(tokenizer.decode([t]).lstrip()) == [t])
    word = tokenizer.decode([token])
    banned = {token} | ({encode(" " + word.lstrip())[0]}
                        if len(encode(" " + word.lstrip())) == 1 else set())
    after = _tokens(llm, prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                                bad_words=[word]))
    first = next(i for i, t in enumerate(before) if t in banned)
    assert after[:first] == before[:first] and after[first] != before[first]
    assert not banned & set(after)
