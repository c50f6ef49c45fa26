"""Rotary position embedding (the half-split layout of HF Llama checkpoints)."""

import torch


def rope_cache(inv_freq: torch.Tensor, max_positions: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [max_positions, head_dim], computed in float32 and cast once."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)


def apply_rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos, sin: [T, rotary_dim] (the rows of each token's position). rotary_dim <
    head_dim (partial_rotary_factor): the half-split rotation of the first rotary_dim dimensions, the rest kept."""
    rotary = cos.shape[-1]
    x_rot = x[..., :rotary]
    half = rotary // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    out = x_rot * cos[:, None, :] + rotated * sin[:, None, :]
    return out if rotary == x.shape[-1] else torch.cat((out, x[..., rotary:]), dim=-1)
