"""Repair policies (which operator, which budget) and the report every repair returns."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError, field_validator, model_validator

from .errors import InputError, InputTypeError, reject_unknown_names
from .selection import KNOWN_ALLOCATORS

Operator = Literal["refresh", "shift", "replay", "reprefill", "dirty"]
Executor = Literal["auto", "packed", "sequential", "direct"]
Backend = Literal["sdpa", "triton"]
Erase = Literal["none", "strict"]
Scope = Literal["edits", "always"]
Signal = Literal["query_kl", "kv_change"]
Relevance = Literal["paper", "idf"]
Ties = Literal["earliest", "latest"]


class Settings(BaseModel):
    """Frozen settings whose unknown fields are refused naming the closest known one (a typo such
    as ``bugdet=50`` says ``did you mean 'budget'?``, not just "extra input")."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data):
        if isinstance(data, dict):
            reject_unknown_names(cls.__name__, data, cls.model_fields)
        return data


class RepairPolicy(Settings):
    """How to repair a cache after a history edit (paper §7.1).

    - ``refresh``: Shift, then recompute B = min(S, ceil(S·b/100)) stale suffix positions chosen
      by ``allocator`` (eq. 3). b = 0 is Shift, b = 100 is Replay.
    - ``shift``: delete rows, rotate suffix keys; no recomputation (refresh at b = 0).
    - ``replay``: keep the valid prefix, recompute the whole suffix (refresh at b = 100).
    - ``reprefill``: rebuild the whole prompt from an empty cache.
    - ``dirty``: reference only: ignore deletions/replacements and answer from the unedited cache.

    An operator names what happens on an edit. A request that only appends to the cache (or is
    identical to it) prefills just its new tokens under every operator, and stale rows an
    earlier repair left (after ``KVSession.exact_rows``) are kept as they are unless the policy
    asks for more than they got: a higher budget, or Replay / Re-prefill, which make every row
    exact. ``scope="always"`` (label ``reprefill:always``, ``reprefill`` only) re-prefills the
    whole prompt on every call: the baseline benchmarks time.

    ``executor`` picks how a sparse refresh is computed (Appendix 13): ``auto`` (default) uses
    the direct sequential executor for one interval and the packed executor for several;
    ``packed``, ``sequential`` (prefix copies, the paper's reference) and ``direct`` force one.
    ``backend`` is the packed executor's attention: ``sdpa`` (default) or ``triton`` (GPU, or
    ``TRITON_INTERPRET=1``). Labels (``sur@5``) keep the defaults for both.

    ``erase="strict"``: when an edit deletes or replaces a message, every row that could depend
    on the removed text is recomputed (Replay from the edit point, whatever the operator) and
    the old rows are overwritten in memory; ``"none"`` (default) repairs under the operator.

    Adaptive budget (our extension; the paper's fixed b stays the default and the reference):
    ``budget="auto"`` refreshes in rounds in the allocator's priority order, at allowances of
    ``start``, 2·start, 4·start, ... % of the stale suffix up to ``max_budget`` %, and stops after
    the first round whose convergence ``signal`` falls below ``tolerance``:

    - ``kv_change`` (default): the relative L2 change of the K/V rows the round refreshed against
      their Shifted values (no extra rows);
    - ``query_kl``: KL(p_k ‖ p_{k-1}) in nats between the next-token distributions of
      consecutive rounds, the query (last turn) recomputed after every round (round 0: Shift).

    The defaults (``kv_change``, tolerance 0.06, start 2 %, cap 32 %, Replay at the cap) were
    chosen on held-apart tuning cases (benchmarks/results/fidelity/README.md).

    ``on_cap``: what happens when the signal has not settled by ``max_budget``: ``replay``
    (default: the suffix is replayed exactly, reported as ``fallback``) or ``keep`` (the capped
    refresh is kept). The report's ``adaptive`` entry lists every round and says what stopped it
    (``signal``, ``cap`` or ``exhausted``); ``budget`` in the report is the budget actually spent
    (refreshed / S, in %; 100 after a Replay).
    Label: ``sur@auto:<signal>:<tolerance>`` (e.g. ``sur@auto:kv_change:0.06``).

    Decode-time Replay (our extension, off by default): with ``replay_margin`` > 0, a greedy
    answer decoded while the cache still holds rows a sparse repair left stale watches the
    top-1/top-2 logit margin (nats) of every pick; at the first pick whose margin is below
    ``replay_margin``, the stale suffix and the answer so far are replayed exactly and the pick
    is made again from exact logits. When it fires at or before the pick where the answer would
    split from Re-prefill's, the answer is Re-prefill's; a split at a confident pick is missed
    (measured in benchmarks/results/fidelity/README.md). Reported as ``decode_replay`` and
    ``fallback``. Label suffix ``:margin=<nats>``, e.g. ``shift:margin=0.03``.

    Selection options of the text allocators (sur, dense, window; our extension, defaults are the
    paper's): ``relevance="idf"`` weights each query token and the identical-token bonus of eq. 1
    by the token's inverse frequency over the prompt's semantic units, so tokens found in most
    units (" the", ",") stop giving most units the maximal score; ``ties="latest"`` breaks unit
    score ties towards the query instead of the earliest unit; ``tail_tokens`` > 0 refreshes the
    last ``tail_tokens`` stale rows before the query first (the turn the answer follows), inside
    the allowance.

    Two-dimensional budget (our extension, off by default): with ``lower_layers`` = d > 0, every
    stale suffix row is recomputed in the model's first d layers (those layers become exact), and
    the allowance B chosen by the allocator in every layer. Its compute, in whole-model tokens, is
    B + (S - B) · d / L for a model of L layers (``recomputed_tokens`` reports it). It needs the
    packed executor; where that cannot run, the suffix is replayed (reported). Label option
    ``+lower<d>``, e.g. ``sur+lower2@5``.

    Raises:
        pydantic.ValidationError (a ValueError): budget outside [0, 100], unknown allocator,
            executor or backend.
    """


    operator: Operator = "refresh"
    # strict: "5" or True are mistakes, not 5.0 / 1.0
    budget: Annotated[float, Strict()] | Literal["auto"] = 5.0
    allocator: str = "sur"
    seed: int = 0
    executor: Executor = "auto"
    backend: Backend = "sdpa"
    erase: Erase = "none"
    scope: Scope = "edits"
    tolerance: float = Field(0.06, ge=0.0, strict=True)
    max_budget: float = Field(32.0, gt=0.0, le=100.0, strict=True)
    start: float = Field(2.0, gt=0.0, le=100.0, strict=True)
    signal: Signal = "kv_change"
    on_cap: Literal["replay", "keep"] = "replay"
    relevance: Relevance = "paper"
    ties: Ties = "earliest"
    tail_tokens: int = Field(0, ge=0, strict=True)
    lower_layers: int = Field(0, ge=0, strict=True)
    replay_margin: float = Field(0.0, ge=0.0, strict=True)

    @field_validator("budget")
    @classmethod
    def _budget_in_range(cls, value: float | str) -> float | str:
        if value == "auto":
            return value
        if not math.isfinite(value) or not 0 <= value <= 100:
            raise ValueError(
                f"budget is a percentage of the stale suffix and must lie in [0, 100] (got {value}); "
                "e.g. budget=5 recomputes 5 % of it, 0 is Shift, 100 is Replay"
            )
        return float(value)

    @field_validator("allocator")
    @classmethod
    def _known_allocator(cls, value: str) -> str:
        if value not in KNOWN_ALLOCATORS:
            raise ValueError(f"unknown allocator {value!r}: use one of {', '.join(sorted(KNOWN_ALLOCATORS))}")
        return value

    @model_validator(mode="after")
    def _scope_only_for_reprefill(self) -> "RepairPolicy":
        if self.budget == "auto" and self.start > self.max_budget:
            raise ValueError(f"start ({self.start} %) must not exceed max_budget ({self.max_budget} %) for budget='auto'")
        if self.lower_layers and not (self.operator == "refresh" and self.budget != "auto"):
            raise ValueError(
                f"lower_layers (a two-dimensional budget) needs a fixed-budget refresh such as 'sur+lower2@5' (got "
                f"operator={self.operator!r}, budget={self.budget!r})"
            )
        if self.scope == "always" and self.operator != "reprefill":
            raise ValueError(
                f"scope='always' forces a full Re-prefill on every call and needs operator='reprefill' (got "
                f"{self.operator!r}): use RepairPolicy(operator='reprefill', scope='always') or the label "
                "'reprefill:always'"
            )
        return self

    @classmethod
    def coerce(cls, policy: "RepairPolicy | str") -> "RepairPolicy":
        """Accept a policy or its label: ``dirty``, ``shift``, ``replay``, ``reprefill``,
        ``reprefill:always``, ``<allocator>@<budget>`` (e.g. ``sur@5``, ``bm25@2``) or
        ``<allocator>@auto[:<signal>][:<tolerance>]`` (adaptive budget, e.g. ``sur@auto``,
        ``sur@auto:0.1``, ``sur@auto:query_kl:0.0001``). Selection options follow the allocator: ``+idf``
        (relevance="idf"), ``+latest`` (ties="latest"), ``+tail<N>`` (tail_tokens=N), ``+lower<d>``
        (lower_layers=d), e.g. ``sur+idf+tail32@5``. Decode-time Replay follows the whole label: ``:margin=<nats>``
        (replay_margin), e.g. ``shift:margin=0.03``, ``sur@5:margin=0.1``.

        Raises:
            InputTypeError (TypeError): neither a RepairPolicy nor a str.
            InputError (ValueError): an unknown label, budget (outside [0, 100], NaN) or allocator.
        """
        if isinstance(policy, cls):
            return policy
        if not isinstance(policy, str):
            raise InputTypeError(f"policy must be a RepairPolicy or a label like 'sur@5', got {type(policy).__name__}")
        base, marked, margin = policy.partition(":margin=")
        if marked:
            try:
                return cls.coerce(base).model_copy(update={"replay_margin": cls._margin(margin)})
            except ValueError as exc:
                raise InputError(f"bad policy label {policy!r} ({exc}): the suffix is :margin=<nats>, "
                                 "e.g. shift:margin=0.03") from exc
        if policy in ("dirty", "shift", "replay", "reprefill", "refresh"):
            return cls(operator=policy)
        if policy == "reprefill:always":
            return cls(operator="reprefill", scope="always")
        allocator, at, budget = policy.partition("@")
        try:
            name, *suffixes = allocator.split("+")
            fields = {"operator": "refresh", "allocator": name, **_option_fields(suffixes)}
            if at and budget.startswith("auto"):
                fields.update(budget="auto", **_auto_fields(budget))
            elif at:
                fields["budget"] = float(budget)
            return cls(**fields)
        except ValueError as exc:
            detail = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else str(exc)
            raise InputError(
                f"bad policy label {policy!r} ({detail}): use dirty, shift, replay, reprefill, reprefill:always "
                "or <allocator>@<budget> such as sur@5"
            ) from exc

    @staticmethod
    def _margin(text: str) -> float:
        value = float(text)
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"the margin is a logit gap in nats >= 0, got {text}")
        return value

    @property
    def adaptive(self) -> bool:
        """Whether the budget adapts per repair (``budget="auto"``, refresh only)."""
        return self.operator == "refresh" and self.budget == "auto"

    @property
    def effective_budget(self) -> float:
        """Budget in % that the refresh path uses (shift → 0, replay → 100; ``auto`` → its cap
        ``max_budget``, the most it may spend)."""
        if self.budget == "auto":
            return {"shift": 0.0, "replay": 100.0}.get(self.operator, self.max_budget)
        return {"shift": 0.0, "replay": 100.0}.get(self.operator, self.budget)

    @property
    def forces_reprefill(self) -> bool:
        """Whether every call re-prefills the whole prompt (``scope="always"``), edit or not."""
        return self.scope == "always"

    @property
    def needs_exact(self) -> bool:
        """Whether this policy leaves every row exact after a repair (Replay, Re-prefill, b = 100)."""
        return self.operator in ("replay", "reprefill") or (
            self.operator in ("refresh", "shift") and self.effective_budget >= 100.0)

    @property
    def label(self) -> str:
        """Short name: ``dirty``, ``shift``, ``sur@5``, ``bm25@2``, ``replay``, ``reprefill``,
        ``reprefill:always``; ``:margin=<nats>`` follows when decode-time Replay is on."""
        base = self._base_label()
        return f"{base}:margin={self.replay_margin:g}" if self.replay_margin > 0 else base

    def _base_label(self) -> str:
        if self.forces_reprefill:
            return "reprefill:always"
        if self.operator != "refresh":
            return self.operator
        name = self.allocator + "".join(
            f"+{part}" for part, on in (("idf", self.relevance == "idf"), ("latest", self.ties == "latest"),
                                        (f"tail{self.tail_tokens}", self.tail_tokens > 0),
                                        (f"lower{self.lower_layers}", self.lower_layers > 0)) if on)
        if self.budget == "auto":
            return f"{name}@auto:{self.signal}:{self.tolerance:g}"
        return f"{name}@{self.budget:g}"


