"""LoRA adapters end to end: the engine's greedy tokens with an adapter equal transformers'
running the PEFT adapter, batches mixing adapters included."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator

import pytest
import torch

from pagedserve import LLM, BeamSearchParams, LoRARequest, SamplingParams
from pagedserve.core.request import Request
from pagedserve.lora.slots import AdapterFreeForward
from tests.engine.tiny_models import hf_beam_search, hf_greedy, hf_log_softmax, save_checkpoint
from tests.lora.peft_adapters import ADAPTER_CONFIGS, save_adapter

MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
PROMPTS = ["The quick brown fox jumps over the lazy dog again and again", "hello world",
           "a b c d e f g"]
ADAPTERS = {name: (i + 1, config) for i, (name, config) in enumerate(ADAPTER_CONFIGS.items())}
"""name -> (lora_int_id, peft.LoraConfig keywords)"""


@pytest.fixture(scope="module")
def lora_models(tmp_path_factory):
    """(base folder, base model, tokenizer, {name: (LoRARequest, merged model)})."""
    root = tmp_path_factory.mktemp("lora")
    folder, base, tokenizer = save_checkpoint("llama", root / "base")
    adapters = {}
    for seed, (name, (lora_id, config)) in enumerate(ADAPTERS.items()):
        merged = save_adapter(base, root / name, seed, **config)
        adapters[name] = (LoRARequest(name, lora_id, str(root / name)), merged)
    return folder, base, tokenizer, adapters


@contextlib.contextmanager
def _engine(lora_models, **engine_args) -> Iterator[LLM]:
    """An engine of the tiny Llama with two adapter slots of rank 8, shut down after."""
    engine = LLM(str(lora_models[0]), dtype="float32", enable_lora=True, max_loras=2,
                 max_lora_rank=8, **engine_args)
    try:
        yield engine
    finally:
        engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def llm(lora_models):
    with _engine(lora_models, enable_prefix_caching=True) as engine:
        yield engine


def _expected(lora_models, name: str | None, prompt: str) -> list[int]:
    _, base, tokenizer, adapters = lora_models
    model = base if name is None else adapters[name][1]
    return hf_greedy(model, tokenizer.encode(prompt), MAX_TOKENS)


def _request(lora_models, name: str | None) -> LoRARequest | None:
    return None if name is None else lora_models[3][name][0]


def _assert_greedy(engine: LLM, lora_models, prompts: list[str], names: list[str | None]
                   ) -> None:
    """One batch, request i with ``prompts[i]`` and adapter ``names[i]``: each one's greedy
    tokens equal transformers' with that adapter merged."""
    outputs = engine.generate(prompts, GREEDY, use_tqdm=False,
                              lora_request=[_request(lora_models, n) for n in names])
    for prompt, name, out in zip(prompts, names, outputs, strict=True):
        assert out.outputs[0].token_ids == _expected(lora_models, name, prompt), (prompt, name)


def test_adapters_change_the_output(lora_models) -> None:
    """Guards the comparisons below: each adapter's tokens differ from the base model's."""
    for name in ADAPTERS:
        assert _expected(lora_models, name, PROMPTS[0]) != _expected(lora_models, None,
                                                                     PROMPTS[0])


def test_mixed_batch_matches_transformers(llm, lora_models) -> None:
    """Base and two adapters in one batch (max_loras 2), every prompt with each."""
    cases = [(p, name) for p in PROMPTS for name in (None, "all", "qv")]
    _assert_greedy(llm, lora_models, [p for p, _ in cases], [n for _, n in cases])
    assert llm.engine_core.get_stats().kv_cache_usage == 0.0


def test_more_adapters_than_slots_take_turns(llm, lora_models) -> None:
    """Three adapters, two slots: the scheduler holds the third back until a slot frees, and
    the slot it takes is overwritten with the right weights."""
    names: list[str | None] = ["all", "qv", "mlp", "mlp", "all"]
    _assert_greedy(llm, lora_models, [PROMPTS[1]] * len(names), names)


