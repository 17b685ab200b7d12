"""Dense weights on demand: a model's linear weights released while the block engine serves it.

A model loaded from a GGUF file holds every linear twice: the dense fp32 weight transformers
computes with and the engine's blocks (Qwen2.5-Coder-1.5B: 6.6 GiB dense beside 1.3 GiB of
blocks). Each dense weight is the dequantization of blocks the engine holds (checked bit for bit
when the engine is built), so :meth:`DenseWeights.release` drops the dense copies and whatever
needs one gets it back, exactly:

- the engine's long inputs (prefill, a long append or refresh) dequantize each linear for the
  call into a per-thread scratch buffer (:meth:`DenseWeights.of`);
- transformers' forward (the reference engine, the guard's teacher-forced check, adapters): a
  released linear's weight is dequantized just before its module runs and dropped after it;
  under autograd (training) it stays until :meth:`DenseWeights.restore`, since backward needs it;
- ``state_dict`` / ``save_pretrained``: the dict holds each released weight dequantized (the
  module keeps none);
- ``load_state_dict`` restores them first (it writes into the weights);
- reading ``module.weight`` directly sees an empty tensor, and a write into it raises at the
  next use: ``kvmemory.engine.restore_dense(model)`` first (or ``load_model(keep_dense=True)``).

The embedding table stays (token lookups and embedding-scored allocators read it), and so does a
head tied to it.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass
class _Source:
    """Where a linear's weight lives in the engine's blocks: output rows ``[begin, end)`` of
    ``part`` (a :class:`~kvmemory.engine.quantized.Q4Linear` / ``Q8Linear``)."""

    part: object
    begin: int
    end: int


def sources(fused, modules: list) -> dict:
    """``{module: _Source}`` for ``modules`` (``nn.Linear`` s) whose output rows are ``fused``'s
    (a :class:`~kvmemory.engine.quantized.FusedBlocks`) in order."""
    spans, offset = [], 0
    for part in fused.parts:
        spans.append((offset, offset + part.shape[0], part))
        offset += part.shape[0]
    found, row = {}, 0
    for module in modules:
        rows = module.out_features
        part_begin, _, part = next(s for s in spans if s[0] <= row < s[1])
        found[module] = _Source(part, row - part_begin, row - part_begin + rows)
        row += rows
    return found


class DenseWeights:
    """The released dense weights of one model (see the module docstring). Thread-safe.

    ``lib``: the kernel module whose ``dequantize_rows`` rebuilds a weight; ``modules``:
    ``{nn.Linear: _Source}`` (:func:`sources`). ``released_bytes``: bytes dropped (0 before
    :meth:`release` and after :meth:`restore`)."""

    def __init__(self, lib, modules: dict):
        self.lib = lib
        self._sources = modules
        self._lock = threading.Lock()
        self._versions: dict = {}  # module -> its weight's version when released (writes to it are lost)
        self._local = threading.local()  # per-thread scratch buffers (of(..., scratch=True))
        self._in_use: dict = {}  # module -> forwards running with its weight materialized
        self._hooks: list = []
        self._kept = False  # autograd needed a weight: keep what is materialized
        self.released_bytes = 0

    @property
    def modules(self) -> list:
        """The linears whose weights this object releases."""
        return list(self._sources)

    @property
    def released(self) -> bool:
        return self.released_bytes > 0

    def release(self) -> int:
        """Drop every source module's dense weight (``weight.data`` becomes an empty tensor; the
        parameter object, its version and the module stay, so the engine's weight watch does not
        fire) and hook the modules so that transformers' forward still runs. Returns bytes freed."""
        with self._lock:
            if self.released:
                return 0
            for module in self._sources:
                weight = module.weight
                self.released_bytes += weight.numel() * weight.element_size()
                weight.data = torch.empty(0, dtype=weight.dtype)
                weight._kvmemory_dense = (self, module)  # parameter_value finds its value
                self._versions[module] = weight._version
            self._kept = False
            for module in self._sources if not self._hooks else ():  # hooked once; idle while nothing is released
                self._hooks.append(module.register_forward_pre_hook(self._before_forward))
                self._hooks.append(module.register_forward_hook(self._after_forward, always_call=True))
                # (a function, not the bound method: torch marks the hook with an attribute)
                self._hooks.append(module.register_state_dict_post_hook(lambda *args: self._state_dict_entry(*args)))
                self._hooks.append(module.register_load_state_dict_pre_hook(self._before_load))
        log.info("kvmemory: released %.2f GiB of dense weights (the engine's blocks hold them)", self.released_bytes / 2**30)
        return self.released_bytes

    def of(self, module, scratch: bool = False) -> torch.Tensor:
        """``module``'s fp32 weight ``[out, in]``: its own when held, else dequantized from the
        blocks for this call (equal bit for bit). ``scratch``: write it into this thread's
        scratch buffer (no page faults; valid until this thread's next ``of(..., scratch=True)``:
        use it at once)."""
        with self._lock:  # a detached tensor keeps the storage if another thread drops it later
            held = module.weight.detach() if module not in self._sources or module.weight.numel() > 0 else None
        size = module.in_features * module.out_features
        return held if held is not None else self._dequantized(module, self._scratch(size) if scratch else None)

    def _scratch(self, size: int) -> torch.Tensor:
        """This thread's buffer of at least ``size`` values (grown on demand)."""
        buffer = getattr(self._local, "buffer", None)
        if buffer is None or buffer.numel() < size:
            buffer = self._local.buffer = torch.empty(size)
        return buffer

    def restore(self, reason: str) -> None:
        """Bring every released weight back for good (logged with ``reason``; the hooks stay, idle)."""
        with self._lock:
            if not self.released:
                return
            for module in self._sources:
                if module.weight.numel() == 0:
                    module.weight.data = self._dequantized(module)
            self._in_use.clear()
            self._versions.clear()
            freed, self.released_bytes = self.released_bytes, 0
        log.warning("kvmemory: %s: restored %.2f GiB of dense weights", reason, freed / 2**30)

    def _dequantized(self, module, out: torch.Tensor | None = None) -> torch.Tensor:
        if module.weight._version != self._versions.get(module, module.weight._version):
            raise RuntimeError(
                "a released dense weight was written in place (the write went to an empty tensor and is lost): "
                "load the model with load_model(..., keep_dense=True), or call "
                "kvmemory.engine.restore_dense(model) before editing its weights")
        source = self._sources[module]
        part = source.part
        return self.lib.dequantize_rows(part.codes, part.scales, part.mins, source.begin, source.end,
                                        torch.empty(0) if out is None else out)

    def _before_forward(self, module, args) -> None:
        with self._lock:
            if not self.released:
                return
            count = self._in_use.get(module, 0)
            if count == 0 and module.weight.numel() == 0:
                module.weight.data = self._dequantized(module)
            self._in_use[module] = count + 1
            self._kept = self._kept or torch.is_grad_enabled()

    def _after_forward(self, module, args, output) -> None:
        with self._lock:
            if not self.released or module not in self._in_use:
                return
            self._in_use[module] -= 1
            if self._in_use[module] == 0:
                del self._in_use[module]
                if not self._kept:  # nothing saved it for a backward pass
                    module.weight.data = torch.empty(0, dtype=module.weight.dtype)

    def _before_load(self, *args) -> None:
        # restore() runs once per load (its lock is free here: hooks run outside it)
        self.restore("load_state_dict writes the weights")

    def _state_dict_entry(self, module, state_dict, prefix, local_metadata) -> None:
        key = prefix + "weight"
        if key in state_dict and state_dict[key].numel() == 0:
            state_dict[key] = self.of(module)


def parameter_value(param: torch.Tensor) -> torch.Tensor:
    """``param``'s value, detached: a released dense weight dequantized (bit for bit), anything
    else as it is (digests and copies of a model's weights read them through this)."""
    owner = getattr(param, "_kvmemory_dense", None)
    return param.detach() if owner is None else owner[0].of(owner[1])
