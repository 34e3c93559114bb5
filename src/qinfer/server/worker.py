"""What a router asks of a replica: its load, its cache flushed, what it serves.

Routers in front of several `qinfer serve` replicas (SMG, the SGLang Model Gateway, with
`--policy cache_aware`; see docs/GUIDE.md) read these in SGLang's shapes:

- `GET /v1/loads?include=core,queues,memory`: SMG's `WorkerLoadResponse` (SGLang's
  answer), one load for the one data-parallel rank a qinfer process is;
- `POST /flush_cache`: forget the prefix cache's blocks that no request holds (SMG fans
  it out to every worker). Requests running meanwhile keep theirs, and the answer says
  how many blocks were dropped and kept, so it is always a 200 and never drops a request;
- `GET /server_info`, `/model_info` (and SGLang's `/get_server_info`, `/get_model_info`).

Every route here is behind the API key, like the /v1 routes: a router holding the key
(`smg launch --api-key`) passes it on.
"""

from __future__ import annotations

import itertools
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from fastapi import APIRouter, Query

from qinfer.core.version import VERSION
from qinfer.server.errors import APIError, ErrorBody
from qinfer.server.openapi import ERROR_REASONS
from qinfer.server.routing import Access
from qinfer.server.schema import Answer

if TYPE_CHECKING:
    from qinfer.engine import EngineStats
    from qinfer.server.model_server import ModelServer

#: The sections of a load SGLang names in `include`: qinfer reports core, memory and
#: queues; disagg, spec and lora are accepted (SMG asks for disagg) and have nothing to
#: report here; all: every section.
LOAD_SECTIONS = ("core", "memory", "queues", "disagg", "spec", "lora", "all")

#: What `load_sections` accepts, for the document: sections between commas, each with
#: spaces around it or none, and empty ones skipped, at least one named.
_SECTION = f"({'|'.join(LOAD_SECTIONS)})"
INCLUDE_PATTERN = rf"^(\s*,)*\s*{_SECTION}\s*(,\s*({_SECTION}\s*)?)*$"

GB = 2**30


class MemoryLoad(Answer):
    """Memory the replica holds: weights and the KV pool (GiB), and the tokens it fits."""

    weight_gb: float
    kv_cache_gb: float
    graph_gb: float = 0.0  # CUDA graphs' private pools are not measured
    token_capacity: int


class QueueLoad(Answer):
    """Requests waiting, by why: for a slot (waiting); qinfer has no other queues."""

    waiting: int
    grammar: int = 0
    paused: int = 0
    retracted: int = 0


class RankLoad(Answer):
    """One data-parallel rank's load (a qinfer replica is one rank, rank 0)."""

    dp_rank: int = 0
    num_running_reqs: int
    num_waiting_reqs: int
    num_total_reqs: int
    num_used_tokens: int  # token positions of the KV blocks requests hold
    max_total_num_tokens: int  # token positions of the whole KV pool
    token_usage: float  # num_used_tokens / max_total_num_tokens
    gen_throughput: float  # generated tokens per second, over the last seconds
    cache_hit_rate: float  # prompt tokens found in the prefix cache / those looked up
    # prompt tokens whose K/V were read from the prompt cache on disk (`--prompt-cache-dir`)
    prompt_tokens_from_disk: int = 0
    utilization: float  # running requests / the most a step batches
    max_running_requests: int
    memory: MemoryLoad | None = None
    queues: QueueLoad | None = None


class AggregateLoad(Answer):
    """The ranks' loads summed (totals) and averaged (avg_)."""

    total_running_reqs: int
    total_waiting_reqs: int
    total_reqs: int
    avg_token_usage: float
    avg_throughput: float
    avg_utilization: float


class WorkerLoadResponse(Answer):
    """`GET /v1/loads`: SMG's `WorkerLoadResponse`, as SGLang answers it."""

    timestamp: str
    version: str
    dp_rank_count: int
    loads: list[RankLoad]
    aggregate: AggregateLoad


class FlushResponse(Answer):
    """`POST /flush_cache`: what the flush did (blocks of `block_size` token positions)."""

    message: str
    dropped_blocks: int  # cached prefixes forgotten: no request held them
    kept_blocks: int  # cached prefixes running requests hold: kept for them
    dropped_disk_blocks: int  # the prompt cache's files of this model removed (--prompt-cache-dir)
    running_requests: int
    block_size: int


class ModelInfo(Answer):
    """`GET /model_info`: the served model, as SGLang's `/get_model_info` names it."""

    model_path: str  # the served model's id (`--served-model-name`)
    served_model_name: str
    model_type: str
    is_generation: bool  # the server's task is "generate"
    has_image_understanding: bool
    max_model_len: int


class ServerInfo(Answer):
    """`GET /server_info`: how the replica runs, for routers and operators."""

    version: str
    served_model_name: str
    task: str
    max_model_len: int
    max_running_requests: int
    max_total_num_tokens: int
    page_size: int  # token positions per KV block: the prefix cache's unit
    enable_prefix_caching: bool
    load: RankLoad


