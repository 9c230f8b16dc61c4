"""Whether the model's attention runs SDPA's cuDNN backend, whose execution plan is built anew at every new shape.

torch sends ``F.scaled_dot_product_attention`` to cuDNN first on Hopper. Each new shape then costs a plan: on an
H200 with torch 2.11, 57-90 ms at each capture size for decode shapes, 110-434 ms at each new prefill length
(benchmarks/RESULTS.md, "cuDNN's attention plans"). A first call capturing 51 sizes pays it 51 times, every process.
The doctor's eager run is watched by torch's profiler (host events only: every aten op, also those inside custom
ops, which a dispatch mode does not see), on CUDA models only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

CUDNN_ATTENTION = "aten::_scaled_dot_product_cudnn_attention"

WARNING = (
    "the model's attention runs SDPA's cuDNN backend (torch's first choice on Hopper), which builds an execution plan "
    "at every new shape: on an H200, 57-90 ms at each capture size for decode shapes and 110-434 ms at each new "
    "prefill length, so a first call capturing 51 sizes spends seconds on it in every process. Call "
    "piecewise.kernels.attention.sdpa in place of F.scaled_dot_product_attention (FlashAttention or memory-efficient "
    "attention, whose first call at a shape takes 1-2 ms), or wrap the call in torch.nn.attention.sdpa_kernel("
    "[SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]).")


def cudnn_warnings(op_names: Iterable[str]) -> list[str]:
    """``[WARNING]`` when one of the profiled host ops is cuDNN's attention, else ``[]``."""
    return [WARNING] if any(name == CUDNN_ATTENTION for name in op_names) else []


@contextlib.contextmanager
def watch_cudnn_attention(on_cuda: bool) -> Iterator[list[str]]:
    """Around the doctor's eager run: the list it yields holds ``cudnn_warnings`` of the run once the block ends
    (nothing on a CPU model, or when a profiler is already running)."""
    found: list[str] = []
    if not on_cuda or torch._C._autograd._profiler_enabled():  # a second profiler would end the caller's
        yield found
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], acc_events=True) as profiler:  # (no warning of cycles)
        yield found
    found.extend(cudnn_warnings(event.name for event in profiler.events()))
