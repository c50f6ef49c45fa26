"""RMSNorm, computed in float32 and cast back as Llama defines it."""

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, hidden]; weight: [hidden]."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm_ref(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the RMSNorm after it: h += delta (in place), -> (h, rms_norm_ref(h))."""
    h += delta
    return h, rms_norm_ref(h, weight, eps)
