"""Routed experts computed by a loop over the experts that got tokens: the reference for every MoE path."""

from __future__ import annotations

from collections.abc import Callable

import torch


def routed_sum(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, num_experts: int,
               expert: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Σ_j weights[t, j] · expert(ids[t, j], x[t]) for x [T, H] and ids / weights [T, k], with one batched
    call per expert that got tokens. Counting them syncs with the host: eager code only (an opaque op's body)."""
    top_k = ids.shape[1]
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    flat_weights = weights.reshape(-1)
    start = 0
    for index, count in enumerate(counts):
        if count:
            rows = order[start : start + count]
            tokens = rows // top_k
            out.index_add_(0, tokens, expert(index, x[tokens]).float() * flat_weights[rows, None])
            start += count
    return out.to(x.dtype)
