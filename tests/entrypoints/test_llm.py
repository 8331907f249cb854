"""The offline API's surface: vLLM's names, prompt forms, output order, chat, errors."""

from __future__ import annotations

import pytest

from pagedserve import LLM, CompletionOutput, RequestOutput, SamplingParams
from tests.engine.tiny_models import save_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder, _, tokenizer = save_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3"))
    llm = LLM(
        model=str(folder),
        dtype="float32",
        max_model_len=128,
        num_gpu_blocks_override=64,
        max_num_seqs=8,
        block_size=16,
        enable_prefix_caching=True,
        seed=0,
    )
    return llm, tokenizer


def test_generate_prompt_forms_in_input_order(tiny):
    llm, tokenizer = tiny
    ids = tokenizer.encode("Hello world")
    outputs = llm.generate(
        ["Hello world", {"prompt_token_ids": ids}, "Paris"], GREEDY, use_tqdm=False
    )
    assert all(isinstance(o, RequestOutput) and o.finished for o in outputs)
    assert [o.prompt for o in outputs] == ["Hello world", None, "Paris"]
    assert outputs[0].prompt_token_ids == outputs[1].prompt_token_ids == ids
    assert outputs[0].outputs[0].token_ids == outputs[1].outputs[0].token_ids
    (completion,) = outputs[2].outputs
    assert isinstance(completion, CompletionOutput)
    assert completion.index == 0 and len(completion.token_ids) == 4
    # Equal up to a trailing incomplete character, which the detokenizer never emits.
    assert completion.text.rstrip("\ufffd") == tokenizer.decode(completion.token_ids).rstrip(
        "\ufffd"
    )
    assert completion.finish_reason == "length" and completion.cumulative_logprob is None
    assert len({o.request_id for o in outputs}) == 3


def test_single_prompt_and_per_prompt_params(tiny):
    llm, _ = tiny
    (single,) = llm.generate("Hello", GREEDY, use_tqdm=False)
    assert len(single.outputs[0].token_ids) == 4
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (1, 3)]
    outputs = llm.generate(["a", "b"], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [1, 3]


def test_progress_bar(tiny, capsys):
    llm, _ = tiny
    llm.generate(["a", "b"], GREEDY, use_tqdm=True)
    assert "Processed prompts" in capsys.readouterr().err


def test_chat(tiny):
    llm, _ = tiny
    conversation = [{"role": "user", "content": "Hi"}]
    (output,) = llm.chat(conversation, GREEDY, use_tqdm=False)
    assert output.prompt.endswith("<|im_start|>assistant\n")
    outputs = llm.chat(
        [conversation, conversation + [{"role": "assistant", "content": "Yo"}]],
        GREEDY,
        use_tqdm=False,
    )
    assert len(outputs) == 2 and "Yo" in outputs[1].prompt
    for bad in (123, [], "Hi"):
        with pytest.raises(ValueError, match="^messages: expected a conversation"):
            llm.chat(bad, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="^messages: expected a non-empty list"):
        llm.chat([conversation, 5], GREEDY, use_tqdm=False)  # the second is no conversation
    assert not llm.engine_core.has_unfinished_requests()


def test_chat_content_parts_and_continue_final_message(tiny):
    llm, _ = tiny
    parts = [{"role": "user", "content": [{"type": "text", "text": "H"}, {"type": "text",
                                                                        "text": "i"}]}]
    (as_parts,) = llm.chat(parts, GREEDY, use_tqdm=False)
    (as_text,) = llm.chat([{"role": "user", "content": "Hi"}], GREEDY, use_tqdm=False)
    assert as_parts.prompt == as_text.prompt
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ValueError, match=r"^messages\[0\]\.content\[0\]\.type: 'image_url'"):
        llm.chat(image, GREEDY, use_tqdm=False)
    prefix = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    (continued,) = llm.chat(prefix, GREEDY, use_tqdm=False, continue_final_message=True)
    assert continued.prompt.endswith("assistant\nHello") and continued.outputs[0].token_ids