def router(server: ModelServer, access: Access) -> APIRouter:
    """GET /v1/loads, POST /flush_cache, GET /server_info and /model_info (any task)."""
    routes = APIRouter(dependencies=access.authorized)
    memory = memory_load(server)

    # Sections not asked for are left out, as SGLang leaves them.
    bad_include = {400: {"description": ERROR_REASONS[400], "model": ErrorBody}}

    @routes.get("/v1/loads", response_model_exclude_none=True, responses=bad_include)
    async def loads(
        include: str = Query(
            "all",
            description=f"sections, comma-separated: {LOAD_SECTIONS}",
            json_schema_extra={"pattern": INCLUDE_PATTERN},
        ),
    ) -> WorkerLoadResponse:
        sections = load_sections(include)
        load = rank_load(server, server.engine.stats(), memory, sections)
        return WorkerLoadResponse(
            timestamp=datetime.now(timezone.utc).isoformat(),
            version=VERSION,
            dp_rank_count=1,
            loads=[load],
            aggregate=AggregateLoad(
                total_running_reqs=load.num_running_reqs,
                total_waiting_reqs=load.num_waiting_reqs,
                total_reqs=load.num_total_reqs,
                avg_token_usage=load.token_usage,
                avg_throughput=load.gen_throughput,
                avg_utilization=load.utilization,
            ),
        )

    @routes.post("/flush_cache")
    async def flush_cache() -> FlushResponse:
        flush = await server.engine.flush_prefix_cache()
        running = server.engine.stats().num_running
        kept = f", kept {flush.kept_blocks} that running requests hold" if flush.kept_blocks else ""
        disk = (
            f", removed {flush.dropped_disk_blocks} from disk" if flush.dropped_disk_blocks else ""
        )
        return FlushResponse(
            message=f"Cache flushed: dropped {flush.dropped_blocks} cached blocks{kept}{disk}",
            dropped_blocks=flush.dropped_blocks,
            kept_blocks=flush.kept_blocks,
            dropped_disk_blocks=flush.dropped_disk_blocks,
            running_requests=running,
            block_size=server.engine.engine.config.block_size,
        )

    @routes.get("/model_info")
    @routes.get("/get_model_info")
    async def model_info() -> ModelInfo:
        name = server.settings.model_name
        return ModelInfo(
            model_path=name,
            served_model_name=name,
            model_type=server.engine.model_config.model_type,
            is_generation=server.settings.task == "generate",
            has_image_understanding=server.accepts_images,
            max_model_len=server.engine.context_len,
        )

    @routes.get("/server_info")
    @routes.get("/get_server_info")
    async def server_info() -> ServerInfo:
        config = server.engine.engine.config
        load = rank_load(server, server.engine.stats(), memory, frozenset(LOAD_SECTIONS))
        return ServerInfo(
            version=VERSION,
            served_model_name=server.settings.model_name,
            task=server.settings.task,
            max_model_len=server.engine.context_len,
            max_running_requests=config.max_num_seqs,
            max_total_num_tokens=load.max_total_num_tokens,
            page_size=config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            load=load,
        )

    return routes


def load_sections(include: str) -> frozenset[str]:
    """The sections `include` names (every one for "all"), or a 400 naming `include`."""
    sections = frozenset(part.strip() for part in include.split(",") if part.strip())
    unknown = sorted(sections - set(LOAD_SECTIONS))
    if unknown or not sections:
        raise APIError(
            400,
            f"Invalid value for 'include': {include!r} is not a comma-separated list of "
            f"{', '.join(LOAD_SECTIONS)}",
            param="include",
            code="invalid_value",
        )
    return frozenset(LOAD_SECTIONS) if "all" in sections else sections


def rank_load(
    server: ModelServer, stats: EngineStats, memory: MemoryLoad, sections: frozenset[str]
) -> RankLoad:
    """The replica's load from the engine's last snapshot; memory and queues when asked."""
    max_running = server.engine.engine.config.max_num_seqs
    capacity = stats.kv_blocks_total * stats.kv_block_size
    used = stats.kv_blocks_used * stats.kv_block_size
    return RankLoad(
        num_running_reqs=stats.num_running,
        num_waiting_reqs=stats.num_waiting,
        num_total_reqs=stats.num_running + stats.num_waiting,
        num_used_tokens=used,
        max_total_num_tokens=capacity,
        token_usage=used / max(capacity, 1),
        gen_throughput=stats.generation_tokens_per_s,
        cache_hit_rate=stats.prefix_cache_hit_rate,
        prompt_tokens_from_disk=stats.prompt_tokens_from_disk_total,
        utilization=stats.num_running / max_running,
        max_running_requests=max_running,
        memory=memory if "memory" in sections else None,
        queues=QueueLoad(waiting=stats.num_waiting) if "queues" in sections else None,
    )


def memory_load(server: ModelServer) -> MemoryLoad:
    """The weights' and KV pool's sizes (fixed once the server starts)."""
    executor = server.engine.engine.executor
    model = executor.model
    weights = sum(t.nbytes for t in itertools.chain(model.parameters(), model.buffers()))
    stats = server.engine.stats()
    return MemoryLoad(
        weight_gb=weights / GB,
        kv_cache_gb=executor.kv_cache_bytes / GB,
        token_capacity=stats.kv_blocks_total * stats.kv_block_size,
    )
