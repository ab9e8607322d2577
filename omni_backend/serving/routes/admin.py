"""`POST /reset_prefix_cache`: the operator's route (vLLM's name) that makes the llm stage drop every cached
prompt prefix, for benchmarks that must start cold. It needs the API key when one is set (401) and the
operator's key in the `omni-admin-key` header (403), like `/v2` beyond inference (routes/triton_v2.py)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from omni_backend.serving.front_door import door_of, require_api_key, require_operator_key
from omni_backend.serving.schemas import PrefixCacheReset, answers

router = APIRouter(dependencies=[Depends(require_api_key), Depends(require_operator_key)])


@router.post("/reset_prefix_cache", operation_id="resetPrefixCache", summary="Drop the prefix cache (operator)",
             responses=answers({"model": PrefixCacheReset}, (401, 403, 500, 503)))
async def reset_prefix_cache(request: Request) -> dict:
    """Reset the prefix cache of every llm model behind the served pipelines (each once); answers
    `{"dropped_blocks": n}`, the cached KV blocks dropped in all.

    Raises:
        OpenAIError: the llm stage's refusal or failure (pipeline.TritonPipeline.reset_prefix_cache).
    """
    door = door_of(request)
    by_llm = {}
    for pipeline in door.pipelines.values():
        by_llm.setdefault((await pipeline.info()).llm.model, pipeline)
    dropped = 0
    for pipeline in by_llm.values():
        dropped += await pipeline.reset_prefix_cache(door.config.admin_key)
    return {"dropped_blocks": dropped}
