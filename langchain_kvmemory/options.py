"""The settings ChatKVMemory accepts, under the names users of other LangChain chat models and of
transformers pass them: aliases (``max_new_tokens``, ``torch_dtype``, ``device_map``), dtype
spellings, device selection, ``model_kwargs``, and a clear error for any key it does not know
(instead of dropping it).
"""

from __future__ import annotations

import difflib
from typing import Any, Iterable

import torch

from kvmemory.errors import InputError, InputTypeError

# alias -> field, at construction and per call
ALIASES = {"max_new_tokens": "max_tokens", "torch_dtype": "dtype", "device_map": "device", "model_name": "model"}
DTYPE_NAMES = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
}
HALF_NAMES = ("fp16", "float16", "half", "torch.float16")


def normalize_dtype(value: Any) -> str:
    """``"fp32"`` or ``"bf16"`` from any usual spelling (``"float32"``, ``"torch.bfloat16"``,
    ``torch.bfloat16``, ``"auto"`` = fp32 on CPU / bf16 on CUDA is resolved by the caller).

    Raises:
        InputError: fp16 (overflows in long-context attention, slow on CPU) or an unknown name.
    """
    if isinstance(value, torch.dtype):
        value = str(value)
    if isinstance(value, str) and value.lower() in DTYPE_NAMES:
        return DTYPE_NAMES[value.lower()]
    if isinstance(value, str) and value.lower() == "auto":
        return "auto"
    half = " (fp16 is not supported: use bf16 for half-precision memory)" if str(value).lower() in HALF_NAMES else ""
    raise InputError(f"unsupported dtype {value!r}{half}: use 'fp32' / 'float32' / torch.float32, "
                     "'bf16' / 'bfloat16' / torch.bfloat16, or 'auto'")


def normalize_device(value: Any) -> str:
    """``"cpu"`` or ``"cuda:N"`` from ``None`` / ``"auto"`` (CUDA when present), ``"cpu"``,
    ``"cuda"``, ``"cuda:N"``, an int (CUDA index) or a ``torch.device``.

    Raises:
        InputError: CUDA asked for but absent, an index beyond the visible GPUs, a device map
            that splits the model (a dict), or another device type.
    """
    if value is None or value == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    if isinstance(value, dict):
        raise InputError("a device_map dict (a model split across devices) is not supported: pass one device, "
                         "device='cpu' or device='cuda:0'")
    if isinstance(value, bool):
        raise InputTypeError("device must be 'cpu', 'cuda', 'cuda:N', 'auto' or an int GPU index")
    if isinstance(value, int):
        value = f"cuda:{value}"
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError) as exc:
        raise InputError(f"unknown device {value!r}: use 'cpu', 'cuda', 'cuda:N' or 'auto'") from exc
    if device.type == "cpu":
        return "cpu"
    if device.type != "cuda":
        raise InputError(f"device {value!r} is not supported: use 'cpu', 'cuda', 'cuda:N' or 'auto'")
    if not torch.cuda.is_available():
        raise InputError(f"device {value!r} asked for CUDA but torch sees no GPU (torch {torch.__version__}): "
                         "use device='cpu', or install a CUDA build of torch on a machine with a GPU")
    index = device.index or 0
    if index >= torch.cuda.device_count():
        raise InputError(f"device {value!r}: only {torch.cuda.device_count()} GPU(s) visible")
    return f"cuda:{index}"


def fold_aliases(values: dict[str, Any], where: str) -> dict[str, Any]:
    """``values`` with aliases renamed to their field and ``model_kwargs`` merged in.

    Raises:
        InputError: an alias and its field both given with different values, or
            ``model_kwargs`` that is not a dict.
    """
    out = dict(values)
    extra = out.pop("model_kwargs", None) or {}
    if not isinstance(extra, dict):
        raise InputTypeError(f"model_kwargs must be a dict (got {type(extra).__name__})")
    for key, value in extra.items():
        if key in out and out[key] != value:
            raise InputError(f"{key!r} given both directly and in model_kwargs ({where}): give it once")
        out[key] = value
    for alias, field in ALIASES.items():
        if alias in out:
            value = out.pop(alias)
            if field in out and out[field] != value:
                raise InputError(f"{alias}={value!r} and {field}={out[field]!r} both given ({where}): "
                                 f"{alias} is another name for {field}, give one")
            out.setdefault(field, value)
    return out


def reject_unknown(keys: Iterable[str], known: Iterable[str], where: str) -> None:
    """Raise for any key outside ``known``, suggesting the closest known name.

    Raises:
        InputError: naming each unknown key and what to use instead.
    """
    known = sorted(set(known))
    unknown = [k for k in keys if k not in known]
    if not unknown:
        return
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key, known + list(ALIASES), n=1)
        hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise InputError(f"ChatKVMemory does not know {', '.join(hints)} ({where}); accepted: {', '.join(known)}")
