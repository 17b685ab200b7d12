"""Trajectory fit of CacheReforge sensitivities for a recompute budget.

The paper's calibration (eqs. 6-7) labels layers by the first safe window of each condition and
sets δ_ℓ from the 5 % lower tail of the labelling distances. Layers that one window covers get
the same δ, so on our model the restart layer, which holds most of the stale KL, is refreshed as
rarely as the three layers after it. This module fits δ_ℓ for an operating point
instead, on the same calibration split:

1. A :class:`TrajectoryBank` holds, for every calibration prompt and every adapter version of a
   calibration trajectory, the fresh K/V of the affected layers and the fresh first-token logits.
2. Because a range ``[r, b)`` recomputed at version t equals the fresh K/V of version t, a
   cache maintained by eq. 9 is fully described by the version each affected layer was last
   refreshed at. :class:`PolicyReplay` replays the runtime rule (``runtime.decide``) for many
   candidate profiles at once and measures each visited state's first-token KL exactly (one
   batched forward of the last prompt token per version), memoised across candidates.
3. :func:`fit_to_budget` searches one δ per window group (the layers the paper's candidate
   windows ``{1, 2, 4, 8, 16, full}`` add) by Lagrangian coordinate descent, and keeps the
   evaluated profile with the lowest calibration KL whose mean recomputed-layer % stays within
   the budget. The runtime rule (q_ℓ = s_ℓ·d_ℓ ≥ 1, b_t = 1 + max triggered layer) is unchanged.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch

from kvmemory import kvcache
from kvmemory.engine import forward_rows
from kvmemory.reforge.probe import ProbeCalibration, extend_while_stale, probe_cost
from kvmemory.reforge.profile import ReforgeProfile
from kvmemory.reforge.recovery import decoder_of, run_layers
from kvmemory.reforge.restart import restart_layers
from kvmemory.reforge.runtime import Decision, decide
from kvmemory.reforge.scheduler import BudgetAccount
from kvmemory.reforge.versions import capture_adapter, lora_modules

from ..metrics import first_token_kl
from .calibration import WINDOWS

LAMBDA_START = 0.01  # Lagrangian weight: 1 % of layers recomputed is worth 1 % of the stale KL
LAMBDA_ROUNDS = 4  # descents, λ bisected (geometrically) towards the budget between them
FACTORS = (0.5, 0.7, 0.85, 1.18, 1.4, 2.0)  # multiplicative moves of one group's δ


@dataclass
class PromptVersions:
    """One calibration prompt: ``token_ids`` ``[n]``; ``base`` K/V of layers below the restart
    (adapter-independent), each ``[1, kv_heads, n-1, head_dim]``; ``kv[v][ℓ - r]`` the fresh K/V
    of affected layer ℓ at version v; ``fresh[v]`` fresh first-token logits ``[vocab]`` (fp32);
    ``entry`` the last token's hidden state entering layer r ``[1, 1, H]`` (adapter-independent)."""

    token_ids: torch.Tensor
    base: list[tuple[torch.Tensor, torch.Tensor]]
    kv: list[list[tuple[torch.Tensor, torch.Tensor]]]
    fresh: list[torch.Tensor]
    entry: torch.Tensor | None = None


@dataclass
class TrajectoryBank:
    """A calibration trajectory v_0..v_T: ``snapshots`` (adapter parameters per version),
    ``distances[t, a]`` = ‖θ_t − θ_a‖₂ (eq. 8, parameter units), the restart layer r, the cache
    layers the updates invalidate, and the per-prompt fresh states."""

    snapshots: list[dict]
    distances: torch.Tensor
    restart: int
    invalid: list[int]
    num_layers: int
    prompts: list[PromptVersions] = field(default_factory=list)

    @property
    def updates(self) -> int:
        return len(self.snapshots) - 1


