"""The capture session: one graph pool for every size and front-end, a side stream, no garbage collection."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator

import torch

from .. import _compat
from .segment import end_capture
from .state import CaptureState


def _progress(total: int):
    """A rich progress bar on a terminal, nothing otherwise."""
    from rich.console import Console
    from rich.progress import Progress

    console = Console(stderr=True)
    if not console.is_terminal:
        return contextlib.nullcontext(None)
    return Progress(console=console, transient=True)


def own_blas_workspaces(pool: object) -> torch.cuda.CUDAGraph:
    """Make the current stream's cuBLAS and cuBLASLt workspaces inside ``pool``, where they outlive any clear.

    cuBLAS keeps one workspace per (handle, stream), made at its first use; a graph bakes its address in. Anyone
    may free every workspace (``torch._C._cuda_clearCublasWorkspaces``: CUDA graph trees, so every
    ``torch.compile(mode="reduce-overhead")`` model, call it around each recording), and ``torch.cuda.graph``
    empties the allocator's cache on entry. A workspace made outside the graphs' pool is then unmapped, and the
    next replay is an illegal memory access. So free them first, and let a throwaway capture into the pool make
    this stream's anew: freed again later, their memory goes back to the pool, which stays mapped while its graphs
    live (the returned graph keeps the pool in use from the start). Torch's own graph trees do the same."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    a = torch.ones(16, 16, device="cuda", dtype=torch.bfloat16)
    bias = torch.ones(16, device="cuda", dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    graph.capture_begin(pool=pool, capture_error_mode="thread_local")
    try:
        torch.mm(a, a)  # cuBLAS
        torch.addmm(bias, a, a)  # cuBLASLt (bias epilogue)
        torch.mm(a.float(), a.float())
    finally:
        end_capture(graph)
    return graph


@contextlib.contextmanager
def capture_session(state: CaptureState, sizes: int) -> Iterator[Callable[[], None]]:
    """Capture on a side stream into one new pool (``state.pool``), with the garbage collector frozen: a
    collected CUDA tensor would free memory mid-capture. Side streams the forward forks are noted for the graphs'
    ends to join. Yields a callable that marks one size done. (Runs inside a runner call: ``RUNNER_LOCK`` is held.)"""
    state.pool = torch.cuda.graph_pool_handle()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    gc.collect(1)  # the young generations (a full collection costs about 0.1 s with torch imported)
    gc.freeze()
    try:
        with torch.cuda.stream(stream), _compat.tracking_stream_forks(), _progress(sizes) as progress:
            state.workspace_graph = own_blas_workspaces(state.pool)
            task = progress.add_task("capturing CUDA graphs", total=sizes) if progress else None
            yield (lambda: progress.advance(task)) if progress else (lambda: None)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
    finally:
        gc.unfreeze()
