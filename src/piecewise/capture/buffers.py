"""Static buffers: padded inputs, splitting-op outputs. Rows past the real tokens read zero."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import _compat


def map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with every tensor in it (through tuples and lists) replaced by ``fn(tensor)``."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple):
        return tuple(map_tensors(v, fn) for v in value)
    if isinstance(value, list):
        return [map_tensors(v, fn) for v in value]
    return value


def storage_alias(base: torch.Tensor, rows: int) -> torch.Tensor:
    """The first ``rows`` rows of ``base`` as a tensor that shares its storage but is not a view.

    Dynamo guards views differently from plain tensors; inputs handed to the compiled forward must look
    the same whether they come from a static buffer (padded calls) or from the user (calls above the
    largest capture size), or the second kind would trigger a retrace.
    """
    alias = torch.empty((), dtype=base.dtype, device=base.device)
    alias.set_(base.untyped_storage(), base.storage_offset(), (rows, *base.shape[1:]), base.stride())
    return alias


def direct_tokens(arguments: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """``arguments`` with each of ``names`` (token arguments, tokens first) replaced by an alias made here, in the
    caller's inference mode, with its token dimension marked dynamic. A call that does not go through the staging
    buffers (above the largest size; the first call's unpadded rehearsals) then looks to Dynamo's guards like a
    padded one, whether the caller's tensors were made inside ``torch.inference_mode()`` or outside, whole or
    sliced: no second trace for a dispatch key or a view, none for a count traced static."""
    direct = dict(arguments)
    for name in names:
        alias = storage_alias(arguments[name], arguments[name].shape[0])
        _compat.mark_token_dim(alias, 0)
        direct[name] = alias
    return direct


class RowBuffer:
    """A static [max_tokens, ...] buffer written by leading rows; rows past the last write read zero.

    Views of its leading rows are made once per row count: on replay the same counts come back every step.
    """

    def __init__(self, buffer: torch.Tensor):
        self.buffer = buffer
        self.views: dict[int, torch.Tensor] = {}
        self.dirty = 0

    def rows(self, count: int) -> torch.Tensor:
        view = self.views.get(count)
        if view is None:
            view = self.views[count] = self.buffer[:count]
        return view

    def write(self, value: torch.Tensor, rows: int) -> None:
        """Copy ``value`` into the first ``rows`` rows; zero the rows a larger earlier write left behind."""
        self.rows(rows).copy_(value)
        if self.dirty > rows:
            self.buffer[rows : self.dirty].zero_()
        self.dirty = rows


class InputStager:
    """The model's token arguments copied into static buffers of ``max_tokens`` rows, handed to the forward as
    views of ``size`` rows (pad rows zero). One buffer per (argument, dtype, device, row shape)."""

    def __init__(self, max_tokens: int, stable_ptrs: set[int]):
        self.max_tokens = max_tokens
        self.stable_ptrs = stable_ptrs
        self.buffers: dict[tuple, RowBuffer] = {}
        self.aliases: dict[tuple, torch.Tensor] = {}

    @staticmethod
    def key(name: str, value: torch.Tensor) -> tuple:
        return (name, value.dtype, value.device, value.shape[1:])

    def stage(self, arguments: dict[str, Any], names: list[str], rows: int, size: int) -> dict[str, Any]:
        """``arguments`` with each of ``names`` (token arguments, ``rows`` rows) replaced by its padded view."""
        staged = dict(arguments)
        for name in names:
            value = arguments[name]
            key = self.key(name, value)
            staging = self.buffers.get(key)
            if staging is None:
                buffer = torch.zeros((self.max_tokens, *value.shape[1:]), dtype=value.dtype, device=value.device)
                staging = self.buffers[key] = RowBuffer(buffer)
                self.stable_ptrs.add(buffer.data_ptr())
            staging.write(value, rows)
            alias = self.aliases.get((key, size))
            if alias is None:
                alias = storage_alias(staging.buffer, size)
                _compat.mark_token_dim(alias, 0)
                self.aliases[(key, size)] = alias
            staged[name] = alias
        return staged

    def fill_padding_with_copies(self, arguments: dict[str, Any], names: list[str], rows: int, size: int) -> None:
        """Overwrite the pad rows of the staged ``names`` with copies of the real rows, the last first (the padding
        check: a first row often holds what zero padding does, position 0)."""
        for name in names:
            staging = self.buffers[self.key(name, arguments[name])]
            source = rows - 1 - torch.arange(size - rows, device=staging.buffer.device) % rows
            staging.buffer[rows:size] = staging.buffer[source]
            staging.dirty = max(staging.dirty, size)

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives in one of the staging buffers."""
        pointer = tensor.untyped_storage().data_ptr()
        return any(b.buffer.untyped_storage().data_ptr() == pointer for b in self.buffers.values())