def test_chat_template_and_its_kwargs(tmp_path):
    folder, _, _ = save_checkpoint("llama", tmp_path)
    template = tmp_path / "thinking.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                        "{% if enable_thinking %} think{% endif %}")
    llm = LLM(model=str(folder), dtype="float32", max_model_len=64, num_gpu_blocks_override=16,
              chat_template=str(template))
    conversation = [{"role": "user", "content": "Hi"}]
    (plain,) = llm.chat(conversation, GREEDY, use_tqdm=False)
    (thinking,) = llm.chat(conversation, GREEDY, use_tqdm=False,
                           chat_template_kwargs={"enable_thinking": True})
    assert (plain.prompt, thinking.prompt) == ("Hi", "Hi think")
    with pytest.raises(ValueError, match="^chat_template: .* neither a readable file"):
        LLM(model=str(folder), chat_template=str(tmp_path / "missing.jinja"))


def test_bad_input_runs_nothing(tiny):
    llm, _ = tiny
    with pytest.raises(ValueError, match="^sampling_params"):
        llm.generate(["a", "b"], [GREEDY], use_tqdm=False)
    with pytest.raises(ValueError, match="^max_tokens"):
        llm.generate(["a", "b" * 10], SamplingParams(max_tokens=127), use_tqdm=False)
    with pytest.raises(ValueError, match="^prompts"):
        llm.generate([], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="^prompts: expected .* got int"):
        llm.generate(123, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="^sampling_params: expected .* got dict"):
        llm.generate(["a", "b"], {"max_tokens": 2}, use_tqdm=False)
    # The second prompt is bad: the first, valid, must not run either.
    bad_ids = r"^prompt: expected a list of token ids \(ints\), got \[3, 'a'\]"
    with pytest.raises(ValueError, match=bad_ids):
        llm.generate([[1, 2], [3, "a"]], GREEDY, use_tqdm=False)
    assert not llm.engine_core.has_unfinished_requests()


def test_tokenizer_and_properties(tiny):
    llm, tokenizer = tiny
    assert llm.get_tokenizer().get_vocab() == tokenizer.get_vocab()
    assert llm.engine_core.max_model_len == 128
    assert llm.engine_core.vocab_size == len(tokenizer)


def test_unknown_engine_argument():
    with pytest.raises(TypeError, match="no_such_option"):
        LLM(model="unused", no_such_option=1)


def test_bad_engine_value_names_the_field():
    with pytest.raises(ValueError, match="^block_size"):
        LLM(model="unused", block_size=3)
    with pytest.raises(ValueError, match=r"^seed: must be in \[0, 2\*\*63\), got -1"):
        LLM(model="unused", seed=-1)


def test_skip_tokenizer_init(tmp_path):
    folder, _, _ = save_checkpoint("llama", tmp_path)
    llm = LLM(
        model=str(folder),
        dtype="float32",
        max_model_len=64,
        num_gpu_blocks_override=8,
        skip_tokenizer_init=True,
    )
    assert llm.get_tokenizer() is None
    (output,) = llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 4 and output.outputs[0].text == ""
    with pytest.raises(ValueError, match="^prompt"):
        llm.generate("text needs a tokenizer", GREEDY, use_tqdm=False)


def test_step_by_step_equals_generate(tiny):
    """add_request + step: one engine step per call, the finished outputs as generate's."""
    llm, _ = tiny
    prompts = ["The cat", "A much longer prompt about dogs"]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    with pytest.raises(RuntimeError, match="^step: no requests"):
        llm.step()
    ids = [llm.add_request(p, GREEDY) for p in prompts]
    assert len(set(ids)) == 2 and llm.has_unfinished_requests()
    finished, steps = {}, 0
    while llm.has_unfinished_requests():
        finished.update({o.request_id: o for o in llm.step()})
        steps += 1
    assert steps >= GREEDY.max_tokens
    assert all(finished[i].finished for i in ids)
    assert [finished[i].outputs[0].token_ids for i in ids] == want


def test_chat_with_a_template_of_its_own(tiny):
    """``chat_template``: the conversation is rendered by the given Jinja text instead of the
    tokenizer's; a template that is not Jinja is refused by name."""
    llm, tokenizer = tiny
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    messages = [{"role": "user", "content": "Hi"}]
    (out,) = llm.chat(messages, GREEDY, use_tqdm=False, chat_template=template)
    ids = tokenizer.encode("<user>Hi<assistant>", add_special_tokens=False)
    (ref,) = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    assert out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    with pytest.raises(ValueError, match="^chat_template:"):
        llm.chat(messages, GREEDY, use_tqdm=False, chat_template="{% if %}")
