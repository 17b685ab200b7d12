"""LangChain / LangGraph integrations for kvmemory, importable as ``langchain_kvmemory``.

The core (``kvmemory``) never imports LangChain; everything that does lives here.
"""

from .chat_model import ChatKVMemory

__all__ = ["ChatKVMemory"]
