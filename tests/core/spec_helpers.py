"""Speculative decoding against the fake model of core_helpers: a proposer that knows the fake
model (and lies on purpose at some positions), a runner that verifies drafts, and the engine
loop's rule of not planning past a speculative step."""

from __future__ import annotations

from collections.abc import Sequence

from pagedserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.spec_decode.proposer import DraftRequest, StatelessProposer
from tests.core.core_helpers import VOCAB, EngineLoop, FakeRunner, fake_token


class OracleProposer(StatelessProposer):
    """Drafts the fake model's own continuation, with a wrong token wherever
    ``(num_tokens * 5 + j) % wrong_every == 0``: accepted runs of every length occur."""

    def __init__(self, wrong_every: int = 4) -> None:
        self.wrong_every = wrong_every

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        out = []
        for r in requests:
            history, drafts = list(r.token_ids), []
            for j in range(r.max_drafts):
                token = fake_token(history)
                if (len(r.token_ids) * 5 + j) % self.wrong_every == 0:
                    token = (token + 1) % VOCAB
                drafts.append(token)
                history.append(token)
            out.append(drafts)
        return out


class SpecFakeRunner(FakeRunner):
    """FakeRunner that runs drafts: their KV is written from the drafted history, then the
    drafts are accepted while they equal the fake model's tokens. Rejected positions keep KV
    of a wrong history, so a rollback that let a later step read them fails the KV check."""

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        spec = plan.scheduled_spec_decode_tokens
        known = {rid: len(self.slots[rid].token_ids) for rid in spec}
        for rid, drafts in spec.items():
            self.slots[rid].token_ids.extend(drafts)
        output = super().execute(plan)
        for i, rid in enumerate(output.req_ids):
            if rid in spec:
                output.sampled_token_ids[i] = self._accept(rid, known[rid], spec[rid])
        return output

    def _accept(self, rid: str, known: int, drafts: list[int]) -> list[int]:
        slot = self.slots[rid]
        tokens = slot.token_ids[: known + len(drafts)]  # the bonus token appended by execute
        out = []
        for j in range(len(drafts) + 1):
            out.append(fake_token(tokens[: known + j]))
            if j == len(drafts) or out[-1] != drafts[j]:
                break
        num_accepted = len(out) - 1
        slot.token_ids = tokens[: known + num_accepted] + [out[-1]]
        del slot.fingerprints[known + num_accepted :]
        slot.num_computed_tokens = known + num_accepted
        return out


class SpecEngineLoop(EngineLoop):
    """EngineLoop with the engine core's rule: nothing is planned past a step that verifies
    drafts, nor while the scheduler may draft."""

    def __init__(self, sched, proposer=None) -> None:  # type: ignore[no-untyped-def]
        super().__init__(sched)
        self.runner = SpecFakeRunner(sched.kv_cache_manager.block_size)
        sched.proposer = proposer or OracleProposer()

    def step(self) -> SchedulerOutput:
        if self.pending and (self.sched.speculating()
                             or self.pending[-1][0].scheduled_spec_decode_tokens):
            self.flush()
        return super().step()
