"""Tensors whose elements encode values in another form: an FP8 latent cache is bytes (``kernels.latent_fp8``).

The checks that compare state a forward writes (the first call's padding checks, ``verify()``) compare such a
tensor as the values it holds, with the tolerance of their dtype, not byte by byte: two runs whose latent rows
differ in the last bit of float32 can round a value to neighbouring float8 codes, which is the format's rounding,
not a different computation. ``stored_as`` registers a tensor (the one a user passes: ``make_kv_cache``'s);
``values`` decodes it or a copy of it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

_DECODERS = WeakIdKeyDictionary()


def stored_as(tensor: torch.Tensor, decode: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Mark ``tensor`` as holding ``decode(tensor)``'s values (a floating tensor); returns ``tensor``."""
    _DECODERS[tensor] = decode
    return tensor


def values(tensor: torch.Tensor, of: torch.Tensor | None = None) -> torch.Tensor:
    """The values ``tensor`` holds: decoded where it (or ``of``, the tensor it is a copy of) was registered with
    ``stored_as``, itself otherwise."""
    decode = _DECODERS.get(tensor if of is None else of)
    return tensor if decode is None else decode(tensor)
