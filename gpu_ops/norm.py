"""RMSNorm, computed in float32 and cast back: as Llama defines it, or as Gemma does where the weight is float32."""

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, hidden]; weight: [hidden]. The weight's dtype says where the result is rounded to x's dtype:
    x's dtype (Llama) rounds the normed row, then scales it; float32 (Gemma's (1 + w), whose norm keeps the
    scale in float32) scales in float32 and rounds the product once."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype == torch.float32:
        return (h * weight).to(x.dtype)
    return weight * h.to(x.dtype)


def add_rms_norm_ref(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the RMSNorm after it: h += delta (in place), -> (h, rms_norm_ref(h))."""
    h += delta
    return h, rms_norm_ref(h, weight, eps)