def build_bank(model, prompts: list[list[int]], snapshots: list[dict], load_version, progress=None) -> TrajectoryBank:
    """Prefill every prompt at every version (T+1 prefills per prompt).

    Args:
        prompts: token ids per prompt (at least 2 tokens each).
        snapshots: adapter versions v_0..v_T (``workload.update_trajectory``).
        load_version: ``f(model, snapshot)`` that activates a version.
        progress: a tqdm bar advanced once per prefill.

    Memory: (T+1)·(N−r) layers of K/V per prompt (fp32: ~5.5 MB per version for a 240-token
    SmolLM2 prompt and 15 affected layers).

    Raises:
        ValueError: fewer than 2 versions, no LoRA on ``model``, updates that invalidate no cache
            layer, or a prompt shorter than 2 tokens.
    """
    if len(snapshots) < 2:
        raise ValueError("a trajectory needs at least one update (2 versions)")
    num_layers = model.config.get_text_config().num_hidden_layers
    states = []
    for snap in snapshots:
        load_version(model, snap)
        states.append(capture_adapter(model, num_layers))
    if states[0] is None:
        raise ValueError("the model has no LoRA adapter: attach one before calibrating CacheReforge")
    vectors = torch.stack([s.vector for s in states])
    distances = torch.cdist(vectors[None].double(), vectors[None].double())[0]
    invalid = [layer for layer in range(num_layers)
               if any(not s.same_cache_layer(states[0], layer) for s in states[1:])]
    if not invalid:
        raise ValueError("the trajectory's updates change no cache layer: nothing to calibrate")
    restart = min((invalid[0], *_exec_restarts(model, num_layers)))  # eq. S4: Q/O/MLP restart below r_kv
    bank = TrajectoryBank(list(snapshots), distances, restart, invalid, num_layers)
    for ids in prompts:
        if len(ids) < 2:
            raise ValueError("calibration prompts need at least 2 tokens")
        bank.prompts.append(_prompt_versions(model, torch.tensor(ids), snapshots, load_version, restart, progress))
    load_version(model, snapshots[0])
    return bank


def _exec_restarts(model, num_layers: int) -> list[int]:
    """Execution restart (eq. S4) of every trainable LoRA module inside the decoder stack."""
    return [restart_layers(m.kind, m.layer, num_layers)[1] for m in lora_modules(model)
            if m.layer is not None and m.layer < num_layers
            and any(p.requires_grad for p in m.module.parameters())]


def _prompt_versions(model, ids, snapshots, load_version, restart, progress) -> PromptVersions:
    """Layers below the restart are adapter-independent: one prefill at v_0 gives their K/V and
    the rows entering layer r; every version then executes only layers ``[r, N)`` from that
    state (``recovery.run_layers``, the executor maintenance uses) and the last prompt token."""
    entering = []

    def capture(module, args, kwargs):
        entering.append((args[0] if args else kwargs["hidden_states"]).detach().clone())

    load_version(model, snapshots[0])
    num_layers = model.config.get_text_config().num_hidden_layers
    hook = decoder_of(model).layers[restart].register_forward_pre_hook(capture, with_kwargs=True)
    try:
        cache = kvcache.new_cache(model.config)
        forward_rows(model, cache, ids[:-1], 0)
        forward_rows(model, kvcache.clone_cache(cache), ids[-1:], ids.shape[0] - 1)
    finally:
        hook.remove()
    rows, entry = entering
    base = [(k.clone(), v.clone()) for k, v in kvcache.layer_tensors(cache)[:restart]]
    kv, fresh = [], []
    for snap in snapshots:
        load_version(model, snap)
        run = run_layers(model, rows, restart, num_layers)
        kv.append([run.kv[layer] for layer in range(restart, num_layers)])
        version_cache = kvcache.from_tensors([*base, *kv[-1]])
        fresh.append(forward_rows(model, version_cache, ids[-1:], ids.shape[0] - 1))
        if progress is not None:
            progress.update(1)
    return PromptVersions(ids, base, kv, fresh, entry)


