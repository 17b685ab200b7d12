"""One thread's cache state detached from the model, and its export from / import into a
``KVSession`` (for checkpointers that persist it, e.g. as safetensors).

A state records which model computed its rows (name, dtype, base-weights digest) and the adapter
version of every layer, so an import can refuse rows of another model and CacheReforge can
recompute layers of another adapter version before the restored cache is used.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from . import kvcache
from .errors import CacheStateError
from .prompt import TemplateError, normalize_messages, render_prompt
from .reforge.versions import LayerAnchors, base_weights_digest
from .session import KVSession

log = logging.getLogger(__name__)

# /2 records the model dtype, a base-weights digest and the per-layer adapter versions; /1 states
# are still read, but never imported (their rows cannot be tied to a model or an adapter version)
STATE_FORMAT = "kvmemory.thread-state/2"
READABLE_FORMATS = ("kvmemory.thread-state/1", STATE_FORMAT)


@dataclass
class CacheState:
    """Everything one thread's live cache holds, detached from the model.

    Attributes:
        token_ids: the N cached token ids (prompt of ``messages`` + tokens generated since).
        messages: the messages the cache holds, as ``{"role", "content", "id", ...extra}``
            dicts (``id`` is the session's key, so anonymous messages keep matching).
        tools: the tool schemas the prompt was rendered with (JSON-able), or None.
        exact_rows: leading rows equal to a Re-prefill; later rows are stale (after Shift/SUR).
        layers: per layer ``(keys, values)``, each ``[1, kv_heads, N, head_dim]``.
        next_logits: fp32 ``[vocab]`` logits of the pending next token, or None when the last
            answer ended (a new ``prepare`` is due).
        model_name: free text naming the model the rows came from (checked on import).
        answer_committed: the last message is an answer held as a message (rendered without a
            generation prompt, see ``KVSession.commit_answer``).
        model_dtype: the model's parameter dtype (``"torch.float32"``), checked on import.
        weights_digest: digest of the model's base weights (``base_weights_digest``), checked
            on import ("" in format-1 states: not importable).
        adapter_versions: the adapter version that produced each cache layer and the pending
            logits (``ReforgeState.export_versions``: digests only, no θ); None in format-1
            states (not importable). Layers whose version differs from the live adapter's are
            recomputed by CacheReforge before the restored cache is used.
        stale_budget: budget b (%) the stale rows (after ``exact_rows``) were repaired under, so
            a restored cache does not spend a later request's allowance on them again (0: unknown).
    """

    token_ids: list[int]
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    exact_rows: int
    layers: list[tuple[torch.Tensor, torch.Tensor]]
    next_logits: torch.Tensor | None = None
    model_name: str = ""
    answer_committed: bool = False
    model_dtype: str = ""
    weights_digest: str = ""
    adapter_versions: dict[str, Any] | None = None
    stale_budget: float = 0.0

    @property
    def nbytes(self) -> int:
        """Bytes of K/V held (what a persisted copy of the rows costs)."""
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.layers)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Flat ``{name: tensor}`` for ``safetensors.torch.save_file``: ``layers.{i}.keys``,
        ``layers.{i}.values`` ``[1, kv_heads, N, head_dim]``, ``token_ids`` int64 ``[N]`` and
        ``next_logits`` ``[vocab]`` when pending. Tensors are made contiguous (not copied otherwise)."""
        out = {"token_ids": torch.tensor(self.token_ids, dtype=torch.long)}
        for i, (k, v) in enumerate(self.layers):
            out[f"layers.{i}.keys"] = k.contiguous()
            out[f"layers.{i}.values"] = v.contiguous()
        if self.next_logits is not None:
            out["next_logits"] = self.next_logits.contiguous()
        return out

    def metadata(self) -> dict[str, str]:
        """String metadata for a safetensors header (messages, tools, exact_rows, model identity,
        adapter versions, format)."""
        return {
            "format": STATE_FORMAT,
            "messages": json.dumps(self.messages, default=str),
            "tools": json.dumps(self.tools, default=str),
            "exact_rows": str(self.exact_rows),
            "model_name": self.model_name,
            "answer_committed": "1" if self.answer_committed else "0",
            "model_dtype": self.model_dtype,
            "weights_digest": self.weights_digest,
            "adapter_versions": json.dumps(self.adapter_versions),
            "stale_budget": repr(self.stale_budget),
        }

    @classmethod
    def from_parts(cls, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> "CacheState":
        """Inverse of :meth:`tensors` + :meth:`metadata` (also reads format-1 states, which then
        carry no model digest or adapter versions and are refused by :func:`import_state`).

        Raises:
            CacheStateError: unknown format, missing tensors, or inconsistent row counts.
        """
        if metadata.get("format") not in READABLE_FORMATS:
            raise CacheStateError(f"not a kvmemory thread state (format {metadata.get('format')!r}, "
                                  f"expected {STATE_FORMAT!r})")
        try:
            token_ids = tensors["token_ids"].tolist()
            n_layers = len([k for k in tensors if k.endswith(".keys")])
            layers = [(tensors[f"layers.{i}.keys"], tensors[f"layers.{i}.values"]) for i in range(n_layers)]
            state = cls(
                token_ids=token_ids,
                messages=json.loads(metadata["messages"]),
                tools=json.loads(metadata["tools"]),
                exact_rows=int(metadata["exact_rows"]),
                layers=layers,
                next_logits=tensors.get("next_logits"),
                model_name=metadata.get("model_name", ""),
                answer_committed=metadata.get("answer_committed") == "1",
                model_dtype=metadata.get("model_dtype", ""),
                weights_digest=metadata.get("weights_digest", ""),
                adapter_versions=json.loads(metadata.get("adapter_versions", "null")),
                stale_budget=float(metadata.get("stale_budget", "0")),
            )
        except (KeyError, ValueError, TypeError) as exc:
            raise CacheStateError(f"incomplete thread state ({exc!r}): re-prefill from the messages") from exc
        for k, v in state.layers:
            if k.shape[2] != len(token_ids) or v.shape[2] != len(token_ids):
                raise CacheStateError(f"a layer holds {k.shape[2]} rows for {len(token_ids)} token ids")
        return state


def export_state(session: KVSession, model_name: str = "") -> CacheState:
    """Detached copy of ``session``'s cache state (K/V cloned: later repairs never alter it).

    The state records the model's dtype, its base-weights digest (computed once per model
    object, see ``base_weights_digest``) and the adapter version of every cache layer.

    Raises:
        CacheStateError: the session holds no rows yet (nothing to export), its cache has
            sliding-window or quantized layers (capability gate: restored threads re-prefill), or
            its layers carry no adapter versions.
    """
    if not session.token_ids:
        raise CacheStateError("the session holds no cache rows yet: nothing to export")
    odd = sorted({type(layer).__name__ for layer in session.cache.layers if type(layer) is not DynamicLayer})
    if odd:  # capability gate: a sliding or quantized layer does not show every row in keys/values
        raise CacheStateError(f"the cache has {', '.join(odd)} layers, which a state cannot hold row for row: "
                              "the thread re-prefills from its messages after a restore (exact)")
    versions = session.reforge.export_versions()
    if versions is None:
        raise CacheStateError("the cache's layers carry no adapter versions: a restore could not tell which "
                              "adapter computed them; the thread re-prefills from its messages after a restore")
    held = [{"role": m.role, "content": m.content, "id": m.key, **m.extra} for m in session.messages]
    return CacheState(
        token_ids=list(session.token_ids),
        messages=held,
        tools=session.tools,
        exact_rows=session.exact_rows,
        layers=[(k.clone(), v.clone()) for k, v in kvcache.layer_tensors(session.cache)],
        next_logits=None if session.next_logits is None else session.next_logits.clone(),
        model_name=model_name,
        answer_committed=session.answer_committed,
        model_dtype=str(_model_dtype(session.model)),
        weights_digest=base_weights_digest(session.model),
        adapter_versions=versions,
        stale_budget=session.stale_budget,
    )


def import_state(session: KVSession, state: CacheState) -> None:
    """Load ``state`` into ``session`` (replacing what it held); the next ``prepare`` reuses it.

    The messages are re-rendered with the session's tokenizer and their tokenization must be
    the prefix of ``state.token_ids``, so a state can never claim rows for other text. The
    cache layers keep the adapter versions they were computed under: if the live adapter
    differs (e.g. new weights loaded under the same adapter name), the next ``prepare`` /
    ``generate`` recomputes the affected layers exactly first (CacheReforge, reported in
    ``session.reforge.last_report``).

    Raises:
        CacheStateError: layer count, K/V shapes or dtype differ from the model's cache layout;
            the state was computed by other base weights (weights digest) or another dtype; it
            records no adapter versions (format 1) or malformed ones; or the token ids are not
            the rendering of the stored messages. The session is unchanged then.
    """
    _check_layout(session, state)
    _check_identity(session, state)
    rendered = None
    if state.messages:
        try:
            messages = normalize_messages(state.messages)
            rendered = render_prompt(session.tokenizer, messages, tools=state.tools,
                                     generation_prompt=not state.answer_committed)
        except (TemplateError, ValueError) as exc:
            raise CacheStateError(f"stored messages do not render ({exc})") from exc
        if tuple(state.token_ids[: len(rendered)]) != rendered.token_ids:
            raise CacheStateError("stored token ids are not the tokenization of the stored messages "
                                  "(different tokenizer or chat template?): re-prefill from the messages")
    session.restore(state, rendered=rendered)
    stale = session.reforge.version_report().stale_layers
    if stale:
        log.info("kvmemory: the restored cache's layers %s were computed under another adapter version than the "
                 "live one: CacheReforge recomputes them before the cache is used", stale)


def _model_dtype(model) -> torch.dtype:
    return next(model.parameters()).dtype


def _check_identity(session: KVSession, state: CacheState) -> None:
    """The state must come from this model (dtype, base-weights digest) and say which adapter
    version computed each layer."""
    if not state.weights_digest or state.adapter_versions is None:
        raise CacheStateError("the state records no model weights digest or adapter versions (an older format): "
                              "its rows cannot be tied to this model; re-prefill from the messages")
    dtype = str(_model_dtype(session.model))
    if state.model_dtype != dtype:
        raise CacheStateError(f"state was computed in {state.model_dtype or 'an unknown dtype'}, the model runs in "
                              f"{dtype}: re-prefill from the messages")
    if state.weights_digest != base_weights_digest(session.model):
        raise CacheStateError("state was computed by a model with other base weights (weights digest differs): "
                              "re-prefill from the messages")
    try:
        LayerAnchors(session.reforge.num_layers).restore(state.adapter_versions)
    except ValueError as exc:
        raise CacheStateError(f"the state's adapter versions are unusable ({exc}): re-prefill from the messages") from exc


def _check_layout(session: KVSession, state: CacheState) -> None:
    expected = kvcache.new_cache(session.model.config)
    text = session.model.config.get_text_config()
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    dtype = _model_dtype(session.model)
    if len(state.layers) != len(expected.layers):
        raise CacheStateError(f"state has {len(state.layers)} layers, the model {len(expected.layers)}")
    for i, (k, v) in enumerate(state.layers):
        for name, t in (("keys", k), ("values", v)):
            if t.dim() != 4 or t.shape[0] != 1 or t.shape[1] != kv_heads or t.shape[3] != head_dim:
                raise CacheStateError(f"layer {i} {name} have shape {tuple(t.shape)}, expected "
                                      f"[1, {kv_heads}, N, {head_dim}]")
            if t.dtype != dtype:
                raise CacheStateError(f"layer {i} {name} are {t.dtype}, the model runs in {dtype}")
