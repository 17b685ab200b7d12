"""LangChain / LangGraph integrations for kvmemory, importable as ``langchain_kvmemory``.

The core (``kvmemory``) never imports LangChain; everything that does lives here.
"""

try:
    import langchain_core  # noqa: F401
    import langgraph  # noqa: F401
except ImportError as exc:  # installed with the runtime, usable with the extra
    raise ImportError(f"langchain_kvmemory needs the `langchain` extra ({exc.name} is missing): "
                      "pip install 'kvmemory[langchain]' (in a checkout: pip install '.[langchain]')") from exc

from .chat_model import ChatKVMemory
from .serialization import register_for_load

register_for_load()

__all__ = ["ChatKVMemory"]
