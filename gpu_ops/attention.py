"""Attention over the paged KV cache: writing a step's K and V into their pages, and causal
attention of each sequence's new queries over its cached positions (prefill and decode alike), all of them
or, on a sliding-window layer, the last `window`, with Gemma 2's soft-capped scores where asked.

The reference gathers each sequence's pages and calls SDPA; the GPU kernels read pages in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from lorad.gpu_ops import fp8


@dataclass
class AttentionBatch:
    """Built once per step. Sequences are laid out one after another in the step's rows.

    block_table: int32 [L, 2, S, max_blocks] page ids (K, V) of each sequence's blocks, per layer.
    dest_pages:  int64 [L, 2, T] the K and V page each new token is written to; dest_offsets: int64 [T].
    query_start, query_len, kv_len: host lists per sequence (kv_len includes the new tokens).
    """

    block_table: torch.Tensor
    dest_pages: torch.Tensor
    dest_offsets: torch.Tensor
    query_start: list[int]
    query_len: list[int]
    kv_len: list[int]

    @classmethod
    def from_block_table(cls, table: np.ndarray, shapes: list[tuple[int, int]], tokens_per_page: int,
                         device: torch.device) -> AttentionBatch:
        """The batch of sequences of (kv_len, query_len) whose pages are `table` ([L, 2, S, max_blocks]),
        their new tokens being the last query_len positions of each."""
        dest, offsets, starts, start = [], [], [], 0
        for seq, (kv_len, query_len) in enumerate(shapes):
            positions = np.arange(kv_len - query_len, kv_len)
            dest.append(table[:, :, seq, positions // tokens_per_page])
            offsets.append(positions % tokens_per_page)
            starts.append(start)
            start += query_len
        return cls(
            block_table=torch.from_numpy(table).to(device),
            dest_pages=torch.from_numpy(np.concatenate(dest, axis=2).astype(np.int64)).to(device),
            dest_offsets=torch.from_numpy(np.concatenate(offsets).astype(np.int64)).to(device),
            query_start=starts,
            query_len=[query_len for _, query_len in shapes],
            kv_len=[kv_len for kv_len, _ in shapes],
        )


def scattered_block_table(blocks: list[int], layers: int, num_pages: int, rng: np.random.Generator) -> np.ndarray:
    """A block table [layers, 2, len(blocks), max(blocks)] whose pages are drawn at random from pages
    1..num_pages-1, as a long-running pool hands them out (page 0 pads): the kernel tests and benchmarks
    read pages scattered over the pool, never one contiguous run."""
    page_ids = rng.permutation(np.arange(1, num_pages, dtype=np.int32))
    table = np.zeros((layers, 2, len(blocks), max(blocks)), dtype=np.int32)
    used = 0
    for seq, count in enumerate(blocks):
        table[:, :, seq, :count] = page_ids[used : used + 2 * layers * count].reshape(layers, 2, count)
        used += 2 * layers * count
    return table


def write_kv_ref(kv_view: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch,
                 kv_scales: torch.Tensor | None = None) -> None:
    """kv_view: [num_pages, tokens_per_page, kv_heads, head_dim]; k, v: [T, kv_heads, head_dim]. FP8 pages
    (gpu_ops/fp8.py) hold k / kv_scales[layer, 0] and v / kv_scales[layer, 1] (kv_scales: float32 [L, 2])."""
    if kv_view.dtype == fp8.FP8:
        k, v = fp8.to_kv(k, kv_scales[layer, 0]), fp8.to_kv(v, kv_scales[layer, 1])
    kv_view[batch.dest_pages[layer, 0], batch.dest_offsets] = k
    kv_view[batch.dest_pages[layer, 1], batch.dest_offsets] = v


def paged_attention_ref(
    q: torch.Tensor, kv_view: torch.Tensor, layer: int, batch: AttentionBatch, scale: float,
    window: int | None = None, softcap: float | None = None, *, kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, heads, head_dim] -> [T, heads * head_dim]. Causal: the i-th new token of a sequence, at
    position p = kv_len - query_len + i, sees the positions up to p; with a sliding `window` only those in
    (p - window, p] (HF's convention for Mistral and Gemma), and the pages wholly before the first query's
    window are not read. softcap (Gemma 2): each score s = q.k * scale becomes softcap * tanh(s / softcap).
    FP8 pages are read times kv_scales[layer] (see write_kv_ref)."""
    tokens, heads, head_dim = q.shape
    kv_heads = kv_view.shape[2]
    tokens_per_page = kv_view.shape[1]
    out = torch.empty(tokens, heads * head_dim, dtype=q.dtype, device=q.device)
    for seq, (start, length, kv_len) in enumerate(zip(batch.query_start, batch.query_len, batch.kv_len)):
        first_block = 0 if window is None else max(0, kv_len - length - window + 1) // tokens_per_page
        blocks = -(-kv_len // tokens_per_page)
        k_pages = batch.block_table[layer, 0, seq, first_block:blocks].long()
        v_pages = batch.block_table[layer, 1, seq, first_block:blocks].long()
        first = first_block * tokens_per_page  # the position of the first key read
        k = kv_view[k_pages].reshape(-1, kv_heads, head_dim)[: kv_len - first]
        v = kv_view[v_pages].reshape(-1, kv_heads, head_dim)[: kv_len - first]
        if kv_view.dtype == fp8.FP8:
            k, v = fp8.from_kv(k, kv_scales[layer, 0], q.dtype), fp8.from_kv(v, kv_scales[layer, 1], q.dtype)
        if kv_heads != heads:
            k = k.repeat_interleave(heads // kv_heads, dim=1)
            v = v.repeat_interleave(heads // kv_heads, dim=1)
        query_pos = torch.arange(kv_len - length, kv_len, device=q.device)[:, None]
        key_pos = torch.arange(first, kv_len, device=q.device)[None, :]
        mask = key_pos <= query_pos
        if window is not None:
            mask &= key_pos > query_pos - window
        queries, k, v = q[start : start + length].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        if softcap is None:
            attended = F.scaled_dot_product_attention(queries, k, v, attn_mask=mask, scale=scale)
        else:  # SDPA cannot cap its scores: the softmax written out, in float32 as HF's eager Gemma 2
            scores = (queries @ k.transpose(1, 2)).float() * scale
            scores = softcap * torch.tanh(scores / softcap)
            probabilities = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
            attended = probabilities.to(v.dtype) @ v
        out[start : start + length] = attended.transpose(0, 1).reshape(length, heads * head_dim)
    return out
