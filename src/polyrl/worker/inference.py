"""The worker's backend for the OpenAI- and vLLM-compatible endpoints: its own engine."""

from __future__ import annotations

from collections.abc import AsyncIterator

from polyrl.engine.types import EngineRequest, SampleDelta
from polyrl.inference.protocol import MAX_N
from polyrl.inference.render import new_id
from polyrl.inference.routes import Served, model_names
from polyrl.protocol.sampling import MAX_TOP_LOGPROBS, SamplingParams
from polyrl.worker.state import WorkerState
from polyrl.worker.stream import coalesce


class WorkerBackend:
    def __init__(self, state: WorkerState) -> None:
        self.state = state

    async def served(self) -> Served:
        st = self.state
        max_n = min(MAX_N, st.max_num_seqs)
        names = model_names(st.model_path) + (
            [st.lora_name] if st.lora_name else []
        )  # vLLM clients ask by adapter name
        return Served(names, st.tokenizer, st.engine.engine.max_model_len, max_n, MAX_TOP_LOGPROBS)

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> AsyncIterator[list[SampleDelta]]:
        """The engine's deltas, merged while the reader is busy (as /generate's stream);
        counted as an open generation, which a drain waits for."""
        st = self.state
        st.require_active()
        stream = coalesce(st.engine.generate(EngineRequest(rid=new_id("oai"), input_ids=prompt_ids, sampling=sampling)))
        st.num_open_generates += 1
        try:
            async for deltas in stream:
                yield deltas
        finally:
            st.num_open_generates -= 1
            await stream.aclose()
