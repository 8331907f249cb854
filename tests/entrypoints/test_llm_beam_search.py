"""``LLM.beam_search`` (vLLM's offline beam search) against a plain beam search over
transformers' log-probabilities of the same tiny model, in fp32."""

from __future__ import annotations

import pytest

from pagedserve import LLM, BeamSearchParams
from tests.engine.tiny_models import hf_beam_search, save_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder, model, tokenizer = save_checkpoint("llama", tmp_path_factory.mktemp("llama"))
    llm = LLM(model=str(folder), dtype="float32", max_model_len=64, num_gpu_blocks_override=64,
              max_num_seqs=16, block_size=4, enable_prefix_caching=True, seed=0)
    return llm, model, tokenizer


@pytest.mark.parametrize("width, length_penalty", [(3, 1.0), (2, 0.0)])
def test_beams_equal_the_reference(tiny, width, length_penalty):
    llm, model, tokenizer = tiny
    prompts = ["Hello world", "Paris is the"]
    params = BeamSearchParams(beam_width=width, max_tokens=5, length_penalty=length_penalty)
    outputs = llm.beam_search(prompts, params)
    assert len(outputs) == len(prompts)
    for prompt, output in zip(prompts, outputs, strict=True):
        prompt_ids = tokenizer.encode(prompt)
        eos = frozenset({tokenizer.eos_token_id})
        expected = hf_beam_search(model, prompt_ids, width, 5, eos, length_penalty)
        assert [s.tokens for s in output.sequences] == [prompt_ids + t for t, _ in expected]
        for sequence, (tokens, total) in zip(output.sequences, expected, strict=True):
            assert sequence.cum_logprob == pytest.approx(total, abs=1e-4)
            assert sequence.text == tokenizer.decode(tokens, skip_special_tokens=True)
            assert sequence.finish_reason == "length"
    assert not llm.engine_core.has_unfinished_requests()
    assert llm.engine_core.get_stats().kv_cache_usage == 0.0


def test_an_eos_completes_a_beam(tiny):
    """With the engine's EOS set to the model's most likely first token, the beam of that one
    token completes in the first round; the beams equal the reference's, that one first."""
    llm, model, tokenizer = tiny
    prompt_ids = tokenizer.encode("Hello world")
    first = int(hf_beam_search(model, prompt_ids, 1, 1)[0][0][0])
    llm.input_processor.eos_token_id, saved = first, llm.input_processor.eos_token_id
    try:
        (output,) = llm.beam_search({"prompt_token_ids": prompt_ids},
                                    BeamSearchParams(beam_width=2, max_tokens=4))
    finally:
        llm.input_processor.eos_token_id = saved
    expected = hf_beam_search(model, prompt_ids, 2, 4, frozenset({first}))
    assert [s.tokens for s in output.sequences] == [prompt_ids + t for t, _ in expected]
    assert output.sequences[0].tokens == prompt_ids + [first]
    assert output.sequences[0].finish_reason == "stop"


def test_bad_input_is_refused_by_name(tiny):
    llm, _, _ = tiny
    with pytest.raises(ValueError, match="^params:"):
        llm.beam_search("Hi", {"beam_width": 2})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^max_tokens:"):
        llm.beam_search("Hi", BeamSearchParams(beam_width=2, max_tokens=1000))
