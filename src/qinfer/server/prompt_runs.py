"""Running a batch of prompts that each end in one finished output (embeddings, scores).

Every prompt is one engine request, all of them batched with whatever else runs, so a
batch larger than the engine's free queue (`--max-waiting-requests`) is refused with a
503 like any overload. One input the engine refuses (or a client gone) stops the others,
which free their blocks.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from qinfer.core.errors import RequestError
from qinfer.engine.outputs import RequestOutput
from qinfer.server.errors import APIError

if TYPE_CHECKING:
    from qinfer.engine import AsyncEngine
    from qinfer.text.prompts import Prompt


async def run_prompts(
    engine: AsyncEngine, prompts: list[Prompt], params: Any, field: str
) -> list[RequestOutput]:
    """The finished output of each prompt, in order; a refusal is a 400 naming
    `field.i`, the input at fault."""
    tasks = [
        asyncio.ensure_future(_run(engine, p, params, f"{field}.{i}"))
        for i, p in enumerate(prompts)
    ]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


async def _run(engine: AsyncEngine, prompt: Prompt, params: Any, name: str) -> RequestOutput:
    outputs = []
    try:
        async for output in engine.generate(prompt, params):
            outputs.append(output)  # one: the finished one
    except RequestError as error:
        raise APIError(400, f"'{name}': {error}", param=name, code="invalid_value") from None
    if outputs[-1].finish_reason == "abort":  # the server is shutting down
        raise APIError(503, f"'{name}' was not run: the engine stopped")
    return outputs[-1]