def _option_fields(suffixes: list[str]) -> dict:
    """``["idf", "latest", "tail32", "lower2"]`` -> RepairPolicy fields; ValueError names unknown ones."""
    fields: dict = {}
    for part in suffixes:
        if part == "idf":
            fields["relevance"] = "idf"
        elif part == "latest":
            fields["ties"] = "latest"
        elif part.startswith("tail") and part[4:].isdigit():
            fields["tail_tokens"] = int(part[4:])
        elif part.startswith("lower") and part[5:].isdigit():
            fields["lower_layers"] = int(part[5:])
        else:
            raise ValueError(f"unknown selection option +{part} (use +idf, +latest, +tail<N> or +lower<d>)")
    return fields


def _auto_fields(budget: str) -> dict:
    """``auto``, ``auto:0.001``, ``auto:kv_change:0.05`` -> signal / tolerance fields."""
    head, *parts = budget.split(":")
    if head != "auto":
        raise ValueError(f"bad adaptive budget {budget!r}: use auto, auto:<tolerance> or auto:<signal>:<tolerance>")
    if parts and parts[0] in ("query_kl", "kv_change"):
        fields = {"signal": parts.pop(0)}
    else:
        fields = {}
    if len(parts) > 1 or parts[0:1] == [""]:
        raise ValueError(f"bad adaptive budget {budget!r}")
    if parts:
        fields["tolerance"] = float(parts[0])
    return fields


