"""When a request stops, decided after each appended token (stop strings are the
detokenizer's job: it finishes the request through ``Scheduler.finish_requests``)."""

from __future__ import annotations

from pagedserve.core.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Set the finished status (and ``stop_reason`` for a stop token) and return True if the
    request is done. Length caps come first; EOS and stop tokens count only once
    ``min_tokens`` tokens were generated (the stopping token included)."""
    if request.num_tokens >= max_model_len or request.num_output_tokens >= request.max_tokens:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    params = request.sampling_params
    if request.num_output_tokens < params.min_tokens:
        return False
    last_token_id = request.output_token_ids[-1]
    if not params.ignore_eos and last_token_id == request.eos_token_id:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if last_token_id in params.stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last_token_id
        return True
    return False
