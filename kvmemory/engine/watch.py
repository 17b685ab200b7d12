"""Whether a model's weights are still the ones an engine was built from.

An engine keeps what it derived from the weights (GGUF blocks, a captured CUDA graph holding the
weights' addresses). Training, ``load_state_dict`` or an adapter wrapping a module would leave it
computing with stale weights, so every engine call first compares (~0.1 ms for SmolLM2) each
module with parameters and each parameter with what was seen when the engine was built.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WeightWatch:
    """``modules``: ``(parent's module dict, name, module)`` for every module with parameters;
    ``params``: ``(module's parameter dict, name, parameter, version)`` for each of their
    parameters (flat lists: the check runs before every decoded token)."""

    modules: list
    params: list

    @classmethod
    def of(cls, model) -> "WeightWatch":
        modules, params = [], []
        for parent in model.modules():
            for name, module in parent._modules.items():
                if module is not None and module._parameters:
                    modules.append((parent._modules, name, module))
                    params += [(module._parameters, a, p, p._version) for a, p in module._parameters.items() if p is not None]
        return cls(modules, params)

    def stale_reason(self) -> str | None:
        """Why the weights may no longer be the watched ones (None: they are): a module was
        replaced (an adapter or a patch wraps it), or a parameter was replaced or written in
        place (its version counter moved)."""
        if not all(parent.get(name) is module for parent, name, module in self.modules):
            name = next(name for parent, name, module in self.modules if parent.get(name) is not module)
            return f"module {name!r} was replaced (an adapter or a patch wraps it)"
        if not all(held.get(attr) is param and param._version == version for held, attr, param, version in self.params):
            return "a model weight was modified in place after the engine was built"
        return None


def has_lora(model) -> bool:
    """Whether a (PEFT) LoRA adapter wraps any of ``model``'s modules."""
    return any(hasattr(m, "lora_A") for m in model.modules())
