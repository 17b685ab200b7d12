"""kvmemory: live KV caches for agents, repaired by budgeted Semantic-Unit Refresh after edits."""

from .guard import FidelityGuard, GuardConfig
from .errors import InputError, InputTypeError, KVMemoryError
from .models import LoadedModel, ModelNotFoundError, load_model
from .policy import RepairPolicy, RepairReport
from .prompt import MessageError, TemplateError
from .session import ContextOverflowError, Generation, KVSession, UnknownMessageError

__all__ = [
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
    "RepairPolicy",
    "RepairReport",
    "TemplateError",
    "UnknownMessageError",
    "load_model",
]
