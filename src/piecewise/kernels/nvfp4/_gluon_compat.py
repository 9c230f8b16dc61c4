"""Gluon names that differ between the Triton versions the package admits (``triton>=3.6,<3.10``).

Read from each release's ``triton/experimental/gluon`` sources (3.6.0, 3.7.0, 3.7.1, 3.8.0, 3.9.0):

- TMA load into shared memory: ``tma.async_copy_global_to_shared`` in 3.6 and 3.7, ``tma.async_load`` from 3.8
  (3.8 keeps the old name as an alias; in 3.9 it is a stub that raises at compile time, "has been removed").
- A barrier among the threads of a program: ``gl.thread_barrier`` in 3.6, ``gl.barrier`` from 3.7.

The other Gluon calls of the kernels (``mbarrier.init/expect/wait/invalidate``, ``fence_async_shared``,
``warpgroup_mma``/``warpgroup_mma_wait``, ``mma_v2``, the layouts, the host ``TensorDescriptor``) keep their names
and positional arguments across these versions (``mbarrier.expect``'s byte count, passed positionally, is
``bytes`` in 3.6 and ``bytes_per_cta`` from 3.7).

Each alias is looked up by its new name first: the old TMA name still exists in 3.9, as a stub that fails the
compile. The kernels call these module-level aliases like any Gluon builtin. Imported only where Gluon with
Hopper support imports.
"""

from __future__ import annotations

from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma

tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
"""``tma_load(desc, coord, barrier, result, pred=True)``: a TMA copy of one ``desc`` block into ``result``,
signalling ``barrier`` (the positional arguments are the same in every version)."""

cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
"""``cta_barrier()``: every thread of the program reaches it before any goes on (no cluster)."""
