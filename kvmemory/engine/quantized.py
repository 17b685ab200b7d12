"""GGUF weight blocks kept as they are shipped, and the CPU kernel that multiplies by them.

The embedded SmolLM2's fp32 weights *are* the dequantized blocks of its packaged GGUF (linears
Q4_1, the tied embedding / head Q8_0). Keeping the blocks moves 1/5 of the bytes per decoded
token at the same weights: ``x @ dequantize(blocks).T`` equals ``x @ W.T`` up to fp32 rounding.
The kernel (``quantized_linear.cpp``) is compiled on first use with the machine's C++ compiler
(torch.utils.cpp_extension, ~30-60 s once, cached under kvmemory's cache folder in a folder
named by a hash of the source and flags), for one instruction set (:data:`ISAS`): the best this
CPU runs, or the one ``KVMEMORY_ISA`` names (see :func:`kernel_isa`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import platform
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import EngineUnsupportedError
from ..paths import cache_root
from .buffers import huge_pages

log = logging.getLogger(__name__)

BLOCK = 32  # weights per block (both forms; Q6_K's byte codes have a scale per 16)

# The kernel's instruction sets, best first, and the compiler flags of each. "portable": the
# compiler's default target (baseline x86-64, or the platform's default elsewhere, e.g. ARM).
ISAS = ("avx512", "avx2", "portable")
_ISA_FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "portable": [],
}
# /proc/cpuinfo flags each ISA's build needs (checked where Linux lists them)
_ISA_CPU_FLAGS = {
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c"},
    "avx2": {"avx2", "fma", "f16c"},
    "portable": set(),
}

_kernels: dict[str, object] = {}  # ISA -> built module
_kernel_errors: dict[str, str] = {}  # ISA -> why its build failed (not retried)
_kernel_lock = threading.Lock()


class KernelUnavailableError(EngineUnsupportedError):
    """The quantized-linear kernel could not be compiled or loaded here (the message says why)."""


def kernel(isa: str | None = None):
    """The compiled kernel module (``q4_1_linear``, ``q8_0_linear``, ``LlamaDecoder``; its
    ``isa()`` names the SIMD paths it compiled) for instruction set ``isa`` (one of :data:`ISAS`;
    None: :func:`kernel_isa`, which reads ``KVMEMORY_ISA`` on every call). Built once per ISA per
    process.

    Raises:
        KernelUnavailableError: ``isa`` / ``KVMEMORY_ISA`` unknown or beyond this CPU; no C++
            compiler / headers, or the build failed (the reason is kept and raised again on later
            calls for that ISA without retrying).
    """
    isa = _checked_isa(isa if isa is not None else _requested_isa())
    with _kernel_lock:
        if isa not in _kernels and isa not in _kernel_errors:
            try:
                _kernels[isa] = _build(isa)
            except Exception as exc:  # compiler missing, headers missing, build error: all mean "no kernel"
                _kernel_errors[isa] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
                log.warning("kvmemory: quantized-linear kernel (%s) unavailable: %s", isa, _kernel_errors[isa])
        if isa not in _kernels:
            raise KernelUnavailableError(f"the quantized-linear kernel ({isa}) could not be built: {_kernel_errors[isa]}")
        return _kernels[isa]


def kernel_isa() -> str:
    """The instruction set :func:`kernel` builds for by default: ``KVMEMORY_ISA`` when set
    (``avx512``, ``avx2`` or ``portable``), else the best of :func:`cpu_isas`.

    Raises:
        KernelUnavailableError: ``KVMEMORY_ISA`` unknown or beyond this CPU.
    """
    return _checked_isa(_requested_isa())


@functools.lru_cache(maxsize=1)
def cpu_isas() -> tuple[str, ...]:
    """The kernel instruction sets this CPU runs, best first (``"portable"`` always; only it on
    non-x86 machines). From torch's CPU capability (``"AVX512"``, ``"AVX2"``, ...), and on Linux
    also the flags /proc/cpuinfo lists."""
    if not _on_x86():
        return ("portable",)
    capability = torch.backends.cpu.get_cpu_capability()
    runs = {"avx512": capability == "AVX512", "avx2": capability in ("AVX512", "AVX2"), "portable": True}
    flags = _cpu_flags()
    if flags:
        runs = {isa: ok and _ISA_CPU_FLAGS[isa] <= flags for isa, ok in runs.items()}
    return tuple(isa for isa in ISAS if runs[isa])


def isa_flags(isa: str) -> list[str]:
    """The instruction-set flags ``isa``'s build gets on this CPU (avx512 adds -mavx512vnni where
    the CPU has VNNI: the int8-activation paths need it)."""
    return _ISA_FLAGS[isa] + (["-mavx512vnni"] if isa == "avx512" and "avx512_vnni" in _cpu_flags() else [])


def _on_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "x86", "i386", "i686")


def _requested_isa() -> str:
    return os.environ.get("KVMEMORY_ISA", "").strip().lower() or cpu_isas()[0]


def _checked_isa(isa: str) -> str:
    if isa not in ISAS:
        raise KernelUnavailableError(f"KVMEMORY_ISA / isa must be one of {', '.join(ISAS)} (got {isa!r})")
    if isa not in cpu_isas():
        raise KernelUnavailableError(
            f"this CPU cannot run the {isa} kernel (it runs {', '.join(cpu_isas())}; unset KVMEMORY_ISA or pick one of those)")
    return isa


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (empty elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def _build(isa: str):
    from torch.utils.cpp_extension import load

    source = Path(__file__).with_name("quantized_linear.cpp")
    # explicit ISA flags, not -march=native: one source builds every ISA on any x86 machine, and a
    # build never uses instructions of a newer CPU than its name says. -mtune=native only schedules
    # for this CPU (2-4 % faster decode steps than generic tuning on an AMD EPYC; runs anywhere).
    # -fopenmp: at::parallel_for splits work over torch's threads only in an OpenMP build (without
    # it the pragma is ignored and every kernel runs on one thread)
    tune = ["-mtune=native"] if _on_x86() else []
    flags = ["-O3", *isa_flags(isa), *tune, "-fopenmp",
             "-ffast-math" if os.environ.get("KVMEMORY_FAST_MATH") else "-fno-fast-math"]
    # one folder (and module name) per source text and flags: two checkouts of different versions
    # on one machine never load each other's build
    digest = hashlib.sha256(source.read_bytes() + "\0".join(flags).encode()).hexdigest()[:12]
    folder = cache_root() / "kernels" / f"torch-{torch.__version__}-{isa}-{digest}"
    folder.mkdir(parents=True, exist_ok=True)
    return load(name=f"kvmemory_quantized_linear_{isa}_{digest}", sources=[str(source)], extra_cflags=flags,
                extra_ldflags=["-fopenmp"], build_directory=str(folder), verbose=False)


@dataclass
class Q4Linear:
    """Q4_1 weight ``[out, in]`` as blocks: ``codes`` uint8 ``[out, in/32*16]`` (GGUF nibble
    order), ``scales`` / ``mins`` fp32 ``[out, in/32]`` (w = scale * code + min)."""

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.scales.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.mins))

    def __call__(self, x: torch.Tensor, int8: bool = False, lib=None) -> torch.Tensor:
        """``x`` fp32 ``[M, in]`` -> fp32 ``[M, out]``. ``int8``: quantize ``x`` to int8 per
        32-value block first and multiply with VNNI integer dot products (lossy, see the kernel).
        ``lib``: the kernel module to run (an engine's own ISA); None: :func:`kernel`."""
        lib = lib or kernel()
        if int8:
            return lib.q4_1_linear_i8(x.contiguous(), self.codes, self.scales, self.mins)
        return lib.q4_1_linear(x.contiguous(), self.codes, self.scales, self.mins)

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight ``[out, in]`` these blocks encode."""
        out, _ = self.shape
        q = self.codes.view(out, -1, 16)
        codes = torch.cat([q & 0xF, q >> 4], dim=-1).float()  # [out, blocks, 32]
        return (codes * self.scales[..., None] + self.mins[..., None]).reshape(out, -1)

    def rows(self, index: torch.Tensor) -> "Q4Linear":
        return Q4Linear(self.codes[index].contiguous(), self.scales[index].contiguous(), self.mins[index].contiguous())

    @staticmethod
    def concat(parts: list["Q4Linear"]) -> "Q4Linear":
        """One weight whose output rows are ``parts``' rows in order (fused QKV, gate-up)."""
        return Q4Linear(*(torch.cat([getattr(p, f) for p in parts]).contiguous() for f in ("codes", "scales", "mins")))


@dataclass
class Q8Linear:
    """Byte-code weight ``[out, in]``: ``codes`` int8 ``[out, in]``, ``scales`` fp32 ``[out, in/32]``
    (Q8_0, Q5_0) or ``[out, in/16]`` (Q6_K's 16-value sub-blocks); w = scale * code. ``mins``: empty,
    or fp32 ``[out, in/32]`` (Q5_K) with w = scale * code + min."""

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor = dataclasses.field(default_factory=lambda: torch.empty(0))

    def __post_init__(self):
        if self.has_mins and (self.mins.shape != self.scales.shape or self.block != BLOCK):
            raise ValueError(f"byte codes' mins must be [out, in/32] like their scales (got {tuple(self.mins.shape)} "
                             f"beside scales {tuple(self.scales.shape)})")

    @property
    def has_mins(self) -> bool:
        return self.mins.numel() > 0

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + (self.scales.numel() + self.mins.numel()) * 4

    def __call__(self, x: torch.Tensor, int8: bool = False, lib=None) -> torch.Tensor:
        """``x`` fp32 ``[M, in]`` -> fp32 ``[M, out]`` (``int8``, ``lib`` as for :class:`Q4Linear`)."""
        lib = lib or kernel()
        if int8:
            return lib.q8_0_linear_i8(x.contiguous(), self.codes, self.scales, self.mins)
        return lib.q8_0_linear(x.contiguous(), self.codes, self.scales, self.mins)

    @property
    def block(self) -> int:
        """Weights per scale: 32, or 16 (Q6_K)."""
        return self.codes.shape[1] // self.scales.shape[1]

    def dequantize(self) -> torch.Tensor:
        out, width = self.shape
        weight = self.codes.view(out, -1, self.block).float() * self.scales[..., None]
        return (weight + self.mins[..., None] if self.has_mins else weight).reshape(out, width)

    def rows(self, index: torch.Tensor) -> "Q8Linear":
        return Q8Linear(self.codes[index].contiguous(), self.scales[index].contiguous(),
                        self.mins[index].contiguous() if self.has_mins else self.mins)

    @staticmethod
    def concat(parts: list["Q8Linear"]) -> "Q8Linear":
        """One weight whose output rows are ``parts``' rows in order (same block size, all with
        mins or none)."""
        fields = ("codes", "scales", "mins") if parts[0].has_mins else ("codes", "scales")
        return Q8Linear(*(torch.cat([getattr(p, f) for p in parts]).contiguous() for f in fields))


@dataclass
class F16Linear:
    """An F16 linear's weight ``[out, in]`` as the file stores it: ``codes`` fp16 ``[out, in]`` (the
    values themselves, no blocks; 2 bytes per weight). Multiplied in fp32 (the int8-activation
    engines run these linears in fp32 too)."""

    codes: torch.Tensor

    def __post_init__(self):
        if self.codes.dtype != torch.float16 or self.codes.dim() != 2:
            raise ValueError(f"an F16 weight is an fp16 [out, in] tensor (got {self.codes.dtype} {tuple(self.codes.shape)})")

    # the kernel's (codes, scales, mins) triple of a linear: no scales, no mins
    scales = property(lambda self: torch.empty(0))
    mins = property(lambda self: torch.empty(0))

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def nbytes(self) -> int:
        return self.codes.numel() * 2

    def __call__(self, x: torch.Tensor, int8: bool = False, lib=None) -> torch.Tensor:
        """``x`` fp32 ``[M, in]`` -> fp32 ``[M, out]`` (``int8`` is ignored: fp32 products)."""
        return (lib or kernel()).f16_linear(x.contiguous(), self.codes)

    def dequantize(self) -> torch.Tensor:
        return self.codes.float()

    def rows(self, index: torch.Tensor) -> "F16Linear":
        return F16Linear(self.codes[index].contiguous())

    @staticmethod
    def concat(parts: list["F16Linear"]) -> "F16Linear":
        return F16Linear(torch.cat([p.codes for p in parts]).contiguous())


@dataclass
class FusedBlocks:
    """One linear of the engine: output rows of ``parts`` one after another (q, k, v or gate, up
    fused; adjacent parts of one form are concatenated, a file may quantize them differently),
    plus an optional fp32 ``bias`` ``[out]`` (Qwen2's q/k/v biases)."""

    parts: list
    bias: torch.Tensor | None = None

    @classmethod
    def of(cls, linears: list, bias: torch.Tensor | None = None) -> "FusedBlocks":
        parts: list = []
        for linear in linears:
            if parts and _same_form(parts[-1], linear):
                parts[-1] = type(linear).concat([parts[-1], linear])
            else:
                parts.append(linear)
        return cls(parts, None if bias is None else bias.detach().float().contiguous())

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts) + (0 if self.bias is None else self.bias.numel() * 4)

    @property
    def has_halves(self) -> bool:
        """Whether a part has 16-value blocks (no int8-activation kernel for them)."""
        return any(isinstance(p, Q8Linear) and p.block == 16 for p in self.parts)

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight ``[out, in]`` the parts encode (the bias is not part of it)."""
        return torch.cat([p.dequantize() for p in self.parts])

    def __call__(self, x: torch.Tensor, int8: bool = False, lib=None) -> torch.Tensor:
        """``x`` fp32 ``[M, in]`` -> fp32 ``[M, out]`` (``int8``, ``lib`` as for :class:`Q4Linear`)."""
        outs = [p(x, int8=int8, lib=lib) for p in self.parts]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return y if self.bias is None else y + self.bias

    def kernel_tensors(self) -> list[torch.Tensor]:
        """(codes, scales, mins) per part (an empty mins for byte codes without), then the bias if any: the
        compiled decoder's form of this linear."""
        tensors = [t for p in self.parts for t in (p.codes, p.scales, p.mins)]
        return tensors + ([self.bias] if self.bias is not None else [])


