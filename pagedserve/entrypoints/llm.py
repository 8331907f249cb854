"""The offline API: ``LLM(model=...).generate(prompts, sampling_params)``, as in vLLM.

``LLM`` is the synchronous frontend: an ``InputProcessor`` turns prompts into requests, the
``EngineCore`` steps them in this process, and an ``OutputProcessor`` turns the core's token
outputs into ``RequestOutput`` objects. Argument names and defaults follow vLLM's ``LLM``;
the defaults themselves come from the config dataclasses.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from tqdm.auto import tqdm

from pagedserve.beam_search import (
    BeamSearchOutput,
    BeamSearchParams,
    candidates,
    expansion_prompt,
    search_sequences,
    text_decoder,
)
from pagedserve.config import (
    DEFAULT_MODEL,
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from pagedserve.core.request import RequestStatus
from pagedserve.core.request_queue import check_priority
from pagedserve.engine.chat_messages import (
    ChatMessages,
    ChatRenderOptions,
    as_conversations,
    load_chat_template,
)
from pagedserve.engine.core import EngineCore
from pagedserve.engine.input_processor import InputProcessor, ProcessedRequest, PromptType
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.entrypoints.deferred_interrupt import DeferredInterrupt
from pagedserve.lora.check import lora_checker
from pagedserve.lora.request import LoRARequest
from pagedserve.model.generation_config import default_sampling_values
from pagedserve.model.resolve import model_folder
from pagedserve.model.tokenizer import get_tokenizer
from pagedserve.outputs import RequestOutput, RequestOutputKind
from pagedserve.sampling_params import SamplingParams


class LLM:
    """An engine for offline batched generation.

    Extra keyword arguments are any other ``EngineConfig`` field (``kv_cache_memory``,
    ``enable_chunked_prefill``, ``device``, ...); an unknown name raises ``TypeError``.
    """

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        tokenizer: str | None = None,
        dtype: str = ModelConfig.dtype,
        seed: int = ModelConfig.seed,
        max_model_len: int | None = None,
        max_num_seqs: int = SchedulerConfig.max_num_seqs,
        max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens,
        block_size: int = CacheConfig.block_size,
        enable_prefix_caching: bool = CacheConfig.enable_prefix_caching,
        num_gpu_blocks_override: int | None = None,
        gpu_memory_utilization: float = CacheConfig.gpu_memory_utilization,
        enforce_eager: bool = CompilationConfig.enforce_eager,
        load_format: str = ModelConfig.load_format,
        tensor_parallel_size: int = ParallelConfig.tensor_parallel_size,
        skip_tokenizer_init: bool = False,
        **kwargs: Any,
    ) -> None:
        config = EngineConfig.from_kwargs(
            model=model,
            tokenizer=tokenizer,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            num_gpu_blocks_override=num_gpu_blocks_override,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            load_format=load_format,
            tensor_parallel_size=tensor_parallel_size,
            **kwargs,
        )
        # A bad --chat-template fails before the model loads; its text is kept.
        chat_template = (None if config.model.chat_template is None
                         else load_chat_template(config.model.chat_template))
        self.engine_core = EngineCore(config)
        self.config = self.engine_core.config
        # skip_tokenizer_init (vLLM's name): token-id prompts only, outputs without text.
        self.tokenizer = None if skip_tokenizer_init else get_tokenizer(self.config.model)
        folder = model_folder(self.config.model)
        self.default_sampling_values = default_sampling_values(
            self.config.model.generation_config, folder)
        self.input_processor = InputProcessor.for_model(
            self.tokenizer,
            folder,
            self.engine_core.max_model_len,
            self.engine_core.vocab_size,
            chat_template=chat_template,
            lora=lora_checker(self.config),
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self._request_counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` use when given no ``sampling_params``: the engine's
        defaults, with the model's ``generation_config.json`` values over them
        (``generation_config="auto"``, the default; ``"vllm"`` ignores the file)."""
        return SamplingParams(**self.default_sampling_values)

    # -- public API ----------------------------------------------------------------------------

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions for every prompt; outputs come back in input order.

        ``prompts``: a string, a list of token ids, a ``{"prompt_token_ids": [...]}`` dict, or
        a list of those. ``sampling_params``: one for all prompts or one per prompt.
        ``priority``: one per prompt, lower first; needs ``policy="priority"``.
        ``lora_request``: the adapter for all prompts, or one per prompt (None: the base
        model); needs ``enable_lora=True``.
        Every prompt is validated before any runs (``ValueError`` naming the field).
        """
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list),
                                      self.get_default_sampling_params)
        priorities = [0] * len(prompt_list) if priority is None else list(priority)
        if len(priorities) != len(prompt_list):
            raise ValueError(f"priority: expected {len(prompt_list)} values (one per prompt), "
                             f"got {len(priorities)}")
        for value in priorities:
            check_priority(self.config.scheduler.policy, value)
        adapters = _as_lora_list(lora_request, len(prompt_list))
        processed = [
            self.input_processor.process_inputs(
                str(next(self._request_counter)), p, sp, priority=pr, lora_request=lr)
            for p, sp, pr, lr in zip(prompt_list, params_list, priorities, adapters, strict=True)
        ]
        request_ids = [r.request_id for r in processed]
        # An exception (Ctrl-C included) anywhere below aborts this call's requests, so their
        # blocks return to the pool and the next call starts from an idle engine.
        try:
            for request in processed:
                self._add(request, RequestOutputKind.FINAL_ONLY)
            return self._run_to_completion(request_ids, use_tqdm)
        finally:
            self._abort(request_ids)

    def beam_search(
        self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search``: the ``params.beam_width`` most likely completions of
        each prompt, best first (pagedserve/beam_search.py says how beams are scored). The
        rounds of all prompts run as one batch each. ``prompts`` and ``lora_request`` as for
        ``generate``."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params: expected BeamSearchParams, got {type(params).__name__}")
        prompt_list = _as_prompt_list(prompts)
        processed = [
            self.input_processor.process_inputs(str(next(self._request_counter)), p, params,
                                                lora_request=lr)
            for p, lr in zip(prompt_list, _as_lora_list(lora_request, len(prompt_list)),
                             strict=True)
        ]
        searches = [p.beam_search for p in processed if p.beam_search is not None]
        expansion = processed[0].sampling_params
        while True:
            pending = [search.pending() for search in searches]
            batch = [expansion_prompt(search, ids)
                     for search, lists in zip(searches, pending, strict=True) for ids in lists]
            if not batch:
                break
            adapters = [search.lora_request
                        for search, lists in zip(searches, pending, strict=True) for _ in lists]
            outputs = iter(self.generate(batch, expansion, use_tqdm=False,
                                         lora_request=adapters))
            for search, lists in zip(searches, pending, strict=True):
                if lists:
                    search.advance([candidates(next(outputs)) for _ in lists])
        decode = text_decoder(self.tokenizer)
        eos = self.input_processor.eos_token_id
        return [search_sequences(search, eos, decode) for search in searches]

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool | None = None,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        documents: list[dict[str, str]] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}`` dicts) or
        a list of conversations, rendered with the chat template (``chat_template`` or the
        tokenizer's). ``content`` is a string or a list of ``{"type": "text", "text": ...}``
        parts; other part types are refused. ``continue_final_message``: continue the last
        (assistant) message instead of starting a new turn; ``add_generation_prompt`` None
        means True unless it is set. ``chat_template_kwargs``: extra template variables
        (Qwen3's ``enable_thinking``). ``tools``: function definitions in OpenAI's shape,
        rendered by the template as the server renders a request's ``tools``; assistant
        messages may carry ``tool_calls`` and ``tool`` messages answer them. Reading calls
        from the output is the server's job (``--tool-call-parser``). ``chat_template``: Jinja
        text used for these conversations instead of the engine's template. ``documents``:
        retrieved texts ({"title", "text"}) for templates that render them. ``lora_request``
        as for ``generate``."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages: expected a conversation (a list of {'role', 'content'} "
                             "dicts) or a list of conversations")
        options = ChatRenderOptions.of(
            add_generation_prompt, continue_final_message, chat_template_kwargs, tools,
            chat_template, documents,
        )
        conversations = as_conversations(messages)
        prompts = [
            self.input_processor.render_chat(list(c) if isinstance(c, tuple) else c, options)
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def stream(
        self, prompt: PromptType, sampling_params: SamplingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> Iterator[RequestOutput]:
        """Generate for one prompt, yielding a DELTA ``RequestOutput`` (the new text and
        tokens) after every step that produced some. Closing the iterator early aborts the
        request; so does Ctrl-C, delivered between steps (``DeferredInterrupt``)."""
        params = sampling_params or self.get_default_sampling_params()
        processed = self.input_processor.process_inputs(
            str(next(self._request_counter)), prompt, params, lora_request=lora_request
        )
        self._add(processed, RequestOutputKind.DELTA)
        try:
            while self.output_processor.has_unfinished_requests():
                with DeferredInterrupt() as interrupt, interrupt.step():
                    outputs = self._step()
                yield from outputs
        finally:
            self._abort([processed.request_id])

    def add_request(self, prompt: PromptType, sampling_params: SamplingParams | None = None) -> str:
        """Queue one prompt without running it and return its request id; ``step`` runs it.
        For callers that drive the engine step by step (profilers, step timers)."""
        processed = self.input_processor.process_inputs(
            str(next(self._request_counter)), prompt,
            sampling_params or self.get_default_sampling_params()
        )
        self._add(processed, RequestOutputKind.FINAL_ONLY)
        return processed.request_id

    def step(self) -> list[RequestOutput]:
        """One engine step over the queued requests; returns the outputs of the requests
        that finished in it. ``RuntimeError`` when nothing is queued."""
        if not self.has_unfinished_requests():
            raise RuntimeError("step: no requests are queued (add_request first)")
        return self._step()

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    # -- the engine loop -----------------------------------------------------------------------

    def _add(self, processed: ProcessedRequest, output_kind: RequestOutputKind) -> None:
        self.output_processor.add_request(processed, output_kind)
        for request in processed.requests:
            self.engine_core.add_request(request)

    def _abort(self, request_ids: list[str]) -> None:
        """Abort the unfinished ones of ``request_ids`` (finished or unknown ids are ignored)."""
        child_ids = self.output_processor.abort_requests(request_ids)
        self.engine_core.abort_requests(child_ids)

    def _step(self) -> list[RequestOutput]:
        """One engine step; finishes in the core the requests a stop string ended."""
        if not self.engine_core.has_unfinished_requests():
            raise RuntimeError("engine: requests are waiting for output but the core has none")
        result = self.output_processor.process_outputs(self.engine_core.step())
        if result.reqs_to_finish:
            self.engine_core.finish_requests(result.reqs_to_finish, RequestStatus.FINISHED_STOPPED)
        return result.request_outputs

    def _run_to_completion(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        num_output_tokens = 0
        start = time.perf_counter()
        with (
            tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm) as bar,
            DeferredInterrupt() as interrupt,
        ):
            while self.output_processor.has_unfinished_requests():
                with interrupt.step():
                    outputs = self._step()
                for output in outputs:
                    if not output.finished:
                        continue
                    finished[output.request_id] = output
                    num_output_tokens += sum(len(c.token_ids) for c in output.outputs)
                    bar.update(1)
                    rate = num_output_tokens / max(time.perf_counter() - start, 1e-9)
                    bar.set_postfix_str(f"output {rate:.1f} tok/s", refresh=False)
        return [finished[request_id] for request_id in request_ids]


def _is_token_ids(prompt: Any) -> bool:
    return (
        isinstance(prompt, (list, tuple))
        and bool(prompt)
        and all(isinstance(t, int) for t in prompt)
    )


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)) or _is_token_ids(prompts):
        return [prompts]  # type: ignore[list-item]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError("prompts: expected a string, a list of token ids, a dict or a list of "
                         f"those, got {type(prompts).__name__}")
    prompt_list = list(prompts)
    if not prompt_list:
        raise ValueError("prompts: no prompts given")
    return prompt_list


def _as_lora_list(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, num_prompts: int
) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    if not isinstance(lora_request, (list, tuple)) or len(lora_request) != num_prompts:
        raise ValueError(f"lora_request: expected a LoRARequest or a list of {num_prompts} "
                         f"(one per prompt), got {lora_request!r}")
    return list(lora_request)


def _as_params_list(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int,
    defaults: Callable[[], SamplingParams],
) -> list[SamplingParams]:
    if sampling_params is None:
        return [defaults()] * num_prompts
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    if not isinstance(sampling_params, (list, tuple)):
        raise ValueError("sampling_params: expected SamplingParams or a list of them, got "
                         f"{type(sampling_params).__name__}")
    params_list = list(sampling_params)
    if len(params_list) != num_prompts:
        raise ValueError(
            f"sampling_params: got {len(params_list)} SamplingParams for {num_prompts} prompts"
        )
    return params_list
