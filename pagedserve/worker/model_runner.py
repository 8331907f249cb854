"""The model runner: one engine step on the device (docs/architecture.md#one-engine-step).

``execute_model`` applies the scheduler's plan to the request slots (step 1), orders the batch
and picks its graph descriptor (step 2), builds the inputs (step 3), block tables and slot
mappings (step 4), one attention metadata object (step 5), and runs the model inside the
forward context (step 6); the hidden states are kept. ``sample_tokens`` turns the last row of
each request whose prefill is complete into logits, samples, writes ``last_sampled_tokens`` on
the device for the next step, and starts the copy of the result to the host (steps 7-8).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

from pagedserve.attention.backends.base import AttentionMetadata
from pagedserve.attention.forward_context import set_forward_context
from pagedserve.attention.layer import attention_layers, bind_kv_caches
from pagedserve.compilation.compiled_model import CompiledForward
from pagedserve.config import EngineConfig
from pagedserve.core.sched_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from pagedserve.lora.slots import AdapterFreeForward, LoRASlots
from pagedserve.model.loader import get_max_model_len, load_model
from pagedserve.model.shape import ModelShape
from pagedserve.platform import platform_for, resolve_dtype, resolve_kv_cache_dtype
from pagedserve.sample import LogprobsTensors, Sampler, SamplerOutput, compute_topk_logprobs
from pagedserve.sample.states import NO_LOGPROBS
from pagedserve.spec_decode.output import VerifiedOutput
from pagedserve.spec_decode.verify import (
    DraftBatch,
    plan_drafts,
    plan_verify,
    verify_drafts,
    write_draft_inputs,
)
from pagedserve.structured_output.bitmask import GrammarBitmask, TokenBitmaskApplier
from pagedserve.worker import kv_cache
from pagedserve.worker.async_output import AsyncOutput, PromptLogprobsSpan
from pagedserve.worker.attn_utils import build_attn_metadata, make_forward_context
from pagedserve.worker.block_table import BlockTables, single_group
from pagedserve.worker.capture_sizes import padded_buffer_sizes
from pagedserve.worker.cudagraph import CudaGraphManager
from pagedserve.worker.input_batch import (
    InputBatch,
    InputBuffers,
    plan_batch,
    prepare_inputs,
    stage_batch,
)
from pagedserve.worker.profile import MemoryProfiler, profile_step
from pagedserve.worker.prompt_logprobs import compute_batch_prompt_logprobs, plan_prompt_logprobs
from pagedserve.worker.staging import StagingBuffer, host_to_device
from pagedserve.worker.states import RequestStates


@dataclass
class ExecuteModelState:
    """What execute_model leaves for sample_tokens."""

    batch: InputBatch
    attn_metadata: AttentionMetadata
    hidden_states: torch.Tensor  # [num_tokens_after_padding, hidden_size], device
    grammar_bitmask: GrammarBitmask | None = None
    """The constrained rows' masks, when they came with the plan (tensor parallelism)."""
    drafts: DraftBatch | None = None
    """Speculative decoding: the drafts this step verifies (None: a plain step)."""