def test_steps_without_adapters_keep_the_c_decode_step(llm, lora_models) -> None:
    """On the CPU a step whose tokens use no adapter runs the decode step in C (which knows
    no adapters); a step with an adapter token runs the layers and their slots."""
    forward = llm.engine_core.model_runner.forward_fn
    assert isinstance(forward, AdapterFreeForward)
    before = forward.fast.c_steps
    out = llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids == _expected(lora_models, None, PROMPTS[1])
    after_base = forward.fast.c_steps
    assert after_base - before == MAX_TOKENS - 1  # every decode step
    out = llm.generate(PROMPTS[1], GREEDY, use_tqdm=False, lora_request=_request(lora_models, "qv"))
    assert out[0].outputs[0].token_ids == _expected(lora_models, "qv", PROMPTS[1])
    assert forward.fast.c_steps == after_base


def test_prefix_cache_is_per_adapter(llm, lora_models) -> None:
    """The same long prompt with one adapter, then another and the base: no request reads
    KV that a different adapter computed."""
    prompt = PROMPTS[0] * 2  # several full blocks
    for name in ("all", "qv", None, "all"):
        out = llm.generate(prompt, GREEDY, use_tqdm=False,
                           lora_request=_request(lora_models, name))
        assert out[0].outputs[0].token_ids == _expected(lora_models, name, prompt), name
    assert out[0].num_cached_tokens > 0  # the second "all" read the first one's blocks


def test_logprobs_match_transformers(llm, lora_models) -> None:
    _, _, tokenizer, adapters = lora_models
    prompt_ids = tokenizer.encode(PROMPTS[2])
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=1)
    out = llm.generate([prompt_ids], params, use_tqdm=False,
                       lora_request=adapters["all"][0])[0].outputs[0]
    expected = hf_log_softmax(adapters["all"][1], prompt_ids + out.token_ids[:-1])
    for i, token in enumerate(out.token_ids):
        got = out.logprobs[i][token].logprob
        want = expected[len(prompt_ids) - 1 + i, token].item()
        assert got == pytest.approx(want, abs=1e-4)


def test_beam_search_with_adapters(llm, lora_models) -> None:
    """``LLM.beam_search``'s rounds run each prompt's expansions with its adapter."""
    _, _, tokenizer, adapters = lora_models
    names = ["qv", None]
    outputs = llm.beam_search([PROMPTS[2], PROMPTS[2]], BeamSearchParams(beam_width=2,
                              max_tokens=3, ignore_eos=True),
                              lora_request=[_request(lora_models, n) for n in names])
    prompt_ids = tokenizer.encode(PROMPTS[2])
    got = [[s.tokens[len(prompt_ids):] for s in out.sequences] for out in outputs]
    expected = [[t for t, _ in hf_beam_search(
        lora_models[1] if name is None else adapters[name][1], prompt_ids, 2, 3)]
        for name in names]
    assert got == expected and expected[0] != expected[1]


def test_bad_adapters_are_refused_by_field(llm, lora_models, tmp_path) -> None:
    folder = lora_models[0]
    good = lora_models[3]["all"][0]
    llm.generate("x", GREEDY, use_tqdm=False, lora_request=good)  # id 1 names its folder
    with pytest.raises(ValueError, match="lora_request: lora_int_id 1 already names"):
        llm.generate("x", GREEDY, lora_request=LoRARequest("other", 1, str(tmp_path)))
    with pytest.raises(ValueError, match="lora_path"):
        llm.generate("x", GREEDY, lora_request=LoRARequest("missing", 9, str(tmp_path / "no")))
    with pytest.raises(ValueError, match="lora_request: expected a LoRARequest or a list"):
        llm.generate(["x", "y"], GREEDY, lora_request=[good])
    # The engine is unharmed: the next request runs, and nothing was left queued.
    out = llm.generate("x", GREEDY, use_tqdm=False, lora_request=good)
    assert out[0].outputs[0].token_ids == _expected(lora_models, "all", "x")
    assert not llm.engine_core.has_unfinished_requests()
    plain = LLM(str(folder), dtype="float32")
    try:
        with pytest.raises(ValueError, match="lora_request: this engine serves no LoRA"):
            plain.generate("x", GREEDY, lora_request=good)
        # Past the front end (a caller of the core itself): refused, not left waiting for an
        # adapter slot that does not exist.
        plain.engine_core.add_request(Request("direct", [5, 6], GREEDY, None, 4,
                                              lora_request=good))
        (output,) = plain.engine_core.step()
        assert output.req_id == "direct" and output.finish_reason == "abort"
        assert not plain.engine_core.has_unfinished_requests()
    finally:
        plain.engine_core.shutdown()