@dataclass
class ReplayResult:
    """Mean first-token KL to fresh, top-1 agreement (%) and mean recomputed layers (% of N,
    probes included at their layer share) over every (prompt, update) of the banks; ``actions``
    counts reuse / bounded / full_suffix decisions; ``ends[bank][prompt][t - 1]`` the range end
    chosen at update t (None: reuse); ``kls`` the per-state KLs in the same order (bank, update,
    prompt); ``probe_pct`` the probes' part of ``recompute_pct``."""

    kl: float
    recompute_pct: float
    actions: dict[str, int]
    top1: float = 0.0
    ends: list = field(default_factory=list)
    kls: list = field(default_factory=list)
    probe_pct: float = 0.0


@dataclass(frozen=True)
class ReplayPolicy:
    """A policy :meth:`PolicyReplay.evaluate` replays: ``policy`` as in ``runtime.decide``
    (cachereforge, scheduled, drift_only, fixed_window, exact_suffix), ``probed``
    (:mod:`kvmemory.reforge.probe` with ``probe``'s thresholds; probe values read exactly from
    the bank) or ``oracle`` (the scheduler's budget rule choosing by the *exact* KL of every
    candidate range: an upper reference for any KL predictor, not a runtime policy);
    ``budget_pct`` for scheduled / probed / oracle; ``price`` λ of the oracle (KL per layer);
    ``carry`` its savings cap (updates)."""

    policy: str
    profile: ReforgeProfile | None = None
    budget_pct: float | None = None
    window: int = 2
    price: float = 0.0
    carry: float = 16.0
    probe: ProbeCalibration | None = None

    def account(self, num_layers: int):
        if self.policy == "scheduled":
            return BudgetAccount.open(self.budget_pct, num_layers, self.profile.scheduler.carry)
        if self.policy == "probed":
            return BudgetAccount.open(self.budget_pct, num_layers, self.probe.carry)
        if self.policy == "oracle":
            return BudgetAccount.open(self.budget_pct, num_layers, self.carry)
        return None


