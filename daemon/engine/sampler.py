"""Turning a step's logits into tokens: greedy rows in one argmax, the rest with temperature, top-k
and top-p, each request drawing from its own generator when it gave a seed."""

from __future__ import annotations

import torch

from lorad.daemon.engine.request import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """logits: [N, vocab] float32 -> N token ids."""
    tokens = logits.argmax(dim=-1)
    for row, (p, generator) in enumerate(zip(params, generators)):
        if not p.greedy:
            tokens[row] = _sample_row(logits[row], p, generator)
    return tokens.tolist()


def _sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        outside = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
        sorted_probs[outside] = 0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    # Draw on the CPU so that a seed gives the same tokens on every device.
    return int(torch.multinomial(probs.cpu(), 1, generator=generator).item())


def make_generator(p: SamplingParams) -> torch.Generator | None:
    if p.greedy or p.seed is None:
        return None
    generator = torch.Generator()
    generator.manual_seed(p.seed)
    return generator
