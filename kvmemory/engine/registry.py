"""Which engine computes a model's rows: the engine attached to a loaded model (every session on
it shares it), what it reports, and the verb every caller appends rows with."""

from __future__ import annotations

import logging
import weakref
from pathlib import Path

import torch

from ..errors import EngineUnsupportedError, InputError
from . import graphs
from .build import build
from .cores import share_cores
from .interface import Engine, EngineStatus
from .llama import QuantizedLlama
from .quantized import cpu_isas, kernel_isa
from .reference import TransformersEngine

log = logging.getLogger(__name__)

ENGINES = ("auto", "q4_1", "q4_1_int8", "q4_1_bf16", "q4_1_int8_bf16", "cuda_graphs", "transformers")
BLOCK_ENGINES = ("q4_1", "q4_1_int8", "q4_1_bf16", "q4_1_int8_bf16")  # the engines on the GGUF blocks (asked for by name: failures raise)

_attached: "weakref.WeakKeyDictionary[torch.nn.Module, QuantizedLlama | graphs.GraphDecoder]" = weakref.WeakKeyDictionary()
_refused: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()


def attach(model, gguf: str | Path | None, engine: str = "auto") -> EngineStatus:
    """Run ``model``'s row computations on the quantized engine built from ``gguf`` (or, with
    ``engine="cuda_graphs"``, on captured CUDA graphs; ``gguf`` is then not read).

    Args:
        model: a transformers Llama or Qwen2 causal LM in fp32 on CPU whose linear and head
            weights are the dequantized blocks of ``gguf`` (Q4_0 / Q4_1 / Q4_K / Q5_0 / Q6_K /
            Q8_0; the embedded SmolLM2 and models loaded from a GGUF file are). Checked weight by
            weight (~1 s for 135 M parameters).
        engine: ``"auto"`` (use ``"q4_1"`` when possible and the kernel has SIMD paths for
            this CPU, AVX2 or AVX-512; else transformers, with the reason in :func:`status`), ``"q4_1"`` (raise when it cannot run), ``"q4_1_int8"`` (the same
            with int8 activations on the block path; raise when it cannot run, e.g. no AVX-512
            VNNI), ``"q4_1_bf16"`` (bf16 linears for long inputs), ``"q4_1_int8_bf16"`` (both),
            ``"cuda_graphs"`` (a model on CUDA; raise when it cannot run), ``"transformers"`` (detach).

    Returns:
        EngineStatus of the model after the call.

    Raises:
        InputError: unknown ``engine``.
        EngineUnsupportedError: an engine asked for by name (``"q4_1"``, ``"q4_1_int8"``,
            ``"cuda_graphs"``, ...) cannot run this model / file / machine; the model keeps the
            engine it had.
    """
    if engine not in ENGINES:
        raise InputError(f"engine must be one of {', '.join(ENGINES)} (got {engine!r})")
    held = _attached.get(model)
    if isinstance(held, QuantizedLlama):  # what replaces it needs the dense weights (to verify, or to run on)
        held.restore_dense(f"engine {engine!r} replaces the block engine")
    if engine == "transformers":
        _attached.pop(model, None)
        _refused.pop(model, None)
        return status(model)
    if engine == "cuda_graphs":
        reason = graphs.unsupported_reason(model)
        if reason:  # the engine the model has stays
            raise EngineUnsupportedError(f"engine 'cuda_graphs': {reason} (the model keeps engine {status(model).name!r})")
        built = graphs.GraphDecoder(model)
    else:
        try:
            if engine == "auto":
                _check_auto_pays()
            built = build(model, Path(gguf), int8_activations="int8" in engine, bf16_prefill=engine.endswith("bf16"))
        except EngineUnsupportedError as exc:
            if engine in BLOCK_ENGINES:  # asked for by name: raise, the engine the model has stays
                raise
            _attached.pop(model, None)
            _refused[model] = str(exc)
            log.info("kvmemory: the quantized engine does not run this model: %s", exc)
            return status(model)
    _attached[model] = built
    _refused.pop(model, None)
    return status(model)


def release_dense(model) -> int:
    """Drop ``model``'s dense linear weights while the block engine serves it (its blocks hold
    them exactly; see :mod:`.dense`): the 1.5 B Qwen drops 5.75 GiB to run beside its 1.28 GiB of
    blocks. Returns the bytes freed (0: no block engine, or already released)."""
    engine = _attached.get(model)
    return engine.release_dense() if isinstance(engine, QuantizedLlama) else 0


def restore_dense(model) -> None:
    """Bring back the dense weights :func:`release_dense` dropped (before editing them in place)."""
    engine = _attached.get(model)
    if isinstance(engine, QuantizedLlama):
        engine.restore_dense("restore_dense was called")


def status(model) -> EngineStatus:
    """The engine that computes ``model``'s rows now (see :class:`EngineStatus`)."""
    engine = _attached.get(model)
    if engine is None:
        return EngineStatus("transformers", _refused.get(model))
    reason = engine.unsupported_reason()
    return EngineStatus("transformers", reason) if reason else EngineStatus(engine.kind, isa=getattr(engine, "isa", None))


def _check_auto_pays() -> None:
    """``"auto"`` is never the slower choice: the block engine only where its kernel has SIMD
    paths (AVX2 or AVX-512). Without them (the ``portable`` build: no AVX2, or a CPU kvmemory has
    no SIMD kernel for yet, such as ARM) one decoded token of SmolLM2 took 81 ms against
    transformers' 61 ms on one thread (benchmarks/results/engine_isa).

    Raises:
        EngineUnsupportedError: the reason (``"q4_1"`` asked for by name still runs there).
    """
    isa = kernel_isa()  # KernelUnavailableError (an EngineUnsupportedError) for a bad KVMEMORY_ISA
    if isa == "portable":
        raise EngineUnsupportedError(
            f"the engine's kernel has no SIMD path for this CPU (it runs {', '.join(cpu_isas())}), where "
            "transformers' forward is faster on one thread; engine='q4_1' runs it anyway")


def engine_for(model, cache) -> Engine:
    """The engine that computes rows of ``cache`` for ``model``: the attached one when it can
    (:meth:`Engine.unsupported_reason` is None for this cache), else the model's own forward
    (:class:`~kvmemory.engine.reference.TransformersEngine`)."""
    engine = _attached.get(model)
    if engine is None or engine.unsupported_reason(cache):
        return TransformersEngine(model)
    return engine


def forward_rows(
    model, cache, token_ids: torch.Tensor, start: int, *, capacity: int | None = None, every_row: bool = False,
) -> torch.Tensor:
    """Forward ``token_ids`` (LongTensor ``[n]``) at positions ``[start, start+n)`` against
    ``cache``, which must hold exactly ``start`` rows; appends n rows to it.

    Runs on the model's attached engine when it can compute these rows (a plain cache, no
    adapter, unmodified weights), else on the model's own forward (:func:`engine_for`).
    ``capacity``: rows the cache is expected to reach (prompt + answer limit); the engine then
    allocates them at once instead of growing row by row.

    Returns:
        fp32 logits ``[vocab]`` for the token after the last input position, or with
        ``every_row`` ``[n, vocab]`` (row i: the token after input i; checking a draft).
    Runs with this call's share of the cores (:mod:`kvmemory.engine.cores`).
    """
    with share_cores():
        return engine_for(model, cache).forward_rows(cache, token_ids, start, capacity, every_row=every_row)
