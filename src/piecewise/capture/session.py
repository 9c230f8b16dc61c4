"""The capture session: one graph pool for every size and front-end, a side stream, no garbage collection."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator

import torch

from .state import CaptureState


def _progress(total: int):
    """A rich progress bar on a terminal, nothing otherwise."""
    from rich.console import Console
    from rich.progress import Progress

    console = Console(stderr=True)
    if not console.is_terminal:
        return contextlib.nullcontext(None)
    return Progress(console=console, transient=True)


@contextlib.contextmanager
def capture_session(state: CaptureState, sizes: int) -> Iterator[Callable[[], None]]:
    """Capture on a side stream into one new pool (``state.pool``), with the garbage collector frozen: a
    collected CUDA tensor would free memory mid-capture. Yields a callable that marks one size done."""
    state.pool = torch.cuda.graph_pool_handle()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    gc.collect()
    gc.freeze()
    try:
        with torch.cuda.stream(stream), _progress(sizes) as progress:
            task = progress.add_task("capturing CUDA graphs", total=sizes) if progress else None
            yield (lambda: progress.advance(task)) if progress else (lambda: None)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
    finally:
        gc.unfreeze()