def _same_form(a, b) -> bool:
    return type(a) is type(b) and (not isinstance(a, Q8Linear) or (a.block, a.has_mins) == (b.block, b.has_mins))


def on_huge_pages(linears: list) -> list:
    """Copies of ``linears`` (:class:`Q4Linear` / :class:`Q8Linear` / :class:`F16Linear`) whose tensors lie one after
    another in one buffer that Linux may back with 2 MB pages (:func:`~kvmemory.engine.buffers.huge_pages`).
    A decoded token streams every block once (~110 MB for SmolLM2); in 4 KB pages that is ~27,000
    TLB misses per token. Same values, same shapes; a hint only (nothing changes where it is not granted)."""
    tensors = [getattr(lin, f.name) for lin in linears for f in dataclasses.fields(lin)]
    sizes = [-(-t.numel() * t.element_size() // 64) * 64 for t in tensors]  # 64-byte aligned slots
    arena = torch.empty(sum(sizes), dtype=torch.uint8)
    huge_pages(arena)
    moved, offset = [], 0
    for tensor, size in zip(tensors, sizes):
        view = arena[offset:offset + tensor.numel() * tensor.element_size()].view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor)
        moved.append(view)
        offset += size
    parts = iter(moved)
    return [type(lin)(*(next(parts) for _ in dataclasses.fields(lin))) for lin in linears]