class PolicyReplay:
    """Replays runtime policies over trajectory banks; KL per visited state is computed once.

    A state is (bank, prompt, version t, versions of the affected layers). Evaluating many
    candidate profiles together batches their new states per version into padded forwards of
    the last prompt token (``max_batch`` rows each).
    """

    def __init__(self, model, banks: list[TrajectoryBank], load_version, max_batch: int = 48):
        self.model, self.banks, self.load_version, self.max_batch = model, banks, load_version, max_batch
        self._kl: dict[tuple, float] = {}
        self._top1: dict[tuple, bool] = {}
        self._probe_tables: dict[tuple[int, int], torch.Tensor] = {}
        self.forwards = 0

    def probe_values(self, b: int, rows: int) -> torch.Tensor:
        """``dev[i, j, t, a]`` of bank ``b`` for probes of the last ``rows`` cache rows (0: all),
        computed once (:func:`kvmemory_lab.reforge.probe_fit.probe_table`)."""
        from .probe_fit import probe_table

        if (b, rows) not in self._probe_tables:
            self._probe_tables[b, rows] = probe_table(self.banks[b], rows or None)
        return self._probe_tables[b, rows]

    def save_memo(self, path, b: int = 0) -> None:
        """Write the measured KL / top-1 of bank ``b``'s states to ``path`` (a later replay of the
        same bank loads them with :meth:`load_memo` instead of re-running the forwards)."""
        memo = {k[1:]: (v, self._top1[k]) for k, v in self._kl.items() if k[0] == b}
        torch.save(memo, path)

    def load_memo(self, path, b: int = 0) -> int:
        """Read states written by :meth:`save_memo` for bank ``b``; returns how many."""
        memo = torch.load(path, weights_only=False)
        for k, (kl, top) in memo.items():
            self._kl[(b, *k)] = kl
            self._top1[(b, *k)] = top
        return len(memo)

    def evaluate(self, profiles: list) -> list[ReplayResult]:
        """One :class:`ReplayResult` per entry: None (stale reuse, nothing recomputed), a
        :class:`ReforgeProfile` (eq. 9) or a :class:`ReplayPolicy`."""
        policies = [p if p is None or isinstance(p, ReplayPolicy) else ReplayPolicy("cachereforge", p)
                    for p in profiles]
        kls = [[] for _ in policies]
        tops = [[] for _ in policies]
        recs = [[] for _ in policies]
        probes = [[] for _ in policies]
        ends = [[] for _ in policies]
        actions = [{"reuse": 0, "bounded": 0, "full_suffix": 0} for _ in policies]
        for b, bank in enumerate(self.banks):
            width = len(bank.prompts[0].kv[0])
            anchors = [[[0] * width for _ in bank.prompts] for _ in policies]
            accounts = [[p.account(bank.num_layers) if p else None for _ in bank.prompts] for p in policies]
            for c in range(len(policies)):
                ends[c].append([[] for _ in bank.prompts])
            for t in range(1, bank.updates + 1):
                if any(p is not None and p.policy == "oracle" for p in policies):
                    self._fill(bank, t, {k for c, p in enumerate(policies) if p is not None and p.policy == "oracle"
                                         for i in range(len(bank.prompts))
                                         for k in self._candidates(b, i, t, anchors[c][i], bank)
                                         if k not in self._kl})
                keys = [[None] * len(bank.prompts) for _ in policies]
                for c, policy in enumerate(policies):
                    for i in range(len(bank.prompts)):
                        layers, action, end, probed = self._step(b, i, bank, t, anchors[c][i], policy,
                                                                 accounts[c][i])
                        recs[c].append(100.0 * (layers + probed) / bank.num_layers)
                        probes[c].append(100.0 * probed / bank.num_layers)
                        actions[c][action] += 1
                        ends[c][b][i].append(end)
                        keys[c][i] = (b, i, t, tuple(anchors[c][i]))
                self._fill(bank, t, {k for row in keys for k in row if k not in self._kl})
                for c in range(len(policies)):
                    kls[c] += [self._kl[k] for k in keys[c]]
                    tops[c] += [self._top1[k] for k in keys[c]]
            self.load_version(self.model, bank.snapshots[0])  # _fill switched versions
        return [ReplayResult(statistics.fmean(k), statistics.fmean(r), a, 100.0 * statistics.fmean(tp), e, k,
                             statistics.fmean(pr))
                for k, r, a, tp, e, pr in zip(kls, recs, actions, tops, ends, probes)]

    @staticmethod
    def _candidates(b: int, i: int, t: int, anchor: list[int], bank: TrajectoryBank) -> list[tuple]:
        """The states each range ``[r, end)`` would leave at version t (end = r: reuse)."""
        r, width = bank.restart, len(anchor)
        return [(b, i, t, tuple([t] * h + anchor[h:])) for h in range(width + 1)]

    def _step(self, b: int, i: int, bank: TrajectoryBank, t: int, anchor: list[int], policy, account):
        """Apply the policy's decision at version t to ``anchor`` (in place); returns the executed
        layers, the action, the range end (None: reuse) and the probes' cost (layers)."""
        if policy is None:
            return 0, "reuse", None, 0.0
        r = bank.restart
        distances = [0.0] * bank.num_layers
        for j, a in enumerate(anchor):
            distances[r + j] = float(bank.distances[t, a])
        if account is not None:
            account.deposit()
        probed = 0.0
        if policy.policy == "oracle":
            end = self._oracle_end(b, i, t, anchor, bank, policy, account)
            decision = Decision("oracle", bank.invalid[0], r, end, [], distances, [0.0] * bank.num_layers)
        elif policy.policy == "probed":
            table = self.probe_values(b, policy.probe.rows)[i]
            rows = bank.prompts[i].token_ids.shape[0] - 1
            cost = probe_cost(self.model.config, policy.probe.rows or rows, rows)

            def deviation(layer: int) -> float:  # what a probe or the restart projection measures
                return float(table[layer - r, t, anchor[layer - r]])

            plan = extend_while_stale(r, bank.num_layers, lambda layer, reach: deviation(layer),
                                      policy.probe, account, cost, r_kv=bank.invalid[0],
                                      row_share=min(policy.probe.rows or rows, rows) / rows,
                                      project=deviation, projection_cost=probe_cost(self.model.config, rows, rows))
            if plan.projected is not None:
                anchor[plan.projected - r] = t
            # probes + valid layers run for the probed rows to reach one + the restart projection
            probed = plan.probe_layers + plan.projection_layers
            account.charge(probed)
            decision = Decision("probed", bank.invalid[0], r, plan.end, [], distances, [0.0] * bank.num_layers)
        else:
            decision = decide(policy.policy, distances, bank.invalid, r, policy.profile, policy.window, account)
        if account is not None:
            account.charge(decision.layers)
        if decision.action != "reuse":
            for layer in range(decision.start, decision.end):
                anchor[layer - r] = t
        return decision.layers, decision.action, decision.end if decision.action != "reuse" else None, probed

    def _oracle_end(self, b, i, t, anchor, bank, policy: ReplayPolicy, account) -> int | None:
        r = bank.restart
        best, best_score = None, float("inf")
        for h, key in enumerate(self._candidates(b, i, t, anchor, bank)):
            if h > account.balance + 1e-9:
                break
            score = self._kl[key] + policy.price * h
            if score < best_score - 1e-15:
                best, best_score = (None if h == 0 else r + h), score
        return best

    def _fill(self, bank: TrajectoryBank, t: int, keys: set) -> None:
        if not keys:
            return
        self.load_version(self.model, bank.snapshots[t])
        ordered = sorted(keys)
        for start in range(0, len(ordered), self.max_batch):
            chunk = ordered[start:start + self.max_batch]
            logits = self._forward(bank, chunk)
            for key, z in zip(chunk, logits):
                fresh = bank.prompts[key[1]].fresh[t]
                self._kl[key] = first_token_kl(fresh, z)
                self._top1[key] = int(torch.argmax(z)) == int(torch.argmax(fresh))

    def _forward(self, bank: TrajectoryBank, keys: list[tuple]) -> torch.Tensor:
        """Logits ``[len(keys), vocab]`` of each state's last prompt token: caches padded at the
        end to the longest prompt, pads masked out, positions given explicitly. Only layers ≥ r
        run (the state entering r is the same for every version); models with a final logit
        soft-cap take the full forward."""
        prompts = [bank.prompts[k[1]] for k in keys]
        lengths = [p.token_ids.shape[0] - 1 for p in prompts]
        width = max(lengths)
        first = 0 if self._full_forward() else bank.restart
        empty = prompts[0].kv[0][0][0][:, :, :0]
        tensors = [(empty, empty)] * first
        for layer in range(first, bank.num_layers):
            ks, vs = [], []
            for p, key in zip(prompts, keys):
                k, v = p.base[layer] if layer < bank.restart else p.kv[key[3][layer - bank.restart]][layer - bank.restart]
                ks.append(_pad(k, width))
                vs.append(_pad(v, width))
            tensors.append((torch.cat(ks), torch.cat(vs)))
        valid = torch.zeros(len(keys), width + 1, dtype=torch.bool)
        for j, n in enumerate(lengths):
            valid[j, :n] = True
        valid[:, -1] = True
        positions = torch.tensor(lengths)[:, None]
        cache = kvcache.from_tensors(tensors)
        self.forwards += 1
        with torch.no_grad():
            if first == 0:
                ids = torch.stack([p.token_ids[-1:] for p in prompts])
                out = self.model(input_ids=ids, attention_mask=valid.long(), position_ids=positions, cache=cache,
                                 use_cache=True, logits_to_keep=1)
                return out.logits[:, -1].float()
            return self._tail(torch.cat([p.entry for p in prompts]), valid, positions, cache, first)

    def _full_forward(self) -> bool:
        return getattr(self.model.config.get_text_config(), "final_logit_softcapping", None) is not None

    def _tail(self, hidden, valid, positions, cache, first: int) -> torch.Tensor:
        """Layers ``[first, N)``, final norm and LM head for ``hidden`` ``[B, 1, H]``; ``valid``
        ``[B, width + 1]`` marks the key rows each query may see (additive mask)."""
        decoder = decoder_of(self.model)
        mask = torch.zeros(valid.shape, dtype=hidden.dtype).masked_fill(~valid, torch.finfo(hidden.dtype).min)
        mask = mask[:, None, None, :]
        position_embeddings = decoder.rotary_emb(hidden, position_ids=positions)
        for layer in range(first, len(decoder.layers)):
            hidden = decoder.layers[layer](hidden, attention_mask=mask, position_ids=positions, cache=cache,
                                           use_cache=True, position_embeddings=position_embeddings)
        return self.model.get_output_embeddings()(decoder.norm(hidden))[:, -1].float()


