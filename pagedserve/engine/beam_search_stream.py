"""BeamSearchStream: a beam search run by the API process, read like any ``RequestStream``.

Its one output is the finished search (a ``RequestOutput`` with a completion per beam, best
first), whatever the output kind. Each round submits one expansion request per live beam
(pagedserve/beam_search.py) and waits for all of them. The stream's deadline, ``close()``, the
client going away and engine failures end the search as they end any request: the running
round's expansions are closed, so the engine core aborts them and frees their blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from pagedserve.beam_search import (
    BeamSearch,
    candidates,
    expansion_prompt,
    search_output,
    text_decoder,
)
from pagedserve.engine.input_processor import ProcessedRequest
from pagedserve.engine.request_stream import RequestStream
from pagedserve.outputs import RequestOutput

if TYPE_CHECKING:
    from pagedserve.engine.async_llm import AsyncLLM


class BeamSearchStream(RequestStream):
    def __init__(self, engine: AsyncLLM, processed: ProcessedRequest,
                 timeout: float | None = None) -> None:
        super().__init__(engine, processed, timeout)
        assert processed.beam_search is not None
        self.engine = engine
        self.processed = processed
        self.search: BeamSearch = processed.beam_search
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        try:
            self.queue.put_nowait(await self._search())
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # the consumer raises it
            self.fail(error)

    async def _search(self) -> RequestOutput:
        while prompts := self.search.pending():
            finals = await asyncio.gather(*(
                self._expand(f"{self.request_id}-{self.search.rounds}-{i}", ids)
                for i, ids in enumerate(prompts)
            ))
            self.search.advance([candidates(final) for final in finals])
        processor = self.engine.input_processor
        assert processor is not None
        return search_output(self.request_id, self.processed.prompt, self.search,
                             processor.eos_token_id, text_decoder(self.engine.tokenizer))

    async def _expand(self, request_id: str, token_ids: list[int]) -> RequestOutput:
        """One beam's expansion: its request's final output (with the candidates)."""
        processor = self.engine.input_processor
        assert processor is not None
        expansion = processor.process_inputs(
            request_id, expansion_prompt(self.search, token_ids), self.processed.sampling_params,
            priority=self.search.priority, lora_request=self.search.lora_request,
        )
        stream = await self.engine.submit_expansion(expansion)
        try:
            final = None
            async for output in stream:
                final = output
            assert final is not None
            return final
        finally:
            stream.close()

    def on_end(self, callback: Callable[[BeamSearchStream], None]) -> None:
        """Call ``callback(self)`` once the search ends, however it ends."""
        self._task.add_done_callback(lambda _: callback(self))

    def cancel(self) -> None:
        """Stop the search; the running round's expansions are aborted. What the consumer
        reads next (an error put on the stream) is left to the caller."""
        self._task.cancel()

    def close(self) -> None:
        """Ends the search; the running round's expansions are aborted."""
        self.done = True
        self.cancel()
