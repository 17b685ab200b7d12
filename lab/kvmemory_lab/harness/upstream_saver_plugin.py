"""pytest plugin for :mod:`.upstream_saver_tests`: every LangGraph saver that LangGraph's own saver
tests build is wrapped in :class:`~langchain_kvmemory.checkpointer.KVCheckpointSaver`.

Only the factories change: the saver classes (``InMemorySaver``, ``SqliteSaver``,
``AsyncSqliteSaver``, ``PostgresSaver``, ``ShallowPostgresSaver``, ``AsyncPostgresSaver``,
``AsyncShallowPostgresSaver``) are replaced, in their LangGraph modules and in every collected
test module, by a subclass whose constructor (and so every ``from_conn_string``, which calls
``cls(...)``) builds the real saver and returns it wrapped. ``isinstance(wrapper, SqliteSaver)``
holds for a wrapper of a SqliteSaver, and a test's own subclass of a saver class is built as
that subclass and wrapped too. Each wrapper gets its own thread registry (a tiny random-weight
Llama with the embedded tokenizer, no live threads), so every ``get_tuple`` runs the wrapper's
cache-restore search and every ``put`` its cache-reference step; blobs go to a temporary folder.
Some upstream tests read their saver's tables through its private helpers (``_cursor`` ...) or
hook them: the wrappers built here pass missing private attributes through to the wrapped saver
(the library's wrapper forwards public ones only).

The upstream PostgreSQL tests' server URLs (``tests.conftest.DEFAULT_POSTGRES_URI`` /
``DEFAULT_URI``) are replaced by ``KVM_UPSTREAM_PG_ROOT`` / ``KVM_UPSTREAM_PG_URL`` when set.

Environment (set by the runner): ``KVM_UPSTREAM_WRAP`` (``0``: run unwrapped, the baseline),
``KVM_UPSTREAM_BLOB_DIR`` (blob folder).
"""

from __future__ import annotations

import importlib
import os
import sys
import tempfile
from pathlib import Path

# module -> saver class names that LangGraph's saver tests construct
SAVER_CLASSES = {
    "langgraph.checkpoint.memory": ["InMemorySaver"],
    "langgraph.checkpoint.sqlite": ["SqliteSaver"],
    "langgraph.checkpoint.sqlite.aio": ["AsyncSqliteSaver"],
    "langgraph.checkpoint.postgres": ["PostgresSaver", "ShallowPostgresSaver"],
    "langgraph.checkpoint.postgres.aio": ["AsyncPostgresSaver", "AsyncShallowPostgresSaver"],
    "langgraph.checkpoint.postgres.shallow": ["ShallowPostgresSaver", "AsyncShallowPostgresSaver"],
}

_replacements: dict[type, type] = {}  # real saver class -> wrapping subclass
_registry_parts: list = []  # (model, tokenizer), loaded once


def _wrap(inner):
    from kvmemory.threads import ThreadCaches
    from langchain_kvmemory.checkpointer import KVCheckpointSaver

    if not _registry_parts:
        from kvmemory.testing import tiny_loaded

        loaded = tiny_loaded("upstream-tiny")
        _registry_parts.append((loaded.model, loaded.tokenizer))
    model, tokenizer = _registry_parts[0]
    blob_dir = os.environ.get("KVM_UPSTREAM_BLOB_DIR") or tempfile.mkdtemp(prefix="kvm-upstream-blobs-")
    wrapper = KVCheckpointSaver(inner, ThreadCaches(model, tokenizer), blob_dir=Path(blob_dir))
    wrapper.__class__ = _introspectable(type(wrapper))
    return wrapper


_introspectable_types: dict[type, type] = {}


