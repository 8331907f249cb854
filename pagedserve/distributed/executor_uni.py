"""The in-process executor (TP=1): the engine's calls go straight to one ``ModelRunner``."""

from __future__ import annotations

from pagedserve.config import EngineConfig
from pagedserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.distributed.executor import Executor, PendingOutput
from pagedserve.platform import resolve_device
from pagedserve.structured_output.bitmask import GrammarBitmask
from pagedserve.worker.model_runner import ModelRunner


class UniprocExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        if self.tensor_parallel_size != 1:
            raise ValueError(
                f"tensor_parallel_size: the in-process executor runs one rank, got "
                f"{self.tensor_parallel_size}"
            )
        self._runner = ModelRunner(config, resolve_device(config.device))

    @property
    def model_runner(self) -> ModelRunner:
        return self._runner

    def load_model(self) -> None:
        self._runner.load_model()
        self.hf_config = self._runner.hf_config
        self.max_model_len = int(self._runner.max_model_len)
        self.dtype = self._runner.dtype
        self.device = self._runner.device

    def determine_num_blocks(self) -> int:
        return self._runner.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._runner.initialize_kv_cache(num_blocks)

    def capture_graphs(self) -> None:
        self._runner.capture_graphs()

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        self._runner.execute_model(scheduler_output)

    samples_separately = True

    def sample_tokens_async(self, grammar_bitmask: GrammarBitmask | None = None) -> PendingOutput:
        return self._runner.sample_tokens_async(grammar_bitmask)

    def sample_tokens(self) -> ModelRunnerOutput:
        return self._runner.sample_tokens()

    def shutdown(self) -> None:
        """Nothing to stop: the runner lives as long as this process holds it."""
