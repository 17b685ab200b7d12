"""kvmemory: live KV caches for agents, repaired by budgeted Semantic-Unit Refresh after edits."""

from .errors import (
    CacheStateError, ContextOverflowError, InputError, InputTypeError, KVMemoryError, MessageError, ModelNotFoundError,
    PackedUnsupportedError, ShiftUnsupportedError, TemplateError, UnknownMessageError,
)
from .guard import FidelityGuard, GuardConfig
from .models import LoadedModel, load_model
from .policy import RepairPolicy, RepairReport
from .session import Generation, KVSession

__all__ = [
    "CacheStateError",
    "ContextOverflowError",
    "FidelityGuard",
    "Generation",
    "GuardConfig",
    "InputError",
    "InputTypeError",
    "KVMemoryError",
    "KVSession",
    "LoadedModel",
    "MessageError",
    "ModelNotFoundError",
    "PackedUnsupportedError",
    "RepairPolicy",
    "RepairReport",
    "ShiftUnsupportedError",
    "TemplateError",
    "UnknownMessageError",
    "load_model",
]