def _introspectable(kind: type) -> type:
    """``kind`` whose missing private attributes are read from (and, when the wrapped saver has
    them, written to) the wrapped saver: the upstream tests inspect their saver's tables through
    private helpers (``_cursor``, ``_load_blobs``, ``_load_checkpoint_tuple``) and hook its
    ``_cursor`` to interleave writes, which the wrapper deliberately does not forward. A subclass of
    ``kind``, so capability checks and ``isinstance`` see the wrapper unchanged."""
    if kind not in _introspectable_types:
        def __getattr__(self, name):
            if name.startswith("_") and not name.startswith("__") and "saver" in self.__dict__:
                return getattr(self.__dict__["saver"], name)
            public = getattr(kind, "__getattr__", None)  # public names: the library's own rule
            if public is None:
                raise AttributeError(f"{kind.__name__!r} object has no attribute {name!r}")
            return public(self, name)

        def __setattr__(self, name, value):
            saver = self.__dict__.get("saver")
            if name.startswith("_") and name not in self.__dict__ and saver is not None and hasattr(saver, name):
                setattr(saver, name, value)  # e.g. a test hooking the saver's _cursor
            else:
                object.__setattr__(self, name, value)

        def __delattr__(self, name):
            saver = self.__dict__.get("saver")
            if name.startswith("_") and name not in self.__dict__ and saver is not None and name in vars(saver):
                delattr(saver, name)  # monkeypatch undoing such a hook
            else:
                object.__delattr__(self, name)

        _introspectable_types[kind] = type(kind.__name__, (kind,), {
            "__getattr__": __getattr__, "__setattr__": __setattr__, "__delattr__": __delattr__,
            "__module__": kind.__module__,
            "__qualname__": kind.__qualname__})
    return _introspectable_types[kind]


def _wrapping_class(original: type) -> type:
    """A subclass of ``original`` whose instances are built as ``original`` (or as the test's own
    subclass) and returned wrapped; ``isinstance`` looks through the wrapper."""

    class WrappingMeta(type(original)):
        def __instancecheck__(cls, obj):
            from langchain_kvmemory.checkpointer import KVCheckpointSaver

            inner = obj.saver if isinstance(obj, KVCheckpointSaver) else obj
            return type.__instancecheck__(original if cls is wrapping else cls, inner)

    def __new__(cls, *args, **kwargs):
        inner = object.__new__(original if cls is wrapping else cls)
        inner.__init__(*args, **kwargs)
        return _wrap(inner)

    wrapping = WrappingMeta(original.__name__, (original,), {
        "__new__": __new__, "__module__": original.__module__, "__qualname__": original.__qualname__})
    return wrapping


def _install() -> None:
    for module_name, names in SAVER_CLASSES.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue  # e.g. no langgraph-checkpoint-postgres: its suite is not run
        for name in names:
            original = getattr(module, name, None)
            if not isinstance(original, type):
                continue
            original = next((o for o, w in _replacements.items() if w is original), original)
            _replacements.setdefault(original, _wrapping_class(original))
    _patch_namespaces([m for name, m in list(sys.modules.items()) if name.startswith("langgraph.checkpoint")])


def _patch_namespaces(modules) -> None:
    """Point every name bound to a real saver class at its wrapping class (aliases included)."""
    for module in modules:
        namespace = getattr(module, "__dict__", None)
        if namespace is None or module.__name__.startswith("langchain_kvmemory"):
            continue  # the wrapper's own imports stay real
        for key, value in list(namespace.items()):
            if isinstance(value, type) and value in _replacements:
                namespace[key] = _replacements[value]


def _wrapping_on() -> bool:
    return os.environ.get("KVM_UPSTREAM_WRAP", "1") != "0"


def pytest_configure(config) -> None:
    if _wrapping_on():
        _install()


def pytest_plugin_registered(plugin, manager) -> None:
    """The upstream PostgreSQL conftest names its own server: point it at ours."""
    if getattr(plugin, "__name__", "").endswith("tests.conftest"):
        for key, env in (("DEFAULT_POSTGRES_URI", "KVM_UPSTREAM_PG_ROOT"), ("DEFAULT_URI", "KVM_UPSTREAM_PG_URL")):
            if hasattr(plugin, key) and os.environ.get(env):
                setattr(plugin, key, os.environ[env])


def pytest_collection_modifyitems(session, config, items) -> None:
    if _wrapping_on():
        _patch_namespaces({item.module for item in items if getattr(item, "module", None) is not None})