def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
    """``[1, h, n, d]`` → ``[1, h, width, d]`` with zero rows at the end."""
    if x.shape[2] == width:
        return x
    return torch.nn.functional.pad(x, (0, 0, 0, width - x.shape[2]))


def window_groups(restart: int, num_layers: int, windows=WINDOWS) -> list[tuple[int, ...]]:
    """Layers each candidate window adds (paper's H_i): [r, r+1), [r+1, r+2), [r+2, r+4), …, up to N."""
    ends = sorted({min(restart + h, num_layers) for h in windows if h > 0} | {num_layers})
    groups, lo = [], restart
    for end in ends:
        if end > lo:
            groups.append(tuple(range(lo, end)))
            lo = end
    return groups


@dataclass
class FitResult:
    """The chosen group δs (parameter units) with their calibration KL / recompute %, the stale
    KL of the same banks, the label-calibrated starting point, and how much was evaluated."""

    groups: list[tuple[int, ...]]
    group_delta: list[float]
    kl: float
    recompute_pct: float
    stale_kl: float
    start_delta: list[float]
    start_kl: float
    start_recompute_pct: float
    evaluated: int
    forwards: int

    @property
    def kl_reduction_pct(self) -> float:
        return 100.0 * (1.0 - self.kl / self.stale_kl) if self.stale_kl > 0 else 0.0


