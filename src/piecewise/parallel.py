"""Tensor parallelism as a transform applied to a model: shard its linear layers across the ranks of a process
group and sum the row-parallel outputs with an all-reduce that is a splitting op.

    import torch.distributed as dist
    from piecewise.parallel import Column, tensor_parallel

    dist.init_process_group("nccl")                     # one process per GPU
    tensor_parallel(model, {"layers.*.qkv": Column(sections=(q, k, v)), "layers.*.o_proj": "row",
                            "layers.*.gate_up": Column(sections=(i, i)), "layers.*.down": "row"})
    runner = piecewise.compile(model, ...)              # the all-reduces run eagerly between pieces
                                                        # (capture_all_reduce=True: inside the graphs)

A column-parallel layer keeps ``out_features / world`` output rows (of each section, for fused projections such
as QKV or gate+up), a row-parallel one ``in_features / world`` input columns, followed by an all-reduce (its
bias is added once, after the sum). ``nn.Linear`` and ``NVFP4Linear`` both shard: an NVFP4 weight is cut along
its packed rows and 16-input scale blocks, so each rank computes with exactly the bytes of the full layer.

The model's own code must then work with fewer heads or a narrower MLP per rank (a config edit, as
``piecewise.models.llama.tensor_parallel_llama`` does for the bundled models). Embeddings and the output head
stay whole on every rank.

``dist.destroy_process_group()`` then frees the group and stops its backend's threads: piecewise holds no
reference to a group. Import this module before ``init_process_group`` (see the import below).
"""

from __future__ import annotations

import fnmatch
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .kernels.nvfp4.module import NVFP4Linear
from .kernels.nvfp4.reference import BLOCK
from .opaque import opaque_op

if dist.is_available():
    # Its functions take ``group=group.WORLD`` as a default argument, evaluated when the module is imported. Imported
    # after init_process_group (torch._dynamo imports it, on the first compile or custom-op call), it would hold the
    # default group for good: destroy_process_group would leave gloo's threads running, and one of them dropping its
    # last finished work while the interpreter shuts down (it needs the GIL for the tensors' Python objects) kills
    # the process with SIGABRT ("terminate called without an active exception"). Imported here, the default is None.
    import torch.distributed.nn.functional  # noqa: F401

_groups: weakref.WeakValueDictionary[str, dist.ProcessGroup] = weakref.WeakValueDictionary()
"""Process groups by the name the all-reduce ops take. Weak references: a destroyed group is freed (and its
backend's threads joined) instead of living on here."""


def world_size(group: dist.ProcessGroup | None = None) -> int:
    """Ranks in ``group`` (default: the world), or 1 where torch.distributed is not initialised."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def check_divisible(sizes: dict[str, int], world: int, owner: str) -> None:
    """ValueError naming the first of ``owner``'s ``sizes`` that ``world`` ranks cannot share evenly."""
    for field, size in sizes.items():
        if size % world:
            raise ValueError(f"{owner}.{field}={size} does not split over {world} ranks: use a world size that divides it")