@dataclass
class RepairReport:
    """What one ``prepare`` call did to the cache.

    Token counts are tokens; times are milliseconds. ``recomputed_tokens`` counts every position
    forwarded through the model (new text + refreshed stale rows); ``refreshed_tokens`` is the
    allowance B spent on stale rows; ``reused_tokens`` rows were served from the live cache.
    ``spans`` are the computed position intervals ``[a, b)``, ``intervals`` their count.
    ``stale_tokens`` is S, this edit's stale suffix (reused rows after its first edit point, see
    :func:`kvmemory.edits.plan_edits`); ``kept_stale_tokens`` are rows an earlier repair left
    stale and already paid for, kept as they were (not refreshed again, still not exact).
    ``latency_ms`` is the whole ``prepare`` call: rendering, planning, selection, Shift, refresh
    and query prefill, up to the first-token distribution. ``replayed_probe_ms`` is the measured
    time of allocation probes reused from :func:`kvmemory.selection.shared_signals` (evaluation
    harnesses); it is included in ``selection_ms`` and ``latency_ms``.
    ``fallback`` says why a cheaper path was replaced by exact recomputation (None if not): the
    capability gate that applied (sliding windows, mrope, dynamic RoPE, quantized cache, ...).
    ``capability_notes`` are model facts that change no result (e.g. mixture-of-experts).
    ``executor`` names what computed the rows (``sequential``, ``direct``, ``packed-sdpa``,
    ``packed-triton``); ``executor_fallback`` says why the requested executor was replaced.
    ``erased`` (strict erase only): ``{"mode", "messages" (ids), "from_row", "rows_recomputed",
    "rows_overwritten", "boundary_rows_overwritten"}`` in rows; None when nothing was erased.
    ``adapter``: the CacheReforge maintenance this call ran first because the adapter version
    changed (``ReforgeReport.as_dict()``: action, layer range, ``fallback``), None otherwise.
    ``engine``: what computes the model's rows (``{"name": "q4_1" | "transformers", "reason"}``,
    the reason why the fast engine does not run; see :mod:`kvmemory.engine`).

    ``adaptive`` (``budget="auto"`` only): ``{"signal", "tolerance", "max_budget", "stopped_by"
    ("signal" | "cap"), "spent_budget" (%), "probe_tokens", "rounds": [{"budget" (% asked),
    "refreshed" (rows so far), "new_rows", "value" (the signal, None when undefined)}]}``.

    ``decode_replay`` (``replay_margin`` > 0 only, set while the answer decodes): ``{"at_token"
    (answer tokens picked before it), "margin" (nats, the pick's top-1/top-2 logit gap),
    "replay_margin", "recomputed_tokens" (stale suffix + answer so far), "ms"}``; None when no
    pick fell below the margin. Its rows are not in ``recomputed_tokens`` (that counts ``prepare``).
    """

    operator: str
    budget: float | None
    allocator: str | None
    prompt_tokens: int
    reused_tokens: int
    recomputed_tokens: int
    stale_tokens: int = 0
    kept_stale_tokens: int = 0
    refreshed_tokens: int = 0
    shifted_tokens: int = 0
    intervals: int = 0
    spans: list[tuple[int, int]] = field(default_factory=list)
    edits: dict[str, int] = field(default_factory=dict)
    widened: list[str] = field(default_factory=list)
    fallback: str | None = None
    capability_notes: list[str] = field(default_factory=list)
    executor: str | None = None
    executor_fallback: str | None = None
    selection_ms: float = 0.0
    shift_ms: float = 0.0
    refresh_ms: float = 0.0
    latency_ms: float = 0.0
    replayed_probe_ms: float = 0.0  # allocation probes reused via selection.shared_signals; in selection_ms and latency_ms
    erased: dict | None = None  # strict erase: messages, from_row, rows_recomputed, rows_overwritten
    adapter: dict | None = None  # CacheReforge maintenance run by this call (ReforgeReport.as_dict())
    engine: dict | None = None  # {"name", "reason"}: what computed the rows (kvmemory.engine.status)

    adaptive: dict | None = None  # budget="auto": rounds, signal values, stop reason, budget spent
    decode_replay: dict | None = None  # replay_margin: where the answer's decode replayed the stale suffix

    def note_fallback(self, reason: str | None) -> None:
        """Record why exact recomputation replaced a cheaper path (the only writer of
        ``fallback``): the first reason stays (the repair's, then the session's, then decode-time
        Replay's); None adds nothing."""
        if reason and not self.fallback:
            self.fallback = reason

    def to_dict(self) -> dict:
        return asdict(self)