def test_an_adapter_gone_after_its_check_ends_only_its_request(llm, lora_models,
                                                              tmp_path) -> None:
    """The front end checks an id's folder once; a folder removed later is refused by the
    engine core at the request's arrival (finish reason abort), not in the runner's step:
    the batch's other requests run on."""
    folder = tmp_path / "copy"
    shutil.copytree(lora_models[3]["mlp"][0].lora_path, folder)
    gone = LoRARequest("gone", 42, str(folder))
    assert llm.generate("x", GREEDY, use_tqdm=False, lora_request=gone)[0].finished
    shutil.rmtree(folder)
    out = llm.generate(["x", "y"], GREEDY, use_tqdm=False, lora_request=[gone, None])
    assert out[0].outputs[0].finish_reason == "abort" and out[0].outputs[0].token_ids == []
    assert out[1].outputs[0].token_ids == _expected(lora_models, None, "y")
    assert llm.engine_core.get_stats().kv_cache_usage == 0.0


def test_rank_above_max_lora_rank_is_refused(lora_models, tmp_path) -> None:
    folder, base, _, _ = lora_models
    save_adapter(base, tmp_path / "wide", 7, r=16, lora_alpha=16, target_modules=["q_proj"])
    engine = LLM(str(folder), dtype="float32", enable_lora=True, max_lora_rank=8)
    try:
        with pytest.raises(ValueError, match="max_lora_rank"):
            wide = LoRARequest("wide", 5, str(tmp_path / "wide"))
            engine.generate("x", GREEDY, lora_request=wide)
    finally:
        engine.engine_core.shutdown()


def test_tensor_parallel_adapters_match_transformers(lora_models) -> None:
    """TP=2 (mp workers): each rank keeps its slice of every adapter's A or B."""
    with _engine(lora_models, tensor_parallel_size=2) as engine:
        _assert_greedy(engine, lora_models, [PROMPTS[0]] * 3, [None, "all", "qv"])


def test_qwen3_adapters_match_transformers(tmp_path) -> None:
    """Qwen3 normalizes q and k per head after the projection: the adapters' q and k deltas
    go in before those norms, as in transformers."""
    folder, base, tokenizer = save_checkpoint("qwen3", tmp_path / "base")
    merged = {None: base}
    requests: dict[str | None, LoRARequest | None] = {None: None}
    for seed, name in enumerate(("all", "qv")):
        merged[name] = save_adapter(base, tmp_path / name, seed, **ADAPTER_CONFIGS[name])
        requests[name] = LoRARequest(name, seed + 1, str(tmp_path / name))
    engine = LLM(str(folder), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8)
    try:
        names = [None, "all", "qv"]
        outputs = engine.generate([PROMPTS[0]] * 3, GREEDY, use_tqdm=False,
                                  lora_request=[requests[n] for n in names])
        for name, out in zip(names, outputs, strict=True):
            want = hf_greedy(merged[name], tokenizer.encode(PROMPTS[0]), MAX_TOKENS)
            assert out.outputs[0].token_ids == want, name
        assert len({tuple(o.outputs[0].token_ids) for o in outputs}) == 3
    finally:
        engine.engine_core.shutdown()


def test_compiled_forward_matches_transformers(lora_models) -> None:
    """torch.compile traces the LoRA layers (the mask is a buffer it reads, not a constant):
    a compiled engine's mixed batches still follow each token's adapter."""
    with _engine(lora_models, mode="compile", piece_compiler="eager") as engine:
        for names in ([None, "all", "qv"], ["qv", None, "all"]):
            _assert_greedy(engine, lora_models, PROMPTS, names)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_match_transformers(lora_models) -> None:
    """On CUDA: compiled pieces, PIECEWISE and FULL graphs replaying the mask buffer."""
    with _engine(lora_models, device="cuda") as engine:
        _assert_greedy(engine, lora_models, [PROMPTS[0]] * 4, [None, "all", "qv", "mlp"])