def rank_of(group: dist.ProcessGroup | None) -> tuple[int, int, str]:
    """(rank, world size, registered name) of this process in ``group`` (default: the whole world)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("tensor_parallel needs torch.distributed initialised first: call dist.init_process_group(...)")
    group = group or dist.group.WORLD
    return dist.get_rank(group), dist.get_world_size(group), group_name(group)


def group_name(group: dist.ProcessGroup) -> str:
    """A name the all-reduce op takes as its argument (op arguments cannot be process groups)."""
    name = f"{getattr(group, 'group_name', '') or 'group'}_{id(group)}"
    _groups[name] = group
    return name


def _group(name: str) -> dist.ProcessGroup:
    group = _groups.get(name)
    if group is None:
        raise RuntimeError(
            f"process group {name!r} no longer exists (destroyed with dist.destroy_process_group?): the model was "
            f"sharded for it; shard a fresh model after initialising a new process group"
        )
    return group


def _summed(x: torch.Tensor, group: str) -> torch.Tensor:
    out = torch.empty_like(x, memory_format=torch.contiguous_format).copy_(x)
    dist.all_reduce(out, group=_group(group))
    return out


@opaque_op("piecewise_ops::all_reduce", split=True)
def all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """Sum of ``x`` over the ranks of the process group registered as ``group`` (out of place). A splitting op:
    piecewise runs it eagerly between captured pieces, on the real (unpadded) rows, the same on every rank."""
    return _summed(x, group)


@opaque_op("piecewise_ops::all_reduce_in_graph")
def all_reduce_in_graph(x: torch.Tensor, group: str) -> torch.Tensor:
    """``all_reduce`` that is not a splitting op: the collective is captured inside the pieces' CUDA graphs (NCCL
    supports graph capture), over the padded rows. Fewer pieces and no host work per all-reduce."""
    return _summed(x, group)


def reduce_partial(partial: torch.Tensor, group: str, in_graph: bool) -> torch.Tensor:
    """Sum a rank's partial output over ``group``: the splitting op, or the one captured in the graphs. The op
    sees it token-major ([1, T, H] in transformers models → [T, H]): piecewise pads dimension 0."""
    reduce = all_reduce_in_graph if in_graph else all_reduce
    return reduce(partial.reshape(-1, partial.shape[-1]), group).view(partial.shape)


@dataclass(frozen=True)
class Column:
    """Shard a layer's outputs. ``sections``: sizes of the fused outputs (e.g. q, k, v), each split across the
    ranks; None is one section, the whole layer."""

    sections: tuple[int, ...] | None = None


class RowParallel(nn.Module):
    """A layer holding ``in_features / world`` of the inputs: its partial output is summed over the group, then
    the bias is added."""

    def __init__(self, layer: nn.Module, bias: torch.Tensor | None, group: str, in_graph: bool = False):
        super().__init__()
        self.layer = layer
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.group = group
        self.in_graph = in_graph

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = reduce_partial(self.layer(x), self.group, self.in_graph)
        return out + self.bias if self.bias is not None else out

    def extra_repr(self) -> str:
        return f"group={self.group!r}, in_graph={self.in_graph}"


def _pieces(size: int, world: int, what: str) -> int:
    if size % world:
        raise ValueError(f"{what} is {size}, which {world} ranks cannot share evenly: pick a world size that divides it")
    return size // world


def _whole_scale_blocks(share: int, world: int, name: str, what: str) -> None:
    if share % BLOCK:
        raise ValueError(
            f"{name}: each of {world} ranks would hold {share} {what} of NVFP4 weights, not a whole number of "
            f"{BLOCK}-input scale blocks: pick a world size that gives multiples of {BLOCK}"
        )


def _column_rows(out_features: int, sections: tuple[int, ...] | None, rank: int, world: int, name: str) -> torch.Tensor:
    sections = sections or (out_features,)
    if sum(sections) != out_features:
        raise ValueError(f"{name}: Column sections {sections} add up to {sum(sections)}, not out_features={out_features}")
    rows, start = [], 0
    for index, size in enumerate(sections):
        share = _pieces(size, world, f"{name}: section {index} of out_features")
        rows.append(torch.arange(start + rank * share, start + (rank + 1) * share))
        start += size
    return torch.cat(rows)


def _take(tensor: torch.Tensor, index: torch.Tensor, dim: int) -> torch.Tensor:
    """``tensor.index_select(dim, index)``, float8 included (indexed through its bytes)."""
    if tensor.dtype == torch.float8_e4m3fn:
        return tensor.view(torch.uint8).index_select(dim, index).view(torch.float8_e4m3fn)
    return tensor.index_select(dim, index)


def expert_rows(stacked: torch.Tensor, sections: tuple[int, ...], rank: int, world: int, name: str) -> torch.Tensor:
    """This rank's rows (dim 1) of a stack of per-expert matrices [E, N, ...], section by section (gate, up)."""
    return _take(stacked, _column_rows(stacked.shape[1], sections, rank, world, name).to(stacked.device), 1)


def expert_columns(stacked: torch.Tensor, rank: int, world: int, name: str) -> torch.Tensor:
    """This rank's share of the last dimension of a stack of per-expert matrices [E, N, C]."""
    share = _pieces(stacked.shape[-1], world, f"{name}: the columns")
    return stacked[..., rank * share : (rank + 1) * share].contiguous()


