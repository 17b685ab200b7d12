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
    parser.add_argument("--layer", type=int, default=None, help="LoRA layer (default: the middle layer N//2)")
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
    return None


def load_workload(args, console) -> Workload:
    from ..models import load_model
    from .workload import attach_lora

    with console.status("loading model"):
        lm = load_model(args.model, args.dtype)
    model, target, adapter_config = attach_lora(lm.model, args.target, args.layer, args.rank, 2 * args.rank)
    passages = args.passages or 2
    answer_tokens = args.answer_tokens if args.answer_tokens is not None else (3 if args.quick else 4)
    return Workload(lm, model, lm.tokenizer, target, adapter_config, args.data, passages, answer_tokens,
                    args.calib_answer_tokens)


def context_regime(passages: int) -> str:
    return f"hotpotqa+2wiki, {passages} passages per prompt"


def run_calibration(w: Workload, args, console, *, samples: int, updates: int, starts, gaps):
    """Calibration trajectory (seed 53) + conditions → a frozen ReforgeProfile."""
    from ..session import KVSession
    from .calibration import calibrate
    from .profile import ProfileKey
    from .state import ReforgeConfig
    from .workload import load_snapshot, qa_samples, update_trajectory

    key = ProfileKey(model=w.lm.name, update_target=w.update_target, adapter_config=w.adapter_config,
                     context_regime=context_regime(w.passages))
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
