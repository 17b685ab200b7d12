"""The systems ``kvmemory bench agent`` puts side by side, behind one small interface.

Each system answers a chat request (message dicts + the tools offered) with exactly ``n`` greedy
tokens: the stop tokens are masked, so that every system does the same decoding work whatever
its answer. ``start()`` forgets every cached state, so a trial's first call starts cold.

- :class:`KVMemorySystem`: a :class:`~kvmemory.session.KVSession` built from a configuration
  dict by :func:`build_session` (the seam where engine options are added);
- :class:`ReprefillSystem`: what ``ChatHuggingFace`` does: render, tokenize and
  ``model.generate`` from a fresh cache on every call (Re-prefill of the whole prompt);
- :class:`LlamaCppSystem`: llama-cpp-python on a GGUF with its default prefix reuse between
  calls on one ``Llama`` object (optional: the ``bench`` extra; written against its public API).

Times are milliseconds from the request (messages) to the last token; ``ttft_ms`` ends when the
first answer token is known (for kvmemory: when ``prepare`` returns the first-token logits).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from transformers.generation import BaseStreamer

from kvmemory.models import LoadedModel, embedded_gguf_path, load_model
from kvmemory.prompt import normalize_messages, render_text
from kvmemory.session import KVSession, stop_token_ids

# keys a kvmemory configuration may carry; engine options (quantized cache, compiled decode)
# join here, each turned into a KVSession argument by build_session
KVMEMORY_OPTIONS = ("engine", "policy", "dtype", "rows", "lookup")


@dataclass
class Call:
    """One timed request: ``n`` answer tokens after ``prefilled_tokens`` prompt tokens computed."""

    total_ms: float
    ttft_ms: float
    prefilled_tokens: int
    token_ids: list[int]
    text: str
    fallback: str | None = None  # kvmemory: why a repair became exact recomputation (RepairReport.fallback)

    @property
    def decode_tok_s(self) -> float | None:
        """Tokens per second after the first one (decode only; None for a 1-token answer)."""
        seconds = (self.total_ms - self.ttft_ms) / 1000.0
        return (len(self.token_ids) - 1) / seconds if len(self.token_ids) > 1 and seconds > 0 else None


@dataclass
class ModelPool:
    """The benchmarked model loaded once per dtype (``"fp32"`` / ``"bf16"``) and row engine
    (``load_model(engine=...)``: ``"auto"``, ``"q4_1"``, ``"transformers"``); ``model`` as for
    :func:`kvmemory.models.load_model` (None: the embedded SmolLM2-135M-Instruct)."""

    model: str | None = None
    loaded: dict[tuple[str, str], LoadedModel] = field(default_factory=dict)

    def get(self, dtype: str, engine: str = "auto") -> LoadedModel:
        if (dtype, engine) not in self.loaded:
            self.loaded[(dtype, engine)] = load_model(self.model, dtype, engine=engine)
        return self.loaded[(dtype, engine)]


def system_name(config: dict[str, Any]) -> str:
    """Display name of a system configuration, e.g. ``kvmemory sur@5 fp32``, ``transformers bf16``."""
    lookup = f" lookup {config['lookup']}" if config.get("lookup") is not None else ""
    if config["engine"] == "kvmemory":
        rows = f" {config['rows']}" if config.get("rows") else ""
        return f"kvmemory {config['policy']} {config['dtype']}{rows}{lookup}"
    if config["engine"] == "transformers":
        return f"transformers {config['dtype']}"
    return f"llama.cpp {gguf_label(Path(config['gguf']))}{lookup}"


def gguf_label(path: Path) -> str:
    """A GGUF file's quantization as its name ends (``smollm2.Q4_1.gguf`` -> ``Q4_1``,
    ``...-q4_k_m.gguf`` -> ``q4_k_m``), else its name."""
    found = re.search(r"[.-]((?:I?Q\d\w*)|F16|BF16|F32)$", path.stem, re.IGNORECASE)
    return found.group(1) if found else path.stem


def build_session(config: dict[str, Any], lm: LoadedModel, tools: list[dict] | None) -> KVSession:
    """A fresh KVSession for one kvmemory configuration.

    Args:
        config: ``{"engine": "kvmemory", "policy": label (e.g. "sur@5"), "dtype": "fp32" | "bf16",
            "rows": the engine computing rows ("q4_1" / "transformers", display only),
            "lookup": draft tokens per greedy forward (optional; default the session's)}``.
        lm: the model loaded in ``config["dtype"]`` with that engine. ``tools``: OpenAI-format tools the chat offers.

    Raises:
        ValueError: a key outside :data:`KVMEMORY_OPTIONS` (an engine option not wired here yet).
        InputError: a bad policy label (from KVSession).
    """
    unknown = sorted(set(config) - set(KVMEMORY_OPTIONS))
    if unknown:
        raise ValueError(f"unknown kvmemory option(s) {unknown}: supported {list(KVMEMORY_OPTIONS)}; "
                         "add a new engine option to build_session in lab/kvmemory_lab/bench/agent_systems.py")
    lookup = {} if config.get("lookup") is None else {"prompt_lookup": config["lookup"]}
    return KVSession(lm.model, lm.tokenizer, config["policy"], tools=tools, **lookup)


def _masked(logits: torch.Tensor, stops: list[int]) -> torch.Tensor:
    logits = logits.clone()
    logits[..., stops] = float("-inf")
    return logits


class KVMemorySystem:
    """kvmemory: one live KVSession per trial; new tokens prefilled, edits repaired by the policy."""

    def __init__(self, config: dict[str, Any], lm: LoadedModel, tools: list[dict] | None):
        self.config, self.lm, self.tools, self.name = config, lm, tools, system_name(config)
        self.stops = sorted(stop_token_ids(lm.model, lm.tokenizer))
        self.session = build_session(config, lm, tools)

    def start(self) -> None:
        self.session = build_session(self.config, self.lm, self.tools)

    def call(self, messages: Sequence[dict], n: int) -> Call:
        t0 = time.perf_counter()
        report = self.session.prepare(messages)
        ttft = time.perf_counter()
        ids = self._answer(n)
        end = time.perf_counter()
        return Call((end - t0) * 1e3, (ttft - t0) * 1e3, report.recomputed_tokens, ids,
                    self.lm.tokenizer.decode(ids, skip_special_tokens=True), report.fallback)

    def _answer(self, n: int) -> list[int]:
        """n greedy tokens with the stop tokens masked (through the session's public logits
        processor hook): n - 1 forwards, the last token picked from the pending logits, as
        ``generate`` and llama.cpp do."""
        ids = []
        if n > 1:
            ids = self.session.generate(n - 1, logits_processor=lambda _, scores: _masked(scores, self.stops)).token_ids
        return ids + [int(torch.argmax(_masked(self.session.next_logits, self.stops)))]


class _FirstTokenClock(BaseStreamer):
    """A transformers streamer that records when the first generated token arrives (``put`` gets
    the prompt first, then each new token)."""

    def __init__(self):
        self.puts: list[float] = []

    def put(self, value) -> None:
        self.puts.append(time.perf_counter())

    def end(self) -> None:
        """The streamer protocol's end of generation: nothing to record."""


class ReprefillSystem:
    """transformers Re-prefill: every call renders, tokenizes and runs ``model.generate``, which
    builds a fresh DynamicCache (the whole prompt is prefilled again, as ChatHuggingFace does)."""

    def __init__(self, config: dict[str, Any], lm: LoadedModel, tools: list[dict] | None):
        self.lm, self.tools, self.name = lm, tools, system_name(config)
        self.stops = sorted(stop_token_ids(lm.model, lm.tokenizer))

    def start(self) -> None:
        pass  # nothing is kept between calls

    def call(self, messages: Sequence[dict], n: int) -> Call:
        t0 = time.perf_counter()
        text = render_text(self.lm.tokenizer, normalize_messages(messages), tools=self.tools)
        inputs = self.lm.tokenizer(text, add_special_tokens=False, return_tensors="pt")
        clock = _FirstTokenClock()
        pad = self.lm.model.generation_config.pad_token_id
        out = self.lm.model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False, streamer=clock,
                                     eos_token_id=self.stops, pad_token_id=self.stops[0] if pad is None else pad)
        end = time.perf_counter()
        prompt = inputs["input_ids"].shape[1]
        ids = out[0, prompt:].tolist()
        return Call((end - t0) * 1e3, (clock.puts[1] - t0) * 1e3, prompt, ids,
                    self.lm.tokenizer.decode(ids, skip_special_tokens=True))


def peer_gguf(model) -> str | None:
    """The GGUF the llama.cpp peer runs for ``model`` (``resolve_model``'s answer): the file itself,
    the embedded model's packaged GGUF for None, nothing for a transformers folder."""
    if model is None:
        return str(embedded_gguf_path())
    return str(model) if str(model).endswith(".gguf") else None


def llama_cpp_missing() -> str | None:
    """Why the llama.cpp system cannot run here (None when ``import llama_cpp`` works)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        return (f"llama.cpp skipped: llama-cpp-python is not installed ({exc}); install the bench extra "
                "(pip install -e '.[bench]', compiles for ~15 min) to add it")
    return None


class _EvalCounter:
    """Wraps ``Llama.eval`` (public) to count the tokens llama.cpp actually computes."""

    def __init__(self, llm):
        self.inner, self.count = llm.eval, 0
        llm.eval = self

    def __call__(self, tokens):
        self.count += len(tokens)
        return self.inner(tokens)


class LlamaCppSystem:
    """llama-cpp-python on a GGUF: the same rendered prompt, tokenized by llama.cpp, then
    ``Llama.generate`` greedy (temp 0), which keeps the longest common token prefix of the previous
    call's KV cache and evaluates the rest. ``config["lookup"]``: llama-cpp-python's prompt lookup
    decoding (``LlamaPromptLookupDecoding``) with that many draft tokens. Not testable on this
    machine (no wheel; see the report).

    Raises:
        ImportError: ``lookup`` asked for and llama-cpp-python has no ``llama_speculative``.
    """

    def __init__(self, config: dict[str, Any], tokenizer, tools: list[dict] | None, n_ctx: int, threads: int):
        import llama_cpp

        draft = {}
        if config.get("lookup"):
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            # logits_all: llama-cpp-python sizes its score buffer for a whole context only when
            # asked (with a draft model it keeps every row's logits, but sizes by this argument)
            draft = {"draft_model": LlamaPromptLookupDecoding(num_pred_tokens=config["lookup"]), "logits_all": True}
        self.tokenizer, self.tools, self.name, self.gguf = tokenizer, tools, system_name(config), str(config["gguf"])
        self.llm = llama_cpp.Llama(model_path=str(config["gguf"]), n_ctx=n_ctx, n_threads=threads,
                                   n_threads_batch=threads, verbose=False, **draft)
        self.evals = _EvalCounter(self.llm)
        self.version = getattr(llama_cpp, "__version__", "unknown")

    def start(self) -> None:
        self.llm.reset()  # n_tokens = 0: the next call evaluates its whole prompt

    def call(self, messages: Sequence[dict], n: int) -> Call:
        t0 = time.perf_counter()
        text = render_text(self.tokenizer, normalize_messages(messages), tools=self.tools)
        prompt = self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        self.evals.count, ids, ttft, prefilled = 0, [], t0, 0
        tokens = self.llm.generate(prompt, temp=0.0, repeat_penalty=1.0)  # never stops by itself
        try:
            for token in tokens:
                if not ids:
                    ttft, prefilled = time.perf_counter(), self.evals.count
                ids.append(int(token))
                if len(ids) == n:
                    break
        finally:
            tokens.close()
        end = time.perf_counter()
        return Call((end - t0) * 1e3, (ttft - t0) * 1e3, prefilled, ids,
                    self.llm.detokenize(ids).decode("utf-8", errors="replace"))
