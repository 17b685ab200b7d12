"""Shift: exact RoPE position correction of cached keys (paper §7.1, eq. 2).

After a span of width d is deleted from the history, every retained suffix key moves from
position i to i − d. Rotary position embeddings make a key's position a rotation, so the key
can be moved without recomputation:

    K̃_{i−d} = R_{i−d} (R_i)^{-1} K_i,    Ṽ_{i−d} = V_i        (§7.1 eq. 2)

R must be the model's own rotary map, including its rope_type scaling; the angles are therefore
taken from the model's own rotary embedding module rather than recomputed here. Shift only fixes
coordinates: the suffix still carries the deleted span's influence (that is what refresh is for).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .capabilities import longrope_boundary, rope_parameter_sets, shift_unsupported_reason
from .errors import InputTypeError, ShiftUnsupportedError

@dataclass(frozen=True)
class ShiftCoefficients:
    """Per-token rotation from old to new positions, reusable across layers.

    ``cos_delta`` and ``sin_delta`` are fp32 ``[n, head_dim // 2]``: cos and sin of the (new − old)
    angle of each rotary frequency (in the rotate_half layout, dims j and j + head_dim/2 share it).
    """

    cos_delta: torch.Tensor
    sin_delta: torch.Tensor


def _find_rotary_module(model) -> torch.nn.Module | None:
    """The model's shared rotary embedding module (``rotary_emb`` on the decoder in transformers)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    for owner in (decoder, getattr(model, "base_model", None), model):
        rotary = getattr(owner, "rotary_emb", None)
        if isinstance(rotary, torch.nn.Module):
            return rotary
    return None


class RotaryShifter:
    """Moves cached RoPE keys to new positions with the model's own rotary map (§7.1 eq. 2).

    Built once per model; per edit call :meth:`coefficients` once, then :meth:`apply` per layer
    (or :meth:`shift` for both). Values are never touched: Ṽ_{i−d} = V_i.
    """

    def __init__(self, model):
        """Wrap a loaded transformers causal LM.

        Raises:
            ShiftUnsupportedError: the config's RoPE cannot be shifted exactly (see
                :func:`shift_unsupported_reason`), no rotary module is found, or the rotary module
                does not use the rotate_half layout over the full head dimension.
        """
        self.config = model.config.get_text_config()
        reason = shift_unsupported_reason(self.config)
        if reason is not None:
            raise ShiftUnsupportedError(reason)
        self.rotary = _find_rotary_module(model)
        if self.rotary is None:
            raise ShiftUnsupportedError(f"no rotary embedding module found on {type(model).__name__}")
        self.head_dim: int = getattr(self.config, "head_dim", None) or (
            self.config.hidden_size // self.config.num_attention_heads
        )
        self._param_sets = rope_parameter_sets(self.config)
        self.layer_types: tuple[str | None, ...] = tuple(self._param_sets)
        for layer_type in self.layer_types:
            self._check_layout(layer_type)

    def layer_type(self, layer_idx: int) -> str | None:
        """The ``layer_type`` to pass to :meth:`coefficients` for decoder layer ``layer_idx``
        (None when all layers share one RoPE)."""
        return None if self.layer_types == (None,) else self.config.layer_types[layer_idx]

    @torch.no_grad()
    def _cos_sin(self, positions: torch.Tensor, layer_type: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos, sin ``[n, head_dim]`` from the model's rotary module (scaling included)."""
        buffer = next(iter(self.rotary.buffers()), None)  # inv_freq follows model.to(device)
        device = buffer.device if buffer is not None else torch.device("cpu")
        # the module only reads x's device and dtype; fp32 keeps the angles at full precision
        x = torch.empty(0, dtype=torch.float32, device=device)
        pos = positions.to(device=device, dtype=torch.long)[None]
        extra = () if layer_type is None else (layer_type,)
        cos, sin = self.rotary(x, pos, *extra)
        return cos[0].float(), sin[0].float()

    def _check_layout(self, layer_type: str | None) -> None:
        # rotate_half models build cos as cat(freqs, freqs); interleaved (GPT-J style) or partial
        # layouts would make the formula in apply() rotate the wrong coordinate pairs
        cos, _ = self._cos_sin(torch.tensor([1, 7]), layer_type)
        half = cos.shape[-1] // 2
        if cos.shape[-1] != self.head_dim or not torch.equal(cos[:, :half], cos[:, half:]):
            raise ShiftUnsupportedError(
                f"rotary module {type(self.rotary).__name__} does not use the rotate_half layout over the "
                f"full head_dim={self.head_dim}"
            )

    def coefficients(
        self, old_positions: torch.Tensor, new_positions: torch.Tensor, layer_type: str | None = None
    ) -> ShiftCoefficients:
        """Rotation R_new R_old^{-1} for each token (§7.1 eq. 2), to reuse across layers.

        With c = m·cos φ and s = m·sin φ from the rotary module (m = attention_scaling, e.g. yarn's
        mscale), R_new R_old^{-1} has cos Δ = (c_n c_o + s_n s_o)/(c_o² + s_o²) and
        sin Δ = (s_n c_o − c_n s_o)/(c_o² + s_o²), so m cancels exactly.

        Args:
            old_positions: LongTensor ``[n]``, 0-based token positions the keys were computed at.
            new_positions: LongTensor ``[n]``, 0-based positions to move them to (usually old − d).
            layer_type: for models with per-layer-type RoPE (``self.layer_types``), which one;
                see :meth:`layer_type`.

        Returns:
            :class:`ShiftCoefficients` with fp32 ``[n, head_dim // 2]`` tensors on the rotary module's
            device.

        Raises:
            InputTypeError (TypeError): positions that are not integer tensors.
            ValueError: positions are not 1-D of equal length, or are negative, or ``layer_type``
                is missing/unknown for a per-layer-type model.
            ShiftUnsupportedError: longrope with old and new positions on different sides of
                ``original_max_position_embeddings``.
        """
        for name, pos in (("old_positions", old_positions), ("new_positions", new_positions)):
            if not isinstance(pos, torch.Tensor) or pos.dtype.is_floating_point or pos.dtype.is_complex or pos.dtype == torch.bool:
                got = pos.dtype if isinstance(pos, torch.Tensor) else type(pos).__name__
                raise InputTypeError(f"{name} must be an integer tensor of token positions (got {got}): "
                                     "use torch.tensor(..., dtype=torch.long)")
        if old_positions.dim() != 1 or old_positions.shape != new_positions.shape:
            raise ValueError(
                f"positions must be 1-D of equal length, got {tuple(old_positions.shape)} and "
                f"{tuple(new_positions.shape)}"
            )
        if old_positions.numel() and min(int(old_positions.min()), int(new_positions.min())) < 0:
            raise ValueError("positions must be >= 0")
        if layer_type not in self._param_sets:
            raise ValueError(f"layer_type must be one of {self.layer_types}, got {layer_type!r}")
        n = old_positions.numel()
        if n == 0:  # nothing to move (and longrope's regime switch cannot take max() of nothing)
            empty = torch.empty(0, self.head_dim // 2)
            return ShiftCoefficients(cos_delta=empty, sin_delta=empty)
        self._check_longrope_side(old_positions, new_positions, layer_type)
        # one call for old and new: longrope picks one factor set per call (from the largest position)
        cos, sin = self._cos_sin(torch.cat([old_positions, new_positions]), layer_type)
        # rotate_half layout repeats each frequency in both halves; keep one copy
        half = cos.shape[-1] // 2
        c_o, s_o, c_n, s_n = cos[:n, :half], sin[:n, :half], cos[n:, :half], sin[n:, :half]
        norm = c_o * c_o + s_o * s_o  # = m², attention_scaling squared
        return ShiftCoefficients(
            cos_delta=(c_n * c_o + s_n * s_o) / norm,
            sin_delta=(s_n * c_o - c_n * s_o) / norm,
        )

    def _check_longrope_side(self, old: torch.Tensor, new: torch.Tensor, layer_type: str | None) -> None:
        params = self._param_sets[layer_type]
        if params.get("rope_type") != "longrope":
            return
        boundary = longrope_boundary(params)
        # transformers uses long factors when a call's largest position + 1 exceeds the boundary
        if (int(old.max()) + 1 > boundary) != (int(new.max()) + 1 > boundary):
            raise ShiftUnsupportedError(
                f"rope_type 'longrope' uses different factor sets for old (max {int(old.max())}) and new "
                f"(max {int(new.max())}) positions around original_max_position_embeddings={boundary}"
            )

    def apply(self, keys: torch.Tensor, coeffs: ShiftCoefficients) -> torch.Tensor:
        """Rotate keys by precomputed coefficients (§7.1 eq. 2); fp32 math, result in keys' dtype.

        Args:
            keys: ``[batch, kv_heads, n, head_dim]`` post-RoPE cached keys, any float dtype.
            coeffs: from :meth:`coefficients` for the same n tokens.

        Returns:
            A new tensor shaped and typed like ``keys``; ``keys`` is not modified.

        Raises:
            InputTypeError (TypeError): ``keys`` is not floating point.
            ValueError: ``keys`` is not 4-D or its (n, head_dim) do not match ``coeffs``.
        """
        n, half = coeffs.cos_delta.shape
        if not keys.dtype.is_floating_point:
            raise InputTypeError(f"keys must be a floating-point tensor (got {keys.dtype}): pass the cache's K rows")
        if keys.dim() != 4 or tuple(keys.shape[-2:]) != (n, 2 * half):
            raise ValueError(
                f"keys must be [batch, kv_heads, n, head_dim] with (n, head_dim)={(n, 2 * half)}, "
                f"got {tuple(keys.shape)}"
            )
        cos = coeffs.cos_delta.to(keys.device)
        sin = coeffs.sin_delta.to(keys.device)
        k = keys.float()
        k1, k2 = k[..., :half], k[..., half:]
        # k·cos Δ + rotate_half(k)·sin Δ, written per half into one buffer (fewer passes than cat)
        out = torch.empty_like(k)
        torch.mul(k1, cos, out=out[..., :half]).addcmul_(k2, sin, value=-1.0)
        torch.mul(k2, cos, out=out[..., half:]).addcmul_(k1, sin)
        return out.to(keys.dtype)

    def shift(
        self,
        keys: torch.Tensor,
        old_positions: torch.Tensor,
        new_positions: torch.Tensor,
        layer_type: str | None = None,
    ) -> torch.Tensor:
        """Move cached keys from old to new positions: K̃_new = R_new R_old^{-1} K_old (§7.1 eq. 2).

        Args:
            keys: ``[batch, kv_heads, n, head_dim]`` post-RoPE keys of one layer, any float dtype.
            old_positions: LongTensor ``[n]``, positions the keys were computed at (0-based tokens).
            new_positions: LongTensor ``[n]``, target positions.
            layer_type: see :meth:`coefficients`.

        Returns:
            Rotated keys, same shape and dtype as ``keys`` (computed in fp32).

        Raises:
            ValueError, ShiftUnsupportedError: as :meth:`coefficients` and :meth:`apply`.
        """
        return self.apply(keys, self.coefficients(old_positions, new_positions, layer_type))
