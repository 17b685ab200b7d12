"""Loading a serialized :class:`~langchain_kvmemory.ChatKVMemory` with langchain-core.

``dumpd(chat)`` writes the chat model's settings (the model as a name or folder, decoding and
repair settings; never weights or caches). langchain-core rebuilds only the classes on its
allowlist: ``allowed_objects="all"`` means the integrations listed in ``langchain_core.load``'s
mappings. Importing ``langchain_kvmemory`` lists ChatKVMemory there, as an installed partner
integration is listed, so both forms work::

    load(data, valid_namespaces=["langchain_kvmemory"], allowed_objects="all")
    load(data, valid_namespaces=["langchain_kvmemory"], allowed_objects=[ChatKVMemory])

Loading one builds a ChatKVMemory (its model loads lazily from the named folder on the first
call); nothing in the serialized data is executed.
"""

from __future__ import annotations

import importlib

from .chat_model import ChatKVMemory

# the module, not the function ``langchain_core.load.load`` that shadows it
load_module = importlib.import_module("langchain_core.load.load")


def register_for_load() -> None:
    """List ChatKVMemory among the classes ``load(..., allowed_objects="all")`` may rebuild
    (idempotent; called when ``langchain_kvmemory`` is imported)."""
    path = tuple(ChatKVMemory.lc_id())
    load_module.ALL_SERIALIZABLE_MAPPINGS.setdefault(path, path)
    # the allowlist is computed once per process: a load() that ran before this import cached it
    cached = vars(load_module).get("_default_class_paths_cache", {}).get("all")
    if cached is not None:
        cached.add(path)
