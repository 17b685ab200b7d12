"""The custom checkpointer of the multi-worker Agent Server (``langgraph.pg.json``:
``"checkpointer": {"backend": "custom", "path": "./checkpointer_pg.py:checkpointer"}``).

Several server processes (``langhost serve``: stock ``langgraph-api`` on the PostgreSQL + Redis
runtime ``langgraph-runtime-pg``) share one PostgreSQL database and one Redis; any of them may
run any thread's next run. Each process enters ``checkpointer()`` once at start-up. It yields
kvmemory's ``KVCheckpointSaver`` over LangGraph's ``AsyncPostgresSaver`` (a connection pool on
the server's own database, the same checkpoint tables the runtime would use), tied to the chat
model of ``kvmemory_agent``, with every thread's KV cache stored as token blocks in a block store
all processes share (Redis by default). A process that runs a thread another one ran last loads
the thread's newest stored state from the blocks (only the blocks it does not hold already) and
repairs it to the checkpointed messages; it does not re-prefill.

Environment (``DATABASE_URI`` and ``REDIS_URI`` are the runtime's own, set by ``langhost serve``):

    KVMEMORY_SERVER_POSTGRES_URL   checkpoints database (default: $DATABASE_URI)
    KVMEMORY_SERVER_BLOCKS         block store: redis://..., postgresql://... or a folder
                                   (default: $REDIS_URI)
    KVMEMORY_SERVER_BLOCKS_NAMESPACE  key prefix of a Redis block store (default kvmemory-server)
    KVMEMORY_WORKER_ID             this process's name in checkpoint metadata
                                   (``kvmemory_cache.writer``; default <host>-<pid>)

Blocks are not shredded when a thread is deleted (``delete_blocks=False``): other processes may
be writing blocks in the same store; ``KVCheckpointSaver.collect_garbage`` (grace period)
removes the ones no checkpoint names.
"""

from __future__ import annotations

import asyncio
import os
import socket
from contextlib import asynccontextmanager

from kvmemory_agent import llm

from langchain_kvmemory.checkpointer import KVCheckpointSaver


def settings() -> dict[str, str]:
    """The checkpoints URL, the block store and this worker's id, from the environment."""
    postgres = os.environ.get("KVMEMORY_SERVER_POSTGRES_URL") or os.environ.get("DATABASE_URI")
    blocks = os.environ.get("KVMEMORY_SERVER_BLOCKS") or os.environ.get("REDIS_URI")
    if not postgres or not blocks:
        raise RuntimeError("checkpointer_pg needs KVMEMORY_SERVER_POSTGRES_URL (or DATABASE_URI) and "
                           "KVMEMORY_SERVER_BLOCKS (or REDIS_URI)")
    return {"postgres": postgres, "blocks": blocks,
            "namespace": os.environ.get("KVMEMORY_SERVER_BLOCKS_NAMESPACE", "kvmemory-server"),
            "worker_id": os.environ.get("KVMEMORY_WORKER_ID") or f"{socket.gethostname()}-{os.getpid()}"}


def _block_store(spec: str, namespace: str):
    from langchain_kvmemory.blockstore import RedisBlockStore, open_block_store

    if spec.startswith(("redis://", "rediss://", "unix://")):
        return RedisBlockStore(spec, namespace=namespace)
    return open_block_store(spec)


@asynccontextmanager
async def checkpointer():
    from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
    from psycopg.rows import dict_row
    from psycopg_pool import AsyncConnectionPool

    conf = settings()
    # autocommit and no prepared statements: what AsyncPostgresSaver needs from a pool
    async with AsyncConnectionPool(conf["postgres"], min_size=1, max_size=8, open=False,
                                   kwargs={"autocommit": True, "prepare_threshold": 0,
                                           "row_factory": dict_row}) as pool:
        inner = AsyncPostgresSaver(pool)
        await inner.setup()  # idempotent (the runtime has created the same tables already)
        store = await asyncio.to_thread(_block_store, conf["blocks"], conf["namespace"])  # connects: off the loop
        saver = await asyncio.to_thread(KVCheckpointSaver, inner, llm, block_store=store,
                                        worker_id=conf["worker_id"])
        try:
            yield saver
        finally:
            saver.close()
            await asyncio.to_thread(store.close)
