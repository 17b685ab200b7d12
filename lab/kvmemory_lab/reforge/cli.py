"""``kvmemory calibrate``: freeze a CacheReforge profile for the embedded model (RQ4 workload:
rank-8 LoRA on the middle value projection, answer-supervised updates, HotpotQA + 2Wiki)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

CALIBRATION_SEED = 53  # the paper froze RQ4 profiles on calibration seeds 53 and 61


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("reforge-profile.json"), help="profile JSON to write")
    parser.add_argument("--quick", action="store_true", help="1 prompt, a 4-update trajectory (minutes)")
    parser.add_argument("--updates", type=int, default=None,
                        help="calibration trajectory length (default 32; quick 4); longer gaps are dropped")
    add_workload_arguments(parser)


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="local transformers model folder (default: embedded SmolLM2)")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--data", type=Path, default=None, help="shared data folder (default ../shared/data)")
    parser.add_argument("--target", default="v_proj", help="LoRA target module (default v_proj)")
    parser.add_argument("--layer", type=_ints, default=None,
                        help="LoRA layer, or a comma list for one LoRA on each (default: the middle layer N//2)")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank (default 8)")
    parser.add_argument("--magnitude", type=float, default=1e-2, help="update magnitude = Adam step size (default 1e-2)")
    parser.add_argument("--passages", type=int, default=None, help="passages per prompt (default 2, the supporting ones)")
    parser.add_argument("--calib-samples", type=int, default=None, help="calibration prompts (default 16, the paper's paired samples per profile; quick 1)")
    parser.add_argument("--answer-tokens", type=int, default=None,
                        help="greedy answer length for held-out task scores (default 4; quick 3; 0 disables)")
    parser.add_argument("--gaps", type=_ints, default=None,
                        help="calibration version gaps Δ (comma list; default 1,4,16 as in the paper's RQ2; quick 1,2,4)")
    parser.add_argument("--starts", type=_ints, default=None,
                        help="calibration start versions (comma list; default 0,8,16; quick 0)")
    parser.add_argument("--calib-answer-tokens", type=int, default=0,
                        help="greedy answer length for the calibration task-score criterion (default 0: KL and "
                        "top-1 only, since each window then costs a decode)")
    parser.add_argument("--from-profile", type=Path, default=None,
                        help="start from this label-calibrated profile instead of running the window calibration")
    parser.add_argument("--fit-budget", type=float, default=None,
                        help="fit one δ per group (--fit-groups) on calibration trajectories for this recomputed-layer "
                        "budget (%% of layers per update; kvmemory_lab.reforge.trajectory); default: the paper's "
                        "labelled δ")
    parser.add_argument("--fit-seeds", type=_ints, default=(53, 61),
                        help="calibration trajectory seeds for --fit-budget (default 53,61, the paper's)")
    parser.add_argument("--fit-groups", default="window",
                        help="δ groups of --fit-budget: window (one per layer range the paper's windows add; "
                        "default) or inclusive layer ranges like 15-15,16-16,17-18")
    parser.add_argument("--fit-prompts", type=int, default=8,
                        help="calibration prompts per fit trajectory (default 8, the paper's samples per task)")
    parser.add_argument("--schedule", type=float, default=None, metavar="BUDGET",
                        help="also fit the budgeted scheduler (policy 'scheduled', kvmemory.reforge.scheduler) for this "
                        "recompute budget (%% of layers per update) on the --fit-seeds calibration trajectories")
    parser.add_argument("--bank-dir", type=Path, default=None,
                        help="keep calibration trajectory banks here between runs (~2 GB per 8-prompt, 32-update bank)")


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return values


@dataclass
class Workload:
    """The loaded model with its LoRA, the profile key parts and the data folder."""

    lm: object
    model: object
    tokenizer: object
    update_target: str
    adapter_config: str
    data_dir: Path
    passages: int
    answer_tokens: int
    calib_answer_tokens: int


def check_workload_args(args) -> str | None:
    """A message naming the fix for unusable options (checked before the model loads)."""
    from ..demo_cases import default_data_dir

    from .workload import WIKI_FILE
    from ..demo_cases import HOTPOT_FILE

    data = args.data or default_data_dir()
    if data is None:
        return "no shared data folder found: pass --data pointing at ../shared/data (HotpotQA + 2Wiki)"
    missing = [str(f) for f in (HOTPOT_FILE, WIKI_FILE) if not (Path(data) / f).is_file()]
    if missing:
        return f"--data {data}: {', '.join(missing)} not found there; pass the shared data folder (../shared/data)"
    args.data = Path(data)
    if args.rank < 1 or args.magnitude <= 0:
        return "--rank must be >= 1 and --magnitude > 0"
    budget = getattr(args, "fit_budget", None)
    if budget is not None and not 0 < budget <= 100:
        return f"--fit-budget must be in (0, 100] % of layers (got {budget})"
    schedule = getattr(args, "schedule", None)
    if schedule is not None and not 0 < schedule <= 100:
        return f"--schedule must be in (0, 100] % of layers (got {schedule})"
    if getattr(args, "fit_prompts", 1) < 1:
        return "--fit-prompts must be at least 1"
    try:
        from .trajectory import parse_groups

        parse_groups(getattr(args, "fit_groups", "window"))
    except ValueError as err:
        return f"--fit-groups: {err}"
    source = getattr(args, "from_profile", None)
    if source is not None and not Path(source).is_file():
        return f"--from-profile {source}: no such file (run `kvmemory calibrate --out FILE` first)"
    return None


def load_workload(args, console) -> Workload:
    from kvmemory.models import load_model
    from .workload import attach_lora

    with console.status("loading model"):
        lm = load_model(args.model, args.dtype)
    layer = list(args.layer) if isinstance(args.layer, tuple) else args.layer  # --layer's comma list
    model, target, adapter_config = attach_lora(lm.model, args.target, layer, args.rank, 2 * args.rank)
    passages = args.passages or 2
    answer_tokens = args.answer_tokens if args.answer_tokens is not None else (3 if args.quick else 4)
    return Workload(lm, model, lm.tokenizer, target, adapter_config, args.data, passages, answer_tokens,
                    args.calib_answer_tokens)


def context_regime(passages: int) -> str:
    return f"hotpotqa+2wiki, {passages} passages per prompt"


def run_calibration(w: Workload, args, console, *, samples: int, updates: int, starts, gaps):
    """Calibration trajectory (seed 53) + conditions → a frozen ReforgeProfile (or the profile of
    ``--from-profile``); with ``--fit-budget`` its δ are then fitted on calibration trajectories."""
    from kvmemory.reforge.profile import ProfileKey, ReforgeProfile

    key = ProfileKey(model=w.lm.name, update_target=w.update_target, adapter_config=w.adapter_config,
                     context_regime=context_regime(w.passages))
    if getattr(args, "from_profile", None):
        profile = ReforgeProfile.load(args.from_profile, expect=key)
    else:
        profile = _label_calibration(w, args, key, samples=samples, updates=updates, starts=starts, gaps=gaps)
    if getattr(args, "fit_budget", None):
        profile = fit_profile(w, args, console, profile, updates)
    if getattr(args, "schedule", None):
        profile = schedule_profile(w, args, console, profile, updates)
    return profile


def _label_calibration(w: Workload, args, key, *, samples: int, updates: int, starts, gaps):
    from kvmemory.session import KVSession
    from .calibration import calibrate
    from kvmemory.reforge.state import ReforgeConfig
    from .workload import load_snapshot, qa_samples, update_trajectory

    calib = qa_samples(w.data_dir, "calibration", samples, passages=w.passages, seed=CALIBRATION_SEED)
    train = qa_samples(w.data_dir, "train", 40, passages=0, seed=CALIBRATION_SEED)
    with tqdm(total=updates, desc="calibration updates") as bar:
        versions = update_trajectory(w.model, w.tokenizer, train, updates, args.magnitude, CALIBRATION_SEED, bar)
    pairs = [(a, g) for a in starts for g in gaps if a + g <= updates]
    with tqdm(total=len(pairs) * len(calib), desc="calibration conditions") as bar:
        profile = calibrate(
            w.model, w.tokenizer, calib, versions, key, gaps=gaps, starts=starts, answer_tokens=w.calib_answer_tokens,
            progress=bar, load_version=load_snapshot,
            make_session=lambda: KVSession(w.model, w.tokenizer, "replay", reforge=ReforgeConfig()),
        )
    return profile


def trajectory_bank(w: Workload, split: str, prompts: int, seed: int, updates: int, magnitude: float):
    """A :class:`~kvmemory_lab.reforge.trajectory.TrajectoryBank`: ``prompts`` items of ``split``
    (calibration / eval) under the ``updates``-step trajectory of ``seed``."""
    from kvmemory.session import KVSession
    from .trajectory import build_bank
    from .workload import load_snapshot, qa_samples, update_trajectory

    samples = qa_samples(w.data_dir, split, prompts, passages=w.passages, seed=seed)
    train = qa_samples(w.data_dir, "train", 40, passages=0, seed=seed)
    versions = update_trajectory(w.model, w.tokenizer, train, updates, magnitude, seed)
    ids = []
    for sample in samples:  # the token ids a session renders for the prompt
        session = KVSession(w.model, w.tokenizer, "replay")
        session.prepare(list(sample.messages))
        ids.append(list(session.token_ids))
    with tqdm(total=len(ids) * (updates + 1), desc=f"{split} trajectory bank (seed {seed})") as bar:
        return build_bank(w.model, ids, versions, load_snapshot, bar)


def bank_path(bank_dir: Path, w: Workload, split: str, prompts: int, seed: int, updates: int,
              magnitude: float) -> Path:
    """Where :func:`cached_bank` keeps a bank: one file per (target, split, seed, prompts,
    updates, magnitude, passages)."""
    target = w.update_target.replace("@", "").replace(",", "+")
    return bank_dir / f"{target}_r{w.adapter_config.split('r=')[1].split()[0]}_{split}_s{seed}_p{prompts}_u{updates}_m{magnitude:g}_k{w.passages}.pt"


def cached_bank(w: Workload, split: str, prompts: int, seed: int, updates: int, magnitude: float,
                bank_dir: Path | None):
    """:func:`trajectory_bank`, loaded from / saved to ``bank_dir`` (None: always built). A bank
    is our own pickled TrajectoryBank (~7 MB per prompt and version for 15 affected SmolLM2
    layers at ~240 tokens), so only load files this function wrote."""
    import torch

    path = bank_path(bank_dir, w, split, prompts, seed, updates, magnitude) if bank_dir else None
    if path is not None and path.is_file():
        return torch.load(path, weights_only=False)
    bank = trajectory_bank(w, split, prompts, seed, updates, magnitude)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(bank, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").rename(path)
    return bank


def fit_profile(w: Workload, args, console, profile, updates: int):
    """Fit ``profile``'s δ per ``args.fit_groups`` group for ``args.fit_budget`` on one calibration trajectory
    per ``args.fit_seeds`` seed (``args.fit_prompts`` calibration prompts each)."""
    from .trajectory import PolicyReplay, fit_to_budget, parse_groups
    from .workload import load_snapshot

    banks = [cached_bank(w, "calibration", args.fit_prompts, seed, updates, args.magnitude,
                         getattr(args, "bank_dir", None)) for seed in args.fit_seeds]
    replay = PolicyReplay(w.model, banks, load_snapshot)
    with tqdm(desc="fitting δ per group", unit="round") as bar:
        fitted, fit = fit_to_budget(replay, profile, args.fit_budget, progress=bar,
                                   groups=parse_groups(args.fit_groups))
    fitted.fit = {  # the profile JSON's record of the fit (names as in the frozen profiles)
        "budget_pct": args.fit_budget, "seeds": list(args.fit_seeds), "prompts_per_seed": args.fit_prompts,
        "updates": updates, "groups": [list(g) for g in fit.groups], "group_delta": fit.group_delta,
        "calibration_kl": fit.kl, "calibration_recompute_pct": fit.recompute_pct, "stale_kl": fit.stale_kl,
        "calibration_kl_reduction_pct": fit.kl_reduction_pct, "start_delta": fit.start_delta,
        "start_kl": fit.start_kl, "start_recompute_pct": fit.start_recompute_pct,
        "evaluated_profiles": fit.evaluated, "batched_forwards": fit.forwards,
    }
    console.print(f"fitted δ per group {[round(d, 3) for d in fit.group_delta]}: calibration KL "
                  f"{fit.kl:.4f} ({fit.kl_reduction_pct:.1f} % below stale) at {fit.recompute_pct:.2f} % layers "
                  f"(labelled δ: KL {fit.start_kl:.4f} at {fit.start_recompute_pct:.2f} %)")
    return fitted


def schedule_profile(w: Workload, args, console, profile, updates: int):
    """``profile`` with a scheduler calibration for ``args.schedule`` fitted on the ``args.fit_seeds``
    calibration trajectories (both decision rules tried; the lower calibration KL is kept)."""
    from .schedule_fit import fit_scheduler
    from .trajectory import PolicyReplay
    from .workload import load_snapshot

    banks = [cached_bank(w, "calibration", args.fit_prompts, seed, updates, args.magnitude,
                         getattr(args, "bank_dir", None)) for seed in args.fit_seeds]
    replay = PolicyReplay(w.model, banks, load_snapshot)
    fits = [fit_scheduler(replay, profile, args.schedule, rule=rule) for rule in ("ratio", "lagrangian")]
    scheduled, fit = min(fits, key=lambda pf: pf[1].kl)
    scheduled.scheduler.fit.update({"seeds": list(args.fit_seeds), "prompts_per_seed": args.fit_prompts,
                                    "updates": updates})
    console.print(f"scheduler ({scheduled.scheduler.rule}, λ {scheduled.scheduler.price:g}, carry "
                  f"{scheduled.scheduler.carry:g}): calibration KL {fit.kl:.4f} ({fit.kl_reduction_pct:.1f} % below "
                  f"stale) at {fit.recompute_pct:.2f} % layers")
    return scheduled


def calibration_plan(quick: bool, args=None) -> dict:
    """Trajectory length, start versions and gaps of the calibration conditions (``args.gaps`` /
    ``args.starts`` override the defaults)."""
    plan = {"updates": 4, "starts": (0,), "gaps": (1, 2, 4)} if quick else {"updates": 32, "starts": (0, 8, 16), "gaps": (1, 4, 16)}
    for name in ("gaps", "starts"):
        if getattr(args, name, None):
            plan[name] = tuple(getattr(args, name))
    return plan


def run(args, console) -> int:
    problem = check_workload_args(args)
    if args.updates is not None and args.updates < 1:
        problem = "--updates must be at least 1"
    if problem:
        console.print(f"[red]{problem}[/red]")
        return 2
    plan = calibration_plan(args.quick, args)
    if args.updates is not None:
        plan["updates"] = args.updates
    w = load_workload(args, console)
    samples = args.calib_samples or (1 if args.quick else 16)
    profile = run_calibration(w, args, console, samples=samples, **plan)
    profile.save(args.out)
    labelled = [i for i, s in enumerate(profile.sensitivity) if s > 0]
    console.print(f"wrote {args.out}: {len(profile.conditions)} conditions, sensitive layers {labelled}, "
                  f"drift-only threshold {profile.drift_threshold}")
    return 0
