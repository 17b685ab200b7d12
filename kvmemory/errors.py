"""kvmemory's error types: one hierarchy under :class:`KVMemoryError`, so callers can catch
everything kvmemory raises on purpose (``except KVMemoryError``) or the standard base they
already expect (ValueError, TypeError, KeyError, FileNotFoundError, RuntimeError). Every message
names the fix.

    KVMemoryError
    ├── InputError (ValueError)                 a value cannot be used
    │   ├── MessageError                        a malformed message
    │   ├── UnknownMessageError (KeyError)      an edit names an id the session does not hold
    │   ├── ContextOverflowError                the prompt does not fit the model's context
    │   └── EngineUnsupportedError              the fast engine cannot run this model (reason)
    ├── InputTypeError (TypeError)              an argument of the wrong type
    ├── ModelNotFoundError (FileNotFoundError)  no model or tokenizer where it was looked for
    ├── TemplateError (ValueError)              a chat template that is not prefix-stable
    ├── CacheStateError (ValueError)            a stored cache state does not fit this model
    ├── ShiftUnsupportedError (ValueError)      a RoPE that cannot be shifted exactly
    ├── PackedUnsupportedError (ValueError)     a model the packed executor cannot run
    ├── TritonUnavailableError (RuntimeError)   the Triton backend cannot launch here
    ├── ThreadBusyError (TimeoutError)          another call held a thread longer than a call waits
    ├── AdapterUpdateError (RuntimeError)       an online LoRA step failed (rolled back)
    ├── SelectionError (RuntimeError)           internal: an allocator broke its contract
    └── UnitPartitionError (RuntimeError)       internal: units do not partition the suffix

``langchain_kvmemory.blobs.BlobError`` (RuntimeError) joins the tree from the LangChain package.

A call that raises one of these before touching the cache leaves the session or thread exactly
as it was (same messages, same cache rows), so the next call answers as if the bad one never
happened. The capability errors are raised only where a caller forces a path (an executor, a
backend); kvmemory itself falls back to exact recomputation and reports why.
"""

from __future__ import annotations

SHIFT_FALLBACK = "kvmemory falls back to Replay (recomputing the retained suffix) instead of Shift"


class KVMemoryError(Exception):
    """Base of every error kvmemory raises deliberately."""


class InputError(KVMemoryError, ValueError):
    """A value passed to a public kvmemory call cannot be used (bad range, unknown name, wrong
    dtype, ...); the message names the accepted values."""


class InputTypeError(KVMemoryError, TypeError):
    """An argument of the wrong Python type; the message names the expected one."""


class MessageError(InputError):
    """A message cannot be used as given (missing role/content, unknown role, non-text content,
    duplicated id); the message names the fix."""


class UnknownMessageError(InputError, KeyError):
    """An edit names a message id the session does not hold (delete / replace / insert)."""

    def __str__(self) -> str:  # KeyError would print the repr of its argument
        return str(self.args[0])


class ContextOverflowError(InputError):
    """The prompt plus the requested answer does not fit in the model's context window."""


class ModelNotFoundError(KVMemoryError, FileNotFoundError):
    """The requested model (embedded or local folder) or its tokenizer cannot be found."""


class TemplateError(KVMemoryError, ValueError):
    """The chat template does not render message lists incrementally (prefix-stable)."""


class CacheStateError(KVMemoryError, ValueError):
    """A stored cache state cannot be restored onto this model (shapes, ids or format differ).
    Callers fall back to Re-prefill: the next ``prepare`` rebuilds the cache from the messages."""


class ShiftUnsupportedError(KVMemoryError, ValueError):
    """Cached keys of this model cannot be rotated exactly; the message names why and the fallback."""

    def __init__(self, reason: str):
        super().__init__(f"{reason}; {SHIFT_FALLBACK}")
        self.reason = reason


class PackedUnsupportedError(KVMemoryError, ValueError):
    """The packed executor cannot run this model or cache; the message says why."""


class TritonUnavailableError(KVMemoryError, RuntimeError):
    """The Triton backend cannot launch here; the message names the fix."""


class ThreadBusyError(KVMemoryError, TimeoutError):
    """Another call held the thread for longer than this call would wait
    (``ThreadCaches.lease(..., wait_s=...)``); nothing was changed: retry, or use another thread id."""


class AdapterUpdateError(KVMemoryError, RuntimeError):
    """An online LoRA step (``OnlineAdapter.update``) failed after it may have changed weights:
    they were rolled back, with the optimizer state, to ``version`` (the adapter digest before
    the update, None without adapters), so no cache sees half an update."""

    def __init__(self, message: str, version: str | None = None):
        super().__init__(message)
        self.version = version


class SelectionError(KVMemoryError, RuntimeError):
    """Internal error: an allocator broke its contract (a bug, please report it)."""


class UnitPartitionError(KVMemoryError, RuntimeError):
    """Internal error: the units do not partition the eligible positions (a bug, please report it)."""


class EngineUnsupportedError(InputError):
    """The fast engine cannot run this model (architecture, dtype, adapters, weights that are not
    its GGUF blocks, no compiler for its kernel); the message says which. ``engine="auto"`` then
    runs transformers' forward instead and reports the reason."""


def reject_unknown_names(what: str, given, known) -> None:
    """Raise for names in ``given`` outside ``known`` (the settings ``what`` accepts), suggesting
    the closest known name for each.

    Raises:
        InputError: naming each unknown name, its closest known one and every accepted name.
    """
    import difflib

    known = sorted(set(known))
    unknown = [k for k in given if k not in known]
    if unknown:
        hints = [f"{k!r}" + (f" (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(str(k), known, n=1)) else "")
                 for k in unknown]
        raise InputError(f"{what} does not know {', '.join(hints)}; accepted: {', '.join(known)}")