def parse_groups(text: str) -> list[tuple[int, ...]] | None:
    """δ groups for :func:`fit_to_budget` from text: ``window`` → None (the paper's window
    groups, :func:`window_groups`); ``15-15,16-18`` → ``[(15,), (16, 17, 18)]`` (inclusive layer
    ranges; ``fit_to_budget`` checks them against the restart layer).

    Raises:
        ValueError: not ``window`` nor a comma list of ``lo-hi`` ranges with lo ≤ hi.
    """
    if text.strip() == "window":
        return None
    groups = []
    for part in text.split(","):
        try:
            lo, hi = (int(x) for x in part.split("-"))
        except ValueError:
            raise ValueError(f"δ groups: expected 'window' or layer ranges like 15-15,16-18, got {text!r}") from None
        if not 0 <= lo <= hi:
            raise ValueError(f"δ groups: range {part!r} must have 0 <= lo <= hi")
        groups.append(tuple(range(lo, hi + 1)))
    return groups


def _check_groups(groups, restart: int, num_layers: int) -> None:
    layers = [layer for group in groups for layer in group]
    if len(set(layers)) != len(layers):
        raise ValueError(f"δ groups {groups} overlap: give each affected layer to one group")
    outside = [layer for layer in layers if not restart <= layer < num_layers]
    if outside:
        raise ValueError(f"δ groups name layers {outside} outside the affected layers [{restart}, {num_layers}): "
                         "group only layers at or after the restart layer")


def profile_with_groups(base: ReforgeProfile, groups, group_delta: list[float]) -> ReforgeProfile:
    """``base`` with δ_ℓ = the δ of ℓ's group and s_ℓ = 1/δ_ℓ (layers outside every group keep theirs)."""
    delta, sensitivity = list(base.delta), list(base.sensitivity)
    for group, d in zip(groups, group_delta):
        for layer in group:
            delta[layer], sensitivity[layer] = d, 1.0 / d
    return base.model_copy(update={"delta": delta, "sensitivity": sensitivity})


