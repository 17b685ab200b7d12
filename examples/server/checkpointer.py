"""The LangGraph Agent Server's custom checkpointer (``langgraph.json``:
``"checkpointer": {"backend": "custom", "path": "./checkpointer.py:checkpointer"}``).

The server enters ``checkpointer()`` once at start-up (an async context manager yielding a
``BaseCheckpointSaver``) and closes it at shutdown. It yields kvmemory's ``KVCheckpointSaver``
over LangGraph's ``AsyncSqliteSaver``, tied to the chat model of ``kvmemory_agent`` (the same
object the served graph calls), with the thread's KV cache stored as token blocks in a folder:

    $KVMEMORY_SERVER_DIR/checkpoints.sqlite   checkpoints and pending writes
    $KVMEMORY_SERVER_DIR/blocks/              manifests and K/V blocks (filesystem block store)

(default ``.kvmemory-server`` in the folder the server runs in). Deleting a thread through the
API (``client.threads.delete``) deletes its checkpoints and shreds its manifests and the blocks
no other thread's state names (``delete_blocks=True``: this server alone writes the folder).
"""

from __future__ import annotations

import asyncio
import os
from contextlib import asynccontextmanager
from pathlib import Path

from kvmemory_agent import llm

from langchain_kvmemory.checkpointer import KVCheckpointSaver

DIR_ENV = "KVMEMORY_SERVER_DIR"


def data_dir() -> Path:
    """The folder of the checkpoints and blocks (``$KVMEMORY_SERVER_DIR``, default ``.kvmemory-server``)."""
    return Path(os.environ.get(DIR_ENV) or ".kvmemory-server").resolve()


@asynccontextmanager
async def checkpointer():
    from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

    folder = data_dir()
    await asyncio.to_thread(folder.mkdir, parents=True, exist_ok=True)  # no file work on the event loop
    async with AsyncSqliteSaver.from_conn_string(str(folder / "checkpoints.sqlite")) as inner:
        await inner.setup()
        saver = await asyncio.to_thread(KVCheckpointSaver, inner, llm, block_store=folder / "blocks",
                                        delete_blocks=True)
        try:
            yield saver
        finally:
            saver.close()
