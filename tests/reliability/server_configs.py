"""The options of each server the reliability tests start, and the sizes tests derive from
them."""

from __future__ import annotations

MAIN_MAX_MODEL_LEN = 64
"""The shared server's context: short, so that any request the fuzzer makes is cheap."""
MAIN_CONNECTION_TIMEOUT_S = 2.0
"""The shared server's header and body timeouts: short, so idle sockets are cut quickly."""
PRESSURE_MAX_MODEL_LEN = 40
PRESSURE_BLOCK_SIZE = 4
PRESSURE_NUM_BLOCKS = 12
"""11 usable blocks of 4 tokens (one is the null block): one request of 40 tokens fits."""
LIFECYCLE_MAX_MODEL_LEN = 16384
"""Long enough that a request outlives the lifecycle tests at any speed."""
SHUTDOWN_TIMEOUT_S = 3.0
HANG_ENGINE_TIMEOUT_S = 2.0

TOKEN_BUDGET = ("--max-num-batched-tokens", "256")
"""Each server's token budget per step: the model runner's input buffers are this long and the
CPU path touches all of their rows every step, so a small budget keeps steps fast."""

SERVER_ARGS: dict[str, tuple[str, ...]] = {
    "main_server": (
        "--max-model-len",
        str(MAIN_MAX_MODEL_LEN),
        *TOKEN_BUDGET,
        "--header-timeout",
        str(MAIN_CONNECTION_TIMEOUT_S),
        "--body-timeout",
        str(MAIN_CONNECTION_TIMEOUT_S),
    ),
    "pressure_server": (
        *TOKEN_BUDGET,
        "--max-model-len",
        str(PRESSURE_MAX_MODEL_LEN),
        "--block-size",
        str(PRESSURE_BLOCK_SIZE),
        "--num-gpu-blocks-override",
        str(PRESSURE_NUM_BLOCKS),
        # Admit whenever the prompt fits (vLLM's rule), so the pool overflows and preempts.
        "--admission-policy",
        "greedy",
    ),
    "lifecycle_server": (
        *TOKEN_BUDGET,
        "--max-model-len",
        str(LIFECYCLE_MAX_MODEL_LEN),
        "--max-num-seqs",
        "3",
        "--max-waiting-requests",
        "1",
        "--shutdown-timeout",
        str(SHUTDOWN_TIMEOUT_S),
    ),
    "faults_server": TOKEN_BUDGET,
    "hang_server": (*TOKEN_BUDGET, "--engine-timeout", str(HANG_ENGINE_TIMEOUT_S)),
}
"""Fixture name -> options (after the defaults of ``ServerProcess``: max_model_len
``MAX_MODEL_LEN``, float32)."""

SHAPE_CACHES_OFF = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0", "LRU_CACHE_CAPACITY": "1"}
"""oneDNN's primitive cache and torch's (ideep's) cache of matmul set-ups each keep up to 1,024
entries, one per new batch shape, so a CPU engine's RSS grows by tens of MiB over its first
thousands of distinct steps and then stays (docs/cpu.md#threads-and-the-allocator). A server
that measures its memory before and after a load runs without them, so that only a leak
grows it."""

SERVER_ENV: dict[str, dict[str, str]] = {"main_server": SHAPE_CACHES_OFF}
"""Fixture name -> environment variables beside the test run's."""