def start_deltas(profile: ReforgeProfile, groups) -> list[float]:
    """Each group's smallest label-calibrated δ (unlabelled groups: twice the largest δ)."""
    known = [d for d in profile.delta if d is not None]
    if not known:
        raise ValueError("the profile labelled no layer: calibrate with longer gaps first")
    out = []
    for group in groups:
        ds = [profile.delta[layer] for layer in group if profile.delta[layer] is not None]
        out.append(min(ds) if ds else 2.0 * max(known))
    return out


def fit_to_budget(replay: PolicyReplay, start: ReforgeProfile, budget_pct: float, *, lam: float = LAMBDA_START,
                  rounds: int = LAMBDA_ROUNDS, factors=FACTORS, max_steps: int = 8,
                  groups: list[tuple[int, ...]] | None = None,
                  progress=None) -> tuple[ReforgeProfile, FitResult]:
    """Fit one δ per group (default: per window group) on the replay's banks for ``budget_pct``
    (% of the N layers recomputed per update, averaged like the benchmark's recomputed-layer %).

    ``rounds`` descents, each a best-improvement coordinate descent on KL/KL_stale + λ·recompute%
    over single-group moves δ_g × f (f in ``factors``, at most ``max_steps`` moves), the first
    from the label-calibrated δs, later ones from the previous end point. Between descents λ is
    doubled while the end point exceeds the budget, halved while it is within, and bisected
    geometrically once both sides are known. Every evaluated candidate is a valid profile; the
    one with the lowest calibration KL among those within the budget is returned.

    ``groups``: the δ groups (default :func:`window_groups`; finer groups fit more δ at more
    evaluations, e.g. ``[(15,), (16,), …]`` one per layer).

    Raises:
        ValueError: ``budget_pct`` not in (0, 100], ``groups`` overlapping or naming layers before
            the restart layer, or no evaluated candidate stays within the budget (raise it).
    """
    if not 0 < budget_pct <= 100:
        raise ValueError(f"recompute budget must be in (0, 100] % of layers (got {budget_pct})")
    bank = replay.banks[0]
    groups = groups or window_groups(bank.restart, bank.num_layers)
    _check_groups(groups, bank.restart, bank.num_layers)
    stale = replay.evaluate([None])[0]
    first = start_deltas(start, groups)
    seen: dict[tuple, ReplayResult] = {}

    def run(candidates: list[list[float]]) -> list[ReplayResult]:
        todo = [c for c in candidates if tuple(c) not in seen]
        for c, res in zip(todo, replay.evaluate([profile_with_groups(start, groups, c) for c in todo]) if todo else []):
            seen[tuple(c)] = res
        if progress is not None:
            progress.update(1)
        return [seen[tuple(c)] for c in candidates]

    def objective(res: ReplayResult, lam: float) -> float:
        return res.kl / max(stale.kl, 1e-12) + lam * res.recompute_pct

    start_result = run([first])[0]
    current, current_res = first, start_result
    over, within = None, None  # largest λ seen over the budget, smallest within it
    for _ in range(rounds):
        for _ in range(max_steps):
            moves = [current[:g] + [current[g] * f] + current[g + 1:] for g in range(len(groups)) for f in factors]
            results = run(moves)
            best = min(range(len(moves)), key=lambda j: objective(results[j], lam))
            if objective(results[best], lam) >= objective(current_res, lam) - 1e-9:
                break
            current, current_res = moves[best], results[best]
        if current_res.recompute_pct > budget_pct:
            over = lam if over is None else max(over, lam)
        else:
            within = lam if within is None else min(within, lam)
        lam = lam * 2 if within is None else lam / 2 if over is None else (over * within) ** 0.5
    feasible = [(res.kl, c) for c, res in seen.items() if res.recompute_pct <= budget_pct + 1e-9]
    if not feasible:
        raise ValueError(f"no evaluated profile recomputes ≤ {budget_pct} % of layers on the calibration "
                         "trajectories: raise the budget")
    kl, chosen = min(feasible)
    res = seen[chosen]
    fit = FitResult(groups, list(chosen), res.kl, res.recompute_pct, stale.kl, first, start_result.kl,
                    start_result.recompute_pct, len(seen), replay.forwards)
    return profile_with_groups(start, groups, list(chosen)), fit