def shard_experts(experts: nn.Module, inter: int, rank: int, world: int, name: str, gate_up: str = "gate_up",
                  down: str = "down") -> None:
    """Keep this rank's share of the intermediate dimension of stacked SwiGLU experts, in place: gate and up rows
    of ``gate_up`` [E, 2I, H], columns of ``down`` [E, H, I]. NVFP4 experts (with ``<name>_scale`` block scales)
    are cut along their packed bytes and 16-input scale blocks; their per-expert decode scales stay whole. The
    rank's output is then a partial sum, to be all-reduced (``reduce_partial``)."""
    nvfp4 = hasattr(experts, f"{gate_up}_scale")
    if not nvfp4:
        for attr, cut in ((gate_up, lambda t: expert_rows(t, (inter, inter), rank, world, name)),
                          (down, lambda t: expert_columns(t, rank, world, name))):
            setattr(experts, attr, nn.Parameter(cut(getattr(experts, attr).detach()), requires_grad=False))
        return
    _whole_scale_blocks(inter // world, world, name, "intermediate columns")
    for attr in (gate_up, f"{gate_up}_scale"):
        setattr(experts, attr, expert_rows(getattr(experts, attr), (inter, inter), rank, world, name))
    for attr in (down, f"{down}_scale"):
        setattr(experts, attr, expert_columns(getattr(experts, attr), rank, world, name))


def shard_layer(
    layer: nn.Module, style: Column | str, rank: int, world: int, group: str, name: str = "layer", in_graph: bool = False
) -> nn.Module:
    """The ``rank``-th of ``world`` shards of an ``nn.Linear`` or ``NVFP4Linear`` (``style`` a ``Column`` or "row";
    ``in_graph``: a row shard's all-reduce is captured in the graphs instead of splitting them)."""
    if isinstance(style, str) and style == "column":
        style = Column()
    if not isinstance(style, Column) and style != "row":
        raise ValueError(f"{name}: a shard style is Column(...), 'column' or 'row', got {style!r}")
    if type(layer) not in (nn.Linear, NVFP4Linear):
        raise ValueError(f"{name} is a {type(layer).__name__}; tensor_parallel shards nn.Linear and NVFP4Linear layers")
    nvfp4 = isinstance(layer, NVFP4Linear)
    if isinstance(style, Column):
        rows = _column_rows(layer.out_features, style.sections, rank, world, name).to(layer.weight.device)
        if nvfp4:
            return NVFP4Linear.from_checkpoint(
                layer.weight[rows], _take(layer.weight_scale, rows, 0), layer.weight_scale_2, layer.input_scale,
                layer.bias[rows] if layer.bias is not None else None, dtype=_dtype(layer), check_scale=False)
        shard = nn.Linear(layer.in_features, len(rows), bias=layer.bias is not None,
                          device=layer.weight.device, dtype=layer.weight.dtype)
        with torch.no_grad():
            shard.weight.copy_(layer.weight[rows])
            if layer.bias is not None:
                shard.bias.copy_(layer.bias[rows])
        return shard.requires_grad_(layer.weight.requires_grad)
    share = _pieces(layer.in_features, world, f"{name}: in_features")
    start = rank * share
    bias = layer.bias.detach().clone() if layer.bias is not None else None
    if nvfp4:
        _whole_scale_blocks(share, world, name, "inputs")
        shard = NVFP4Linear.from_checkpoint(
            layer.weight[:, start // 2 : (start + share) // 2], layer.weight_scale[:, start // BLOCK : (start + share) // BLOCK],
            layer.weight_scale_2, layer.input_scale, None, dtype=_dtype(layer), check_scale=False)
    else:
        shard = nn.Linear(share, layer.out_features, bias=False, device=layer.weight.device, dtype=layer.weight.dtype)
        with torch.no_grad():
            shard.weight.copy_(layer.weight[:, start : start + share])
        shard.requires_grad_(layer.weight.requires_grad)
    return RowParallel(shard, bias, group, in_graph)


def _dtype(layer: NVFP4Linear) -> torch.dtype:
    return layer.bias.dtype if layer.bias is not None else torch.bfloat16


def tensor_parallel(
    model: nn.Module, plan: dict[str, Column | str], group: dist.ProcessGroup | None = None, *,
    capture_all_reduce: bool = False,
) -> list[str]:
    """Shard ``model``'s layers in place for this process's rank of ``group`` (default: the whole world) and
    return the qualified names sharded. ``plan`` maps ``fnmatch`` patterns of module names to ``Column(...)``,
    ``"column"`` or ``"row"``; every pattern must match at least one layer. Call it on every rank, with the
    same weights on every rank (same seed or same checkpoint).

    ``capture_all_reduce=False`` (default): the all-reduces are splitting ops and run eagerly between pieces,
    which works with any backend. True: they are captured inside the CUDA graphs (NCCL), which saves a piece
    and the host work per all-reduce."""
    rank, world, name = rank_of(group)
    return shard_modules(model, plan, rank, world, name, in_graph=capture_all_reduce)


def shard_modules(
    model: nn.Module, plan: dict[str, Column | str], rank: int, world: int, group: str, *, in_graph: bool = False
) -> list[str]:
    """``tensor_parallel`` for an explicit rank, world size and registered group name (no collective runs)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a world of {world}")
    matched = {pattern: [] for pattern in plan}
    for name, module in model.named_modules():
        for pattern in plan:
            if name and fnmatch.fnmatchcase(name, pattern):
                matched[pattern].append(name)
    unused = [pattern for pattern, names in matched.items() if not names]
    if unused:
        raise ValueError(f"tensor-parallel plan entries {unused} match no module of {type(model).__name__}: check the names")
    sharded = []
    for pattern, names in matched.items():
        for name in names:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            setattr(parent, child, shard_layer(getattr(parent, child), plan[pattern], rank, world, group, name, in_graph))
            sharded.append(name)
    return sharded
