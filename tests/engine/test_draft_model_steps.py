"""The draft_model proposer's work per call on the CPU: after a request's first call, a call of
k drafts runs k forward passes of the draft over k tokens (k + 1 after a call whose drafts were
all accepted), admits nothing, and never runs the history again."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.core.sched_output import SchedulerOutput
from pagedserve.spec_decode.proposer import DraftRequest

ENGINE = dict(dtype="float32", max_model_len=128, num_gpu_blocks_override=60, block_size=4,
              max_num_seqs=4)


class Recorder:
    """Wraps the draft proposer: per propose() call, its requests, drafts and draft steps."""

    def __init__(self, proposer) -> None:  # noqa: ANN001
        self.proposer = proposer
        self.calls: list[dict] = []
        runner = proposer.runner
        execute = runner.execute_model

        def recording_execute(plan: SchedulerOutput) -> None:
            self.calls[-1]["steps"].append(
                (plan.total_num_scheduled_tokens, len(plan.scheduled_new_reqs)))
            execute(plan)

        runner.execute_model = recording_execute

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        self.calls.append({"lens": [len(r.token_ids) for r in requests], "steps": []})
        drafts = self.proposer.propose(requests)
        self.calls[-1]["drafts"] = drafts
        return drafts

    def finish(self, req_ids) -> None:  # noqa: ANN001
        self.proposer.finish(req_ids)


@pytest.mark.parametrize("draft_arch", ["llama", "qwen3"])
def test_a_call_runs_k_tokens_after_the_first(checkpoints, draft_arch):
    """The target itself as draft (every draft accepted: two catch-up tokens, the last draft
    and the target's token) or another model (drafts rejected: one)."""
    target, _, _ = checkpoints("llama")
    draft, _, _ = checkpoints(draft_arch)
    k = 3
    llm = LLM(str(target), **ENGINE, speculative_config={
        "method": "draft_model", "model": str(draft), "num_speculative_tokens": k,
        "min_acceptance_rate": 0.0})
    scheduler = llm.engine_core.scheduler
    recorder = Recorder(scheduler.proposer)
    scheduler.proposer = recorder
    prompt = list(range(5, 45))
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    first, *later = recorder.calls
    assert first["steps"][0] == (len(prompt) + 1, 1)  # admission: the whole history
    assert later
    history = prompt + out.outputs[0].token_ids
    for before, call in zip(recorder.calls, later, strict=False):
        (drafts,) = before["drafts"]
        n = before["lens"][0]
        all_accepted = history[n : n + len(drafts)] == drafts
        (max_drafts,) = [len(d) for d in call["drafts"]]
        tokens = [t for t, _ in call["steps"]]
        assert [new for _, new in call["steps"]] == [0] * max_drafts
        assert tokens == [2 if all_accepted else 1] + [1] * (max_drafts - 1)
    accepted = sum(history[c["lens"][0] : c["lens"][0] + len(c["drafts"][0])] == c["drafts"][0]
                   for c in recorder.calls)
    if draft_arch == "llama":
        assert accepted == len(recorder.calls)