def _first_eos(hf_config: object) -> int | None:
    eos = getattr(hf_config, "eos_token_id", None)
    if isinstance(eos, list | tuple):
        eos = eos[0] if eos else None
    return None if eos is None else int(eos)


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.dtype = resolve_dtype(config.model.dtype, device)
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, self.dtype,
                                                     device)
        self.block_size = config.cache.block_size
        self.max_num_reqs = config.scheduler.max_num_seqs
        self.max_num_batched_tokens = config.scheduler.max_num_batched_tokens
        # Buffers hold the padded sizes: a step may pad up to the next capture size of its mode.
        self.max_num_tokens, self.max_num_reqs_padded = padded_buffer_sizes(config)
        # The device's implementations, chosen once here; no step branches on the device.
        self.platform = platform_for(device)
        self.ops = self.platform.input_prep_ops()
        self.attn_backend = self.platform.attention_backend()
        self.copy_stream = self.platform.new_stream()
        self.apply_grammar_bitmask = TokenBitmaskApplier(self.platform)
        self.execute_model_state: ExecuteModelState | None = None
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.weights_bytes = 0
        self.cpu_kv_budget: int | None = None
        """The CPU KV cache's default byte budget, decided once (``_cpu_kv_budget``)."""
        self.compiled_forward: CompiledForward | None = None

    # ---- start-up -------------------------------------------------------------------------

    def load_model(self) -> None:
        """Load the weights, then size every per-request buffer from the model's context."""
        # Card memory in use before this engine (CUDA context, other engines): not its budget.
        self.memory_baseline = (kv_cache.used_device_bytes(self.device)
                                if self.platform.kv_budget_from_memory else 0)
        before = self.platform.memory_allocated()
        self.model, self.hf_config = load_model(self.config.model, self.device, self.dtype)
        self.weights_bytes = self.platform.memory_allocated() - before
        self.max_model_len = get_max_model_len(self.config.model, self.hf_config)
        self.vocab_size = int(self.hf_config.vocab_size)
        self.eos_token_id = _first_eos(self.hf_config)
        self.attn_layers = attention_layers(self.model)
        kv_cache.log_kv_cache_dtype(self.attn_layers, self.kv_cache_dtype)
        if not self.platform.kv_budget_from_memory:
            self.max_model_len = self._fit_cpu_context(self.max_model_len)
        # The model's shape decides an unset budget_step_graph (the buffers' sizes do not
        # depend on it: see padded_buffer_sizes).
        self.graphs = CudaGraphManager(self.config, ModelShape.from_hf_config(self.hf_config),
                                       self.max_model_len, self.device)
        if self.config.cache.calculate_kv_scales and self.graphs.enabled:
            raise ValueError("calculate_kv_scales: CUDA graphs would keep the scales of their "
                             "capture (the attention kernels take them as launch arguments); "
                             "run with enforce_eager")
        self.layer_names = list(self.attn_layers)
        # Every array the host writes for the device each step (the sampling parameters
        # included), in one buffer: one copy.
        self.staging = StagingBuffer(
            RequestStates.staged_arrays(self.max_num_reqs)
            + InputBuffers.staged_arrays(self.max_num_reqs_padded)
            + BlockTables.staged_arrays(self.max_num_reqs, self.max_num_tokens, self.block_size),
            self.device)
        self.states = RequestStates(self.max_num_reqs, self.max_model_len, self.vocab_size,
                                    self.device, self.config.model.seed, self.staging)
        self.block_tables = BlockTables(self.max_num_reqs, self.max_model_len,
                                        self.max_num_tokens, self.block_size, self.device,
                                        self.ops, self.staging)
        self.buffers = InputBuffers(self.max_num_reqs_padded, self.max_num_tokens, self.device,
                                    self.staging)
        self.sampler = Sampler(self.states.sampling)
        # hidden states [num_rows, H] -> logits [num_rows, V] (the LM head)
        self.compute_logits = cast(Callable[[torch.Tensor], torch.Tensor],
                                   self.model.compute_logits)
        self.lora = None if not self.config.lora.enable_lora else LoRASlots(
            self.model, self.hf_config, self.config.lora, self.max_num_reqs,
            self.max_num_tokens, self.dtype, self.device)
        self.forward_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = self.model
        compilation = self.config.compilation
        if compilation.uses_compile(self.platform):
            self.compiled_forward = CompiledForward(
                self.model, compilation.piece_compiler, self.graphs.pool,
                one_token_forward=self._one_token_forward())
            if self.graphs.ladders.verify:
                self.compiled_forward.add_verify_graphs()
            self.forward_fn = self.compiled_forward
        elif compilation.one_token_step == "gemv":  # eager: decode steps on the device's code
            self.forward_fn = self._eager_decode_forward()
        # After the KV budget above was decided: the copies it makes are not the cache's.
        self.platform.prepare_weights(self.model, self.max_num_reqs)

    def _eager_decode_forward(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """The platform's decode forward (the CPU's C step), which knows no adapters: with
        LoRA, only for steps whose tokens use none."""
        fast = self.platform.decode_forward(self.model)
        if fast is None:
            return self.model
        return fast if self.lora is None else AdapterFreeForward(fast, self.model, self.lora)

    def _one_token_forward(self) -> Callable[..., torch.Tensor] | None:
        """The model's own forward for one-token steps of a compiled forward, where configured
        and the model has one: the fused GEMV kernels where Triton's run (CUDA), else the
        platform's decode forward (the CPU's C step)."""
        if self.config.compilation.one_token_step != "gemv" or self.lora is not None:
            return None  # the fused one-token forwards know no adapters
        if not self.platform.has_triton_kernels():
            return self.platform.decode_forward(self.model)
        declared = getattr(self.model, "one_token_forward", None)  # a model capability
        return None if declared is None else declared()

    def capture_graphs(self) -> dict[str, list[int]]:
        """Capture the FULL and PIECEWISE graphs (after the KV cache exists; {} where graphs
        are off). The last start-up call: KV-scale calibration is armed here, so that only a
        step with real tokens calibrates (``kv_cache.arm_kv_calibration``)."""
        captured = self.graphs.capture(self, self.compiled_forward, self.num_blocks)
        if self.config.cache.calculate_kv_scales:
            kv_cache.arm_kv_calibration(self.attn_layers)
        return captured

    def _fit_cpu_context(self, max_model_len: int) -> int:
        """On the CPU the KV budget is known before anything is sized: shorten a context that
        one request could not hold (the buffers below are sized from the result)."""
        if self.config.cache.num_gpu_blocks_override is not None:
            return max_model_len
        per_block = kv_cache.kv_bytes_per_block(self.attn_layers, self.block_size,
                                                self.kv_cache_dtype)
        return kv_cache.fit_max_model_len(max_model_len, self._cpu_kv_budget(), per_block,
                                          self.block_size)

    def _cpu_kv_budget(self) -> int:
        """``kv_cache_memory`` when set; else the default budget, decided once (it follows the
        memory available, which the engine's own allocations then change)."""
        memory = self.config.cache.kv_cache_memory
        if memory is not None:
            return memory
        if self.cpu_kv_budget is None:
            self.cpu_kv_budget = kv_cache.cpu_kv_budget(None)
        return self.cpu_kv_budget

    def determine_num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        if self.platform.kv_budget_from_memory:
            step = profile_step(self.max_num_batched_tokens, self.max_num_reqs,
                                self.max_model_len, self.block_size)
            profiler = MemoryProfiler(self.device, step, self.memory_baseline, self.weights_bytes)
            profile = profiler.measure(self, self.compiled_forward, self.graphs)
            budget = profile.log_kv_budget(cache.gpu_memory_utilization)
        else:
            budget = self._cpu_kv_budget()
        per_block = kv_cache.kv_bytes_per_block(self.attn_layers, self.block_size,
                                                self.kv_cache_dtype)
        max_blocks = kv_cache.max_useful_blocks(self.max_num_reqs, self.max_model_len,
                                                self.block_size)
        return kv_cache.num_blocks_from_budget(budget, per_block, max_blocks)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = kv_cache.allocate_kv_caches(self.attn_layers, num_blocks, self.block_size,
                                                     self.kv_cache_dtype, self.device)
        bind_kv_caches(self.model, self.kv_caches, self.attn_backend)
        self.num_blocks = num_blocks

    def release_kv_cache(self) -> None:
        """Drop the cache tensors (the profile step's temporary cache) so their memory frees."""
        for layer in self.attn_layers.values():
            layer.kv_cache = None
        self.kv_caches = {}

    # ---- step 1: the plan (docs/architecture.md#step-1-apply-the-plan) --------------------

    def _remove_request(self, req_id: str) -> None:
        slot = self.states.remove_request(req_id)
        if self.lora is not None and slot is not None:
            self.lora.remove_request(slot)

    def _add_request(self, new: NewRequestData) -> None:
        slot = self.states.add_request(new.req_id, new.prefill_token_ids, new.num_prompt_tokens,
                                       new.num_computed_tokens, new.sampling_params)
        self.block_tables.overwrite_row(slot, single_group(new.block_ids, new.req_id))
        if self.lora is not None:
            self.lora.add_request(slot, new.lora_request)
        prompt = new.prefill_token_ids[: new.num_prompt_tokens]
        outputs = new.prefill_token_ids[new.num_prompt_tokens :]
        self.sampler.add_request(slot, new.sampling_params, prompt, outputs, self.eos_token_id)

    def _update_requests(self, cached: CachedRequestData) -> None:
        if not len(cached.req_ids) == len(cached.new_block_ids) == len(cached.num_computed_tokens):
            raise ValueError("scheduled_cached_reqs: req_ids, new_block_ids and "
                             "num_computed_tokens must have the same length")
        slots = self.states.set_num_computed_tokens_batch(cached.req_ids,
                                                          cached.num_computed_tokens)
        for i, new_block_ids in enumerate(cached.new_block_ids):
            if new_block_ids is not None:  # most decodes get no new block
                self.block_tables.append_block_ids(
                    int(slots[i]), single_group(new_block_ids, cached.req_ids[i]))
        for req_id, token_ids in cached.new_token_ids.items():
            self.states.extend_prefill(req_id, token_ids)

    def _apply_plan(self, so: SchedulerOutput) -> None:
        """Mirror the plan in the slots (host writes only; the step's staging copy follows)."""
        for req_id in so.finished_req_ids:
            self._remove_request(req_id)
        for req_id in so.preempted_req_ids:
            self._remove_request(req_id)
        for new in so.scheduled_new_reqs:
            self._add_request(new)
        self._update_requests(so.scheduled_cached_reqs)

    # ---- steps 2-6: batch, inputs, attention metadata, forward ------------------------------

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        self.execute_model_state = None
        self.staging.wait_for_copy()  # the host buffer is about to change
        self._apply_plan(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            self._flush_block_tables()
            return
        batch = self._prepare_inputs(scheduler_output)
        drafts = None
        if scheduler_output.scheduled_spec_decode_tokens:
            drafts = plan_drafts(batch.plan, scheduler_output.scheduled_spec_decode_tokens)
            write_draft_inputs(batch.input_ids, self.states.last_sampled_tokens, batch.plan,
                               batch.query_start_loc_np, drafts)
        metadata = self._prepare_attn(batch)
        hidden_states = self._run_model(batch, metadata)
        self.execute_model_state = ExecuteModelState(batch, metadata, hidden_states,
                                                     scheduler_output.grammar_bitmask, drafts)

    def _flush_block_tables(self) -> None:
        """A step without tokens still lands its staged block-table writes, so entries never
        pile up across steps (a flat index must not repeat within one scatter)."""
        if self.block_tables.has_staged_entries:
            self.staging.copy_to_device()
        self.block_tables.apply_staged_writes()

    def _prepare_inputs(self, so: SchedulerOutput) -> InputBatch:
        plan = plan_batch(so.num_scheduled_tokens, self.states)
        plan.check(so.total_num_scheduled_tokens, self.max_num_batched_tokens, self.max_model_len,
                   self.block_tables.num_blocks_np, self.block_size)
        descriptor, mode = self.graphs.dispatch(plan)
        query_start_loc_np = stage_batch(plan, self.buffers)
        if self.lora is not None:
            self.lora.prepare_step(plan.idx_mapping_np, plan.query_lens_np, descriptor.num_tokens)
        # The step's one host-to-device copy: slot counts, batch rows, block-table entries.
        self.staging.copy_to_device()
        self.block_tables.apply_staged_writes()
        return prepare_inputs(plan, query_start_loc_np, descriptor, mode, self.buffers,
                              self.states, self.ops)

    def _prepare_attn(self, batch: InputBatch) -> AttentionMetadata:
        block_table = self.block_tables.gather_block_tables(batch.idx_mapping,
                                                            batch.num_reqs_after_padding)
        slot_mapping = self.block_tables.compute_slot_mappings(
            batch.idx_mapping, batch.query_start_loc, self.buffers.positions,
            batch.num_tokens_after_padding)
        return build_attn_metadata(batch, block_table, slot_mapping, self.max_model_len)

    def _run_model(self, batch: InputBatch, metadata: AttentionMetadata) -> torch.Tensor:
        ctx = make_forward_context(self.attn_layers, metadata, batch)
        with set_forward_context(ctx):
            return self.forward_fn(batch.input_ids, batch.positions)

    # ---- steps 7-8: logits, sampler, output ----------------------------------------------

    @torch.inference_mode()
    def sample_tokens(self) -> ModelRunnerOutput:
        return self.sample_tokens_async().get_output()

    @torch.inference_mode()
    def sample_tokens_async(self, grammar_bitmask: GrammarBitmask | None = None) -> AsyncOutput:
        """Sample, start the copy to the host, update the slots; the host has not waited.
        ``grammar_bitmask`` (else the plan's) masks the constrained rows' logits first."""
        state, self.execute_model_state = self.execute_model_state, None
        if state is None:
            return AsyncOutput([], [], [], None, None, [], self.copy_stream)
        if state.drafts is not None:
            return self._verify(state, state.drafts)
        batch = state.batch
        rows = batch.plan.sample_rows_np  # batch rows whose prefill is complete
        # The sampled rows' slots and logits rows came with the step's staging copy.
        idx_mapping, idx_mapping_np = batch.sample_idx_mapping, batch.idx_mapping_np
        if rows.shape[0] != batch.num_reqs:  # a partial prefill chunk samples nothing
            idx_mapping_np = idx_mapping_np[rows]
        sampler_output = None
        num_logprobs: list[int | None] = []
        if rows.size:
            grammar = grammar_bitmask or state.grammar_bitmask
            sampled_req_ids = None if grammar is None else [batch.req_ids[r] for r in rows]
            sampler_output = self._sample(state.hidden_states, batch.sample_logits_indices,
                                          idx_mapping, idx_mapping_np, grammar, sampled_req_ids)
            if sampler_output.logprobs is not None:
                num_logprobs = self.states.sampling.num_logprobs(idx_mapping_np)
        prompt_logprobs, prompt_spans = self._prompt_logprobs(state)
        output = AsyncOutput(
            req_ids=batch.req_ids,
            sample_rows=rows.tolist(),
            num_logprobs=num_logprobs,
            sampler_output=sampler_output,
            prompt_logprobs=prompt_logprobs,
            prompt_spans=prompt_spans,
            copy_stream=self.copy_stream,
        )
        if sampler_output is not None:
            self._postprocess(idx_mapping, sampler_output)
        return output

    def _prompt_logprobs(
        self, state: ExecuteModelState
    ) -> tuple[LogprobsTensors | None, list[PromptLogprobsSpan]]:
        """The step's prompt logprobs, when some row of it asks."""
        batch = state.batch
        if not (self.states.num_prompt_logprobs_reqs
                and self.states.wants_prompt_logprobs_np[batch.idx_mapping_np].any()):
            return None, []
        prompt_plan = plan_prompt_logprobs(batch, self.states)
        if prompt_plan is None:
            return None, []
        return (compute_batch_prompt_logprobs(prompt_plan, state.hidden_states,
                                              self.compute_logits, self.states.all_token_ids),
                prompt_plan.spans)

    def _verify(self, state: ExecuteModelState, drafts: DraftBatch) -> AsyncOutput:
        """A step with drafts: every row of a drafting request becomes logits, drafts are
        accepted while they equal the target's samples (``spec_decode/verify.py``)."""
        batch = state.batch
        rows = batch.plan.sample_rows_np
        vp = plan_verify(batch.plan, batch.query_start_loc_np, drafts)
        token_rows = host_to_device(vp.token_rows_np, torch.int64, self.device)
        logits = self._compute_logits(state.hidden_states, token_rows)  # [num_logits_rows, V]
        verified = verify_drafts(logits, self.sampler, vp, drafts, rows)
        sampling = self.states.sampling
        num_logprobs = sampling.max_num_logprobs(vp.slots_np)
        logprobs = None
        if num_logprobs != NO_LOGPROBS:
            logprobs = compute_topk_logprobs(logits, num_logprobs, verified.sampled)
        prompt_logprobs, prompt_spans = self._prompt_logprobs(state)
        output = VerifiedOutput(
            req_ids=batch.req_ids,
            sample_rows=rows.tolist(),
            num_logprobs=sampling.num_logprobs(vp.slots_np) if logprobs is not None else [],
            sampler_output=SamplerOutput(verified.sampled, logprobs),
            num_accepted=verified.num_accepted,
            offsets=vp.offsets_np.tolist(),
            prompt_logprobs=prompt_logprobs,
            prompt_spans=prompt_spans,
            copy_stream=self.copy_stream,
        )
        slots = host_to_device(vp.slots_np, torch.int64, self.device)  # int64 [num_sampled]
        self._postprocess(slots, SamplerOutput(verified.next_tokens, None))
        # The output counters advance by the whole run: accepted drafts, then the next token.
        sampling.num_output_tokens.index_add_(0, slots, verified.num_accepted)
        return output

    def _sample(self, hidden_states: torch.Tensor, logits_indices: torch.Tensor,
                idx_mapping: torch.Tensor, idx_mapping_np: np.ndarray,
                grammar: GrammarBitmask | None = None,
                sampled_req_ids: list[str] | None = None) -> SamplerOutput:
        """``idx_mapping`` is int64: the sampler's index ops take it without a conversion.
        A grammar mask applies before every other logits processing
        (docs/architecture.md#structured-outputs)."""
        logits = self._compute_logits(hidden_states, logits_indices)  # [num_rows, V]
        if grammar is not None and sampled_req_ids is not None:
            self.apply_grammar_bitmask(logits, grammar, sampled_req_ids)
        return self.sampler(logits, idx_mapping, idx_mapping_np)

    def _compute_logits(self, hidden_states: torch.Tensor,
                        logits_indices: torch.Tensor) -> torch.Tensor:
        sample_hidden_states = hidden_states.index_select(0, logits_indices)  # [num_rows, H]
        return self.compute_logits(sample_hidden_states)  # [num_rows, V]

    def _postprocess(self, idx_mapping: torch.Tensor, sampler_output: SamplerOutput) -> None:
        """The next step reads these tokens on the device; the host never needs them to build
        a step."""
        sampled = sampler_output.sampled_token_ids  # int64 [num_rows]
        self.states.last_sampled_tokens.index_copy_(0, idx_mapping, sampled)  # int64 idx_mapping
        self.sampler.update_after_sampling(idx_mapping, sampled)
