"""Engine configuration: frozen dataclasses, the one source of defaults for the API and the CLI.

Each dataclass validates itself in ``__post_init__`` and raises ``ValueError`` with a message
that names the field. The CLI builds its options from these fields (see ``entrypoints/cli.py``),
so a default lives here and nowhere else.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from pagedserve.field_types import ByteSize, byte_size, check_field_types, require, without_none

if TYPE_CHECKING:
    from pagedserve.platform.base import Platform

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
"""The KV cache element types implemented (``auto``: the model's dtype; fp8 = fp8_e4m3)."""


def choices_of(config_cls: type, name: str) -> tuple[str, ...]:
    """The values a ``Literal`` field accepts (benchmarks build their options from them)."""
    return _literal_fields(config_cls)[name][0]


@functools.cache
def _literal_fields(config_cls: type) -> dict[str, tuple[tuple[str, ...], bool]]:
    """Field name -> (allowed values, whether None is allowed too), for every field typed
    ``Literal[...]`` or ``Literal[...] | None``."""
    out = {}
    for name, tp in typing.get_type_hints(config_cls).items():
        base = without_none(tp)
        if typing.get_origin(base) is Literal:
            out[name] = (typing.get_args(base), base is not tp)
    return out


def _check_fields(config: object) -> None:
    """Every bool, int, float and str field of ``config`` holds one (or None where the field
    allows it), and every ``Literal`` field one of its values."""
    check_field_types(config)
    config_cls: type = type(config)
    for name, (allowed, optional) in _literal_fields(config_cls).items():
        value = getattr(config, name)
        require(
            value in allowed or (optional and value is None),
            f"{name}: {value!r} is not one of {', '.join(allowed)}",
        )


@dataclass(frozen=True)
class ModelConfig:
    model: str = DEFAULT_MODEL
    """A Hugging Face folder, a ``.gguf`` file, or the default model's short name."""
    tokenizer: str | None = None
    """Folder or GGUF file with the tokenizer; defaults to ``model``."""
    dtype: str = "auto"
    """auto | float32 | bfloat16 | float16. auto: bf16 on GPU and on CPUs with native bf16
    matmuls (AMX / AVX512-BF16), else float32."""
    seed: int = 0
    max_model_len: int | None = None
    """Context length; defaults to the model's ``max_position_embeddings``."""
    load_format: Literal["auto", "safetensors", "gguf", "dummy"] = "auto"
    quantization: Literal["fp8"] | None = None
    """fp8: quantize the linear layers' weights to FP8 at load (a scale per output channel;
    activations per token). None: as the checkpoint stores them (an FP8 checkpoint's
    ``quantization_config`` loads without it)."""
    served_model_name: str | None = None
    revision: str | None = None
    """Branch, tag or commit of a hub model (``--model org/name``); None: the default branch."""
    tokenizer_revision: str | None = None
    """Branch, tag or commit of a hub tokenizer; None: ``revision``."""
    download_dir: str | None = None
    """Hub cache folder for hub names; None: the hub's own (``HF_HOME`` / ``HF_HUB_CACHE``)."""
    generation_config: str = "auto"
    """Default sampling values: auto (the model folder's ``generation_config.json``), vllm (the
    engine's own defaults), or a folder holding a ``generation_config.json``. Request fields
    always win."""
    chat_template: str | None = None
    """A Jinja chat template (a file path, or the template text inline) used instead of the
    tokenizer's own on both APIs; None: the tokenizer's."""

    def __post_init__(self) -> None:
        _check_fields(self)
        require(
            self.dtype in ("auto", "float32", "bfloat16", "float16", "half", "float", "bf16", "fp32"),
            f"dtype: unknown dtype {self.dtype!r} (auto, float32, bfloat16, float16)",
        )
        require(
            self.max_model_len is None or self.max_model_len > 0,
            f"max_model_len: must be positive, got {self.max_model_len}",
        )
        require(0 <= self.seed < 2**63, f"seed: must be in [0, 2**63), got {self.seed}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    """Tokens per KV block."""
    gpu_memory_utilization: float = 0.9
    """Fraction of the GPU's memory the engine may use (weights + activations + KV cache)."""
    kv_cache_memory: ByteSize | None = None
    """Byte budget of the KV cache on the CPU (a count of bytes or text: 4GiB, 512MiB, 2GB).
    None: 4 GiB, or half the memory available at start-up where that is less."""
    num_gpu_blocks_override: int | None = None
    """Exact number of KV blocks; overrides both budgets."""
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    """Element type of the KV cache: auto (the model's dtype), or fp8 / fp8_e4m3 (float8 e4m3
    with a scale per layer for keys and one for values: the checkpoint's k_scale / v_scale,
    else 1.0; twice the tokens fit). fp8_e5m2 is refused."""
    calculate_kv_scales: bool = False
    """FP8 cache: give each layer that has no k_scale / v_scale in the checkpoint scales computed
    from the first step with tokens (amax / 448, before that step writes the cache) instead of
    1.0. Needs kv_cache_dtype fp8 and, on a GPU, enforce_eager (the attention kernels take the
    scales as launch arguments, which a CUDA graph would keep from its capture)."""

    def __post_init__(self) -> None:
        # frozen: the one normalisation, text with a unit -> bytes, before the checks
        if self.kv_cache_memory is not None:
            object.__setattr__(self, "kv_cache_memory",
                               byte_size("kv_cache_memory", self.kv_cache_memory))
        _check_fields(self)
        require(
            self.block_size in (1, 2, 4, 8, 16, 32, 64, 128),
            f"block_size: must be a power of two up to 128, got {self.block_size}",
        )
        require(
            0.0 < self.gpu_memory_utilization <= 1.0,
            f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}",
        )
        require(self.kv_cache_memory is None or self.kv_cache_memory > 0,
                "kv_cache_memory: must be positive")
        require(
            self.num_gpu_blocks_override is None or self.num_gpu_blocks_override >= 2,
            f"num_gpu_blocks_override: needs at least 2 blocks (one is the null block), "
            f"got {self.num_gpu_blocks_override}",
        )
        require(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            f"kv_cache_dtype: {self.kv_cache_dtype!r} is not supported; supported: "
            + ", ".join(KV_CACHE_DTYPES),
        )
        require(
            not self.calculate_kv_scales or self.kv_cache_dtype != "auto",
            "calculate_kv_scales: needs kv_cache_dtype fp8 (a cache in the model's dtype has no "
            "scales)",
        )


SPECULATIVE_METHODS = ("ngram", "draft_model")
"""The proposers implemented."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``--speculative-config`` keys, plus when to turn it off;
    docs/architecture.md#speculative-decoding)."""

    method: str = "ngram"
    """ngram: prompt lookup, drafts copied from the request's own prompt and output;
    draft_model: a small model of the same vocabulary (``model``) drafts greedily."""
    num_speculative_tokens: int = 3
    """Drafts proposed per request and step (k); a step verifies k + 1 tokens."""
    prompt_lookup_min: int = 2
    """ngram: the shortest suffix of the request's tokens that is looked up."""
    prompt_lookup_max: int = 5
    """ngram: the longest suffix looked up (longer ones are tried first)."""
    model: str | None = None
    """draft_model: the draft's folder or GGUF file (same vocabulary as the target)."""
    disable_by_batch_size: int = 32
    """No drafts in a step with more running requests than this: a large batch is bound by
    compute, where verifying drafts costs more than it saves."""
    min_acceptance_rate: float = 0.1
    """A request whose measured acceptance rate falls below this stops drafting for a while
    (``spec_decode/gate.py``)."""

    def __post_init__(self) -> None:
        _check_fields(self)
        require(self.method in SPECULATIVE_METHODS,
                f"method: {self.method!r} is not implemented; one of "
                + ", ".join(SPECULATIVE_METHODS))
        require(1 <= self.num_speculative_tokens <= 16,
                f"num_speculative_tokens: must be in 1..16, got {self.num_speculative_tokens}")
        require(self.prompt_lookup_min >= 1,
                f"prompt_lookup_min: must be >= 1, got {self.prompt_lookup_min}")
        require(self.prompt_lookup_max >= self.prompt_lookup_min,
                f"prompt_lookup_max: {self.prompt_lookup_max} is below prompt_lookup_min="
                f"{self.prompt_lookup_min}")
        require((self.model is not None) == (self.method == "draft_model"),
                "model: method draft_model needs the draft's model, and only it takes one")
        require(self.disable_by_batch_size >= 1,
                f"disable_by_batch_size: must be >= 1, got {self.disable_by_batch_size}")
        require(0.0 <= self.min_acceptance_rate < 1.0,
                f"min_acceptance_rate: must be in [0, 1), got {self.min_acceptance_rate}")

    @staticmethod
    def parse(value: object) -> SpeculativeConfig:
        """From a dict, a JSON object's text (the CLI's form) or a SpeculativeConfig; a
        ValueError naming the key otherwise."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not a JSON object: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config: expected a JSON object, got {value!r}")
        known = {f.name for f in dataclasses.fields(SpeculativeConfig)}
        unknown = sorted(set(value) - known)
        require(not unknown, f"speculative_config: unknown key(s) {unknown}; known: "
                + ", ".join(sorted(known)))
        return SpeculativeConfig(**value)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    """Most requests in one step (and request slots in the runner)."""
    max_num_batched_tokens: int = 8192
    """Token budget of one step."""
    enable_chunked_prefill: bool = True
    policy: Literal["fcfs", "priority"] = "fcfs"
    max_waiting_requests: int | None = None
    """Bound on the waiting queue (the server answers 503 beyond it); None: unbounded."""
    async_scheduling: bool | None = None
    """Plan and launch step N+1 before waiting for step N's tokens (the GPU never idles while
    the host schedules; the output is the same). None: on for GPUs, off on the CPU, whose
    torch ops finish before the host goes on anyway."""
    admission_policy: Literal["reserve", "ratio", "greedy"] = "reserve"
    """How waiting requests are admitted. ratio (SGLang's rule): only while the free KV
    blocks, after a reserve for the running requests' future tokens (their remaining
    max_tokens times a ratio that starts at admission_ratio_init, decays towards
    admission_ratio_min and jumps back on a preemption), still hold the request's prompt and
    its own reserve. reserve: ratio, but the tokens of a request that only its length can
    stop (ignore_eos, no stop tokens or strings) are reserved in full, so such requests are
    never preempted for lack of blocks. greedy (vLLM's rule): whenever the prompt's blocks
    are free, preempting (and recomputing) running requests when they outgrow the cache."""
    admission_ratio_init: float = 0.7
    """reserve admission: the ratio of each running request's remaining max_tokens held in
    reserve at start, after a preemption, and whenever the scheduler has no request."""
    admission_ratio_min: float = 0.1
    """reserve admission: the lowest the ratio decays to."""
    admission_ratio_decay_steps: int = 600
    """reserve admission: steps (with requests running and none preempted) over which the
    ratio falls from admission_ratio_init to admission_ratio_min, linearly."""
    speculative_config: SpeculativeConfig | None = None
    """Speculative decoding, as a JSON object (``{"method": "ngram",
    "num_speculative_tokens": 3}``) or a dict; None: off."""

    def __post_init__(self) -> None:
        if self.speculative_config is not None:  # frozen: the one normalisation
            object.__setattr__(self, "speculative_config",
                               SpeculativeConfig.parse(self.speculative_config))
        _check_fields(self)
        require(self.max_num_seqs >= 1, f"max_num_seqs: must be >= 1, got {self.max_num_seqs}")
        require(
            self.max_num_batched_tokens >= 1,
            f"max_num_batched_tokens: must be >= 1, got {self.max_num_batched_tokens}",
        )
        require(
            0.0 <= self.admission_ratio_min <= self.admission_ratio_init <= 1.0,
            "admission_ratio_init, admission_ratio_min: need 0 <= min <= init <= 1, got "
            f"init={self.admission_ratio_init}, min={self.admission_ratio_min}",
        )
        require(
            self.admission_ratio_decay_steps >= 1,
            f"admission_ratio_decay_steps: must be >= 1, got {self.admission_ratio_decay_steps}",
        )


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters served beside the base model (vLLM's options; docs/lora.md)."""

    enable_lora: bool = False
    """Serve LoRA adapters: a request names one (``LoRARequest``, or the server's model name)."""
    max_loras: int = 1
    """Adapters that one step may run at once: their weights sit in this many slots on the
    device, and every step computes all slots (the cost grows with max_loras x max_lora_rank)."""
    max_lora_rank: int = 16
    """The largest adapter rank accepted (a slot's size)."""
    max_cpu_loras: int | None = None
    """Adapters kept loaded in host memory (least recently used dropped first); None:
    max_loras."""

    def __post_init__(self) -> None:
        _check_fields(self)
        require(1 <= self.max_loras <= 64, f"max_loras: must be in 1..64, got {self.max_loras}")
        require(1 <= self.max_lora_rank <= 512,
                f"max_lora_rank: must be in 1..512, got {self.max_lora_rank}")
        require(self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
                f"max_cpu_loras: must be >= max_loras ({self.max_loras}), "
                f"got {self.max_cpu_loras}")

    @property
    def num_cpu_loras(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    distributed_executor_backend: Literal["uni", "mp", "ray"] | None = None

    def __post_init__(self) -> None:
        _check_fields(self)
        require(
            self.tensor_parallel_size >= 1,
            f"tensor_parallel_size: must be >= 1, got {self.tensor_parallel_size}",
        )


def default_capture_sizes(max_capture_size: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 to 256, then steps of 16 up to ``max_capture_size``."""
    sizes = [1, 2, 4] + list(range(8, 257, 8)) + list(range(272, max_capture_size + 1, 16))
    return [s for s in sizes if s <= max_capture_size]


def default_piecewise_capture_sizes(max_capture_size: int) -> list[int]:
    """2, 4, ..., 64 (powers of two), then steps of 64 up to ``max_capture_size``, then the
    largest of ``default_capture_sizes`` if the steps stop below it: the sparse ladder ends
    where the dense one does, so both modes cover the same token counts.

    Sparse because each PIECEWISE size is one graph per compiled piece (33 for Llama-3-8B)
    while padding a mixed batch costs little: its GEMMs are weight-read bound below ~300
    tokens. Size 1 is left out: a one-token step is a decode (FULL) unless it is a one-token
    prefill, which pads to 2."""
    sizes = [2, 4, 8, 16, 32] + list(range(64, max_capture_size + 1, 64))
    sizes = [s for s in sizes if s <= max_capture_size]
    dense_top = default_capture_sizes(max_capture_size)[-1]
    return sizes if sizes and sizes[-1] == dense_top else [*sizes, dense_top]


@dataclass(frozen=True)
class CompilationConfig:
    enforce_eager: bool = False
    """Never compile or capture graphs."""
    mode: Literal["auto", "compile", "none"] = "auto"
    """auto: torch.compile + CUDA graphs on GPUs, eager on the CPU; compile: torch.compile on
    any device (graphs on GPUs only); none: eager."""
    piece_compiler: Literal["inductor", "eager"] = "inductor"
    """How each piece between attention ops is compiled (eager: traced FX code as it is)."""
    one_token_step: Literal["gemv", "compiled"] = "gemv"
    """How a step of one token runs on a GPU (a batch-1 decode, in its FULL CUDA graph; a
    one-token prefill, eagerly): gemv, on the fused GEMV kernels (RMSNorm, rotary embedding, KV
    write, residual and SiLU-and-mul inside the weight reads; Llama-family models on one GPU,
    others fall back); compiled, like every other batch. On the CPU, gemv runs every step whose
    requests each decode one token in C (``model/cpu_decode.py``; eagerly, one-token steps
    only under ``mode="compile"``), compiled runs them on the torch layers."""
    max_capture_size: int = 512
    cudagraph_capture_sizes: tuple[int, ...] | None = None
    """Explicit capture sizes of both modes (FULL and PIECEWISE); default: FULL
    ``default_capture_sizes(max_capture_size)``, PIECEWISE
    ``default_piecewise_capture_sizes(max_capture_size)``."""
    piecewise_cudagraph_capture_sizes: tuple[int, ...] | None = None
    """Explicit PIECEWISE (mixed batch) capture sizes; overrides ``cudagraph_capture_sizes``
    for PIECEWISE only."""
    budget_step_graph: bool | None = None
    """Also capture a PIECEWISE graph of exactly ``max_num_batched_tokens`` tokens, replayed by
    the steps that fill the token budget (every step of a burst of prompts) and by no other:
    nothing pads into it. It pays for small models, whose full-budget steps are bound by the
    host launching each kernel (docs/gpu.md#the-budget-step-graph), and holds one such step's
    activations off the KV cache.
    Unset: captured when a budget step's linear layers do at most ``HOST_BOUND_LAYER_FLOPS``
    per decoder layer and GPU (``worker/capture_sizes.py``: Qwen3-0.6B and smaller at 8,192
    tokens, not 1B and up)."""

    def __post_init__(self) -> None:
        _check_fields(self)
        require(self.max_capture_size >= 1, "max_capture_size: must be >= 1")
        for name in ("cudagraph_capture_sizes", "piecewise_cudagraph_capture_sizes"):
            sizes = getattr(self, name)
            require(
                sizes is None or all(s >= 1 for s in sizes),
                f"{name}: every size must be >= 1, got {sizes}",
            )

    def uses_compile(self, platform: Platform) -> bool:
        """``auto`` compiles where the platform does by default (CUDA)."""
        if self.enforce_eager or self.mode == "none":
            return False
        return self.mode == "compile" or platform.compiles_by_default

    def uses_cuda_graphs(self, platform: Platform) -> bool:
        return platform.has_cuda_graphs and self.uses_compile(platform)

    @property
    def full_capture_sizes(self) -> list[int]:
        """FULL (uniform decode) graph sizes, ascending: dense, a decode step pads little."""
        if self.cudagraph_capture_sizes is not None:
            return sorted(set(self.cudagraph_capture_sizes))
        return default_capture_sizes(self.max_capture_size)

    @property
    def piecewise_capture_sizes(self) -> list[int]:
        """PIECEWISE (mixed batch) graph sizes, ascending: sparse by default (see
        ``default_piecewise_capture_sizes``)."""
        for sizes in (self.piecewise_cudagraph_capture_sizes, self.cudagraph_capture_sizes):
            if sizes is not None:
                return sorted(set(sizes))
        return default_piecewise_capture_sizes(self.max_capture_size)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    compilation: CompilationConfig = field(default_factory=CompilationConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    device: str = "auto"
    """auto | cpu | cuda | cuda:N."""

    def __post_init__(self) -> None:
        _check_fields(self)
        require(
            re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device) is not None,
            f"device: {self.device!r} is not one of auto, cpu, cuda, cuda:N",
        )
        require(
            self.scheduler.speculative_config is None or self.parallel.tensor_parallel_size == 1,
            "speculative_config: speculative decoding runs with tensor_parallel_size=1 only",
        )
        spec = self.scheduler.speculative_config
        require(
            spec is None or spec.method != "draft_model"
            or self.parallel.distributed_executor_backend in (None, "uni"),
            "speculative_config: draft_model runs beside the target's runner, in process "
            "(distributed_executor_backend uni)",
        )

    @staticmethod
    def from_kwargs(**kwargs) -> EngineConfig:
        """Build from flat keyword arguments (vLLM's ``LLM(...)`` / CLI names)."""
        parts: dict[str, dict] = {name: {} for name in _SECTIONS}
        top: dict = {}
        for key, value in kwargs.items():
            if key == "device":
                top[key] = value
                continue
            section = _FIELD_TO_SECTION.get(key)
            if section is None:
                raise TypeError(f"unknown engine argument {key!r}")
            parts[section][key] = value
        return EngineConfig(**{n: cls(**parts[n]) for n, cls in _SECTIONS.items()}, **top)


_SECTIONS = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
    "compilation": CompilationConfig,
    "lora": LoRAConfig,
}
_FIELD_TO_SECTION = {f.name: n for n, cls in _SECTIONS.items() for f in dataclasses.fields(cls)}
