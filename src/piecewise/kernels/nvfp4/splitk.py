"""Split-K tile counters shared by the W4A16 kernels that reduce their K splits in one launch.

Each split stores a float32 partial tile; the last split of a tile to arrive (an acq_rel counter) adds the
partials in split order (deterministic) and resets the counter to zero, so the counters stay zeroed between
launches and inside CUDA-graph replays.
"""

from __future__ import annotations

import torch

# Split-K tile counters: one int32 per output tile, per lane; each CUDA stream that launches the kernel gets
# its own lane, so two streams never share a counter. Allocated once per device outside graph capture.
_MAX_SPLIT_TILES = 1024
_LANES = 16
_counters: dict[int, torch.Tensor] = {}
_stream_lanes: dict[tuple[int, int], int] = {}


def split_counters(device: torch.device, tiles: int) -> torch.Tensor | None:
    """This stream's zeroed counters for ``tiles`` tiles, or None (then the caller does not split K)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if tiles > _MAX_SPLIT_TILES:
        return None
    counters = _counters.get(index)
    if counters is None:
        if torch.cuda.is_current_stream_capturing():
            return None  # allocating would put the counters in the graph's pool, unzeroed outside replays
        counters = _counters[index] = torch.zeros(_LANES * _MAX_SPLIT_TILES, dtype=torch.int32, device=device)
    key = (index, torch.cuda.current_stream(device).cuda_stream)
    lane = _stream_lanes.get(key)
    if lane is None:
        used = sum(1 for (dev, _) in _stream_lanes if dev == index)
        if used >= _LANES:
            return None
        lane = _stream_lanes[key] = used
    return counters[lane * _MAX_SPLIT_TILES:(lane + 1) * _MAX_SPLIT_TILES]
