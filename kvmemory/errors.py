"""kvmemory's error types: one small hierarchy, so callers can catch everything kvmemory raises
on purpose (``except KVMemoryError``) or the standard base they already expect (ValueError,
TypeError, KeyError, FileNotFoundError). Every message names the fix.

A call that raises one of these before touching the cache leaves the session or thread exactly
as it was (same messages, same cache rows), so the next call answers as if the bad one never
happened.
"""

from __future__ import annotations


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


class EngineUnsupportedError(InputError):
    """The fast engine cannot run this model (architecture, dtype, adapters, weights that are not
    its GGUF blocks, no compiler for its kernel); the message says which. ``engine="auto"`` then
    runs transformers' forward instead and reports the reason."""
