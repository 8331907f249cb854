"""When a request drafts: the rule that keeps speculation from costing more than it saves.

- Never in a step with more running requests than ``disable_by_batch_size`` (a large batch is
  bound by compute: verifying k drafts costs about k + 1 times a decode's work there), nor while
  a constrained request runs (its mask covers one row per step).
- Never for a request whose sampling needs its own history row by row (penalties, and
  bad_words, whose prefixes are matched against the output tokens kept up to the last step,
  not against the drafts a verifying row follows) or that asks for prompt logprobs: those run
  one token per step.
- Per request, the acceptance rate of its drafts is followed as a moving average
  (``ACCEPTANCE_WEIGHT`` to the last step). Below ``min_acceptance_rate`` the request pauses for
  ``PAUSE_STEPS`` steps, then tries again from just above the threshold, so a request whose
  text stops repeating pays for at most a few rejected steps per pause.
"""

from __future__ import annotations

from pagedserve.core.request import Request
from pagedserve.sampling_params import SamplingParams

ACCEPTANCE_WEIGHT = 0.3
PAUSE_STEPS = 16


def drafts_allowed(params: SamplingParams) -> bool:
    """Whether a request with these parameters may draft at all."""
    return (
        params.repetition_penalty == 1.0
        and params.frequency_penalty == 0.0
        and params.presence_penalty == 0.0
        and params.prompt_logprobs is None
        and params.structured_outputs is None
        and not params.bad_words
        and not params.bad_words_token_ids
    )


class DraftGate:
    def __init__(self, min_acceptance_rate: float) -> None:
        self.min_rate = min_acceptance_rate

    def may_draft(self, request: Request) -> bool:
        """Whether ``request`` drafts this step (a paused request counts one step down)."""
        if request.draft_pause > 0:
            request.draft_pause -= 1
            if request.draft_pause == 0:
                request.draft_acceptance = min(1.0, 2 * self.min_rate)
            return False
        return drafts_allowed(request.sampling_params)

    def record(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """Follow the request's acceptance after a step that verified ``num_drafts``."""
        rate = num_accepted / num_drafts
        request.draft_acceptance += ACCEPTANCE_WEIGHT * (rate - request.draft_acceptance)
        if request.draft_acceptance < self.min_rate:
            request.draft_pause = PAUSE_STEPS
