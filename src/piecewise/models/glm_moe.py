"""A GLM-style mixture-of-experts decoder: the bundled Llama layers with, from layer ``first_k_dense_replace`` on,
the MoE block of HF transformers' ``glm4_moe`` in place of the dense MLP.

Router (``route``): float32 logits → sigmoid scores; ``e_score_correction_bias`` is added for the *choice* only;
a group's score is the sum of its two best experts, the ``topk_group`` best of ``n_group`` groups stay, the
``top_k`` best experts among them are chosen; their weights are the unbiased sigmoid scores, renormalised when
``norm_topk_prob``, times ``routed_scaling_factor``. Plus the shared expert(s), a dense SwiGLU MLP.

The router has static shapes and stays inside the captured pieces. The experts (``moe_experts``) loop over
the experts that got tokens, which is data dependent (a host sync to count them): they are one opaque splitting
op, run eagerly between pieces, as SGLang does with its DeepEP MoE. ``quantize_experts`` turns their weights
into NVFP4 (``moe_experts_nvfp4``, the W4A16 kernels per expert). Attention is the Llama one (full rotary, no
q/k/v bias), not GLM's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.nvfp4 import global_scale_for, quantize
from ..kernels.nvfp4.module import apply_keeping_scales, encode_scale_problem
from ..kernels.nvfp4.moe import moe_nvfp4_reference
from ..kernels.nvfp4.moe import moe_op
from ..kernels.routing import routed_sum
from ..opaque import opaque_op
from ..parallel import reduce_partial
from .attention import attention
from .llama import DecoderLayer, LlamaConfig, TinyLlama, tensor_parallel_llama
from .llama import example as llama_example


@dataclass
class GlmMoeConfig(LlamaConfig):
    num_experts: int = 8
    top_k: int = 2
    n_group: int = 2
    topk_group: int = 1
    moe_intermediate_size: int = 64
    n_shared_experts: int = 1
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 1

    def __post_init__(self):
        if self.num_experts % self.n_group or self.num_experts // self.n_group < 2:
            raise ValueError(
                f"GlmMoeConfig: num_experts={self.num_experts} must split into n_group={self.n_group} groups of at "
                f"least 2 experts (a group's score is its two best experts)"
            )
        if not 0 < self.topk_group <= self.n_group or not 0 < self.top_k <= self.topk_group * self.num_experts // self.n_group:
            raise ValueError(
                f"GlmMoeConfig: need 0 < topk_group ≤ n_group and 0 < top_k ≤ the experts of topk_group groups, got "
                f"topk_group={self.topk_group}, n_group={self.n_group}, top_k={self.top_k}"
            )


def route(logits: torch.Tensor, correction_bias: torch.Tensor, config: GlmMoeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] → (weights [T, top_k] float32, expert ids [T, top_k] int64); static shapes."""
    tokens, experts = logits.shape
    scores = logits.float().sigmoid()
    choice = scores + correction_bias.float()
    group_scores = choice.view(tokens, config.n_group, -1).topk(2, dim=-1).values.sum(dim=-1)
    groups = group_scores.topk(config.topk_group, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores).scatter_(1, groups, 1.0)
    expert_mask = group_mask.unsqueeze(-1).expand(tokens, config.n_group, experts // config.n_group).reshape(tokens, experts)
    ids = choice.masked_fill(expert_mask == 0, float("-inf")).topk(config.top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if config.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * config.routed_scaling_factor, ids


def _experts_fake(x, ids, weights, *rest):
    return x.new_empty(x.shape)


@opaque_op("piecewise_examples::moe_experts", fake=_experts_fake, split=True)
def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor) -> torch.Tensor:
    """Routed experts, SwiGLU: x [T, H], ids / weights [T, k], gate_up [E, 2I, H], down [E, H, I] → [T, H]."""

    def expert(index: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(rows, gate_up[index]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, down[index])

    return routed_sum(x, ids, weights, gate_up.shape[0], expert)


@opaque_op("piecewise_examples::moe_experts_nvfp4", fake=_experts_fake, split=True)
def moe_experts_nvfp4(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                      gate_up_scale: torch.Tensor, gate_up_scale_2: torch.Tensor, down: torch.Tensor,
                      down_scale: torch.Tensor, down_scale_2: torch.Tensor) -> torch.Tensor:
    """``moe_experts`` with NVFP4 weights: packed [E, N, K/2], E4M3 scales [E, N, K/16], decode scales [E] (gate_up:
    [E] or [E, 2], gate and up halves)."""
    return moe_nvfp4_reference(x, ids, weights, gate_up, gate_up_scale, gate_up_scale_2, down, down_scale, down_scale_2)


class Experts(nn.Module):
    """The routed experts' weights, stacked: gate_up [E, 2I, H] and down [E, H, I]."""

    def __init__(self, config: GlmMoeConfig):
        super().__init__()
        experts, hidden, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up = nn.Parameter(torch.randn(experts, 2 * inter, hidden) / math.sqrt(hidden), requires_grad=False)
        self.down = nn.Parameter(torch.randn(experts, hidden, inter) / math.sqrt(inter), requires_grad=False)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return moe_experts(x, ids, weights, self.gate_up, self.down)


class NVFP4Experts(nn.Module):
    """``Experts`` with each expert's matrices quantized to NVFP4 (per-expert global scale); built from
    anything holding stacked ``gate_up`` [E, 2I, H] and ``down`` [E, H, I] tensors.

    ``grouped=True`` (default): ``piecewise_nvfp4::moe``, static shapes and grouped kernels on CUDA, captured
    inside the pieces (on CPU the per-expert loop). ``grouped=False``: a splitting op running the per-expert
    loop (eager between pieces, a host sync per layer)."""

    def __init__(self, experts: Experts, grouped: bool = True):
        super().__init__()
        self.grouped = grouped
        for name, stacked in (("gate_up", experts.gate_up), ("down", experts.down)):
            stacked = stacked.detach()
            encode = [global_scale_for(w) for w in stacked]
            parts = [quantize(w, scale) for w, scale in zip(stacked, encode)]
            self.register_buffer(name, torch.stack([packed for packed, _ in parts]))
            self.register_buffer(f"{name}_scale", torch.stack([scales for _, scales in parts]))
            self.register_buffer(f"{name}_scale_2", torch.stack([1 / scale for scale in encode]).float())

    @classmethod
    def from_checkpoint(cls, gate_up: torch.Tensor, gate_up_scale: torch.Tensor, gate_up_scale_2: torch.Tensor,
                        down: torch.Tensor, down_scale: torch.Tensor, down_scale_2: torch.Tensor,
                        grouped: bool = True) -> "NVFP4Experts":
        """Stacked checkpoint tensors: packed uint8 [E, N, K/2], float8_e4m3fn block scales [E, N, K/16] and
        float32 *decode* scales (amax/2688) [E]; ``gate_up_scale_2`` may be [E, 2], a scale for the gate half
        of the rows and one for the up half (checkpoints that quantize gate and up separately)."""
        experts = gate_up.shape[0]
        for name, packed, scales, decode, shapes in (
                ("gate_up", gate_up, gate_up_scale, gate_up_scale_2, ((experts,), (experts, 2))),
                ("down", down, down_scale, down_scale_2, ((experts,),))):
            if packed.dtype != torch.uint8 or packed.dim() != 3 or packed.shape[0] != experts:
                raise ValueError(f"{name} must be packed FP4 as uint8 [{experts}, N, K/2], got {packed.dtype} "
                                 f"{tuple(packed.shape)}")
            expected = (experts, packed.shape[1], packed.shape[2] * 2 // 16)
            if scales.dtype != torch.float8_e4m3fn or tuple(scales.shape) != expected:
                raise ValueError(f"{name}_scale must be float8_e4m3fn {list(expected)} (one per 16 inputs), got "
                                 f"{scales.dtype} {tuple(scales.shape)}")
            if tuple(decode.shape) not in shapes or not bool(torch.isfinite(decode).all() and (decode > 0).all()):
                raise ValueError(f"{name}_scale_2 must hold positive finite decode scales of shape "
                                 f"{' or '.join(str(list(shape)) for shape in shapes)}, got {tuple(decode.shape)}")
            problem = encode_scale_problem(float(decode.max()), f"{name}_scale_2")
            if problem:
                raise ValueError(problem)
        if gate_up.shape[1] % 2 or down.shape[2] * 2 != gate_up.shape[1] // 2:
            raise ValueError(f"gate_up [E, 2I, H] and down [E, H, I] do not match: gate_up {tuple(gate_up.shape)} "
                             f"(packed), down {tuple(down.shape)} (packed)")
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.grouped = grouped
        for name, tensor in (("gate_up", gate_up), ("gate_up_scale", gate_up_scale), ("down", down),
                             ("down_scale", down_scale)):
            module.register_buffer(name, tensor.contiguous())
        module.register_buffer("gate_up_scale_2", gate_up_scale_2.float().contiguous())
        module.register_buffer("down_scale_2", down_scale_2.float().contiguous())
        return module

    def _apply(self, fn, recurse=True):  # a model's .to(dtype) keeps the scales' dtypes
        return apply_keeping_scales(self, ("gate_up_scale", "gate_up_scale_2", "down_scale", "down_scale_2"), fn,
                                    recurse)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        op = moe_op if self.grouped else moe_experts_nvfp4
        return op(x, ids, weights, self.gate_up, self.gate_up_scale, self.gate_up_scale_2,
                  self.down, self.down_scale, self.down_scale_2)


class GlmMoE(nn.Module):
    """Router, routed experts and shared expert(s): [T, H] → [T, H]."""

    def __init__(self, config: GlmMoeConfig):
        super().__init__()
        self.config = config
        hidden, shared = config.hidden_size, config.moe_intermediate_size * config.n_shared_experts
        self.router = nn.Linear(hidden, config.num_experts, bias=False)
        self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts))
        self.experts = Experts(config)
        self.shared_gate_up = nn.Linear(hidden, 2 * shared, bias=False)
        self.shared_down = nn.Linear(shared, hidden, bias=False)
        self.reduce: tuple[str, bool] | None = None
        """(group, in_graph) once ``tensor_parallel_glm_moe`` sharded the block: its output is a partial sum."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x.float(), self.router.weight.float())
        weights, ids = route(logits, self.e_score_correction_bias, self.config)
        gate, up = self.shared_gate_up(x).chunk(2, dim=-1)
        out = self.experts(x, ids, weights) + self.shared_down(F.silu(gate) * up)
        return out if self.reduce is None else reduce_partial(out, *self.reduce)


class MoeDecoderLayer(DecoderLayer):
    """A decoder layer whose MLP is ``GlmMoE``."""

    def build_mlp(self, config: GlmMoeConfig) -> None:
        self.mlp = GlmMoE(config)

    def post_attention(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        x = x + self.o_proj(attended)
        return x + self.mlp(self.post_norm(x))


class GlmMoeModel(TinyLlama):
    """``TinyLlama`` with MoE layers from ``first_k_dense_replace`` on; same forward signature."""

    def __init__(self, config: GlmMoeConfig | None = None, attend=attention):
        super().__init__(config or GlmMoeConfig(), attend)

    def make_layer(self, config: GlmMoeConfig, index: int, attend) -> nn.Module:
        layer_class = DecoderLayer if index < config.first_k_dense_replace else MoeDecoderLayer
        return layer_class(config, index, attend)


def quantize_experts(model: nn.Module, *, grouped: bool = True) -> int:
    """Replace every ``Experts`` of ``model`` by its ``NVFP4Experts`` (``grouped``: see there), in place;
    returns how many. The other linear layers convert with ``quantize_linears(model, skip=("lm_head", "router"))``."""
    count = 0
    for module in list(model.modules()):
        if isinstance(module, GlmMoE) and type(module.experts) is Experts:
            module.experts = NVFP4Experts(module.experts, grouped=grouped)
            count += 1
    return count


def tensor_parallel_glm_moe(model: GlmMoeModel, group=None, *, capture_all_reduce: bool = False) -> list[str]:
    """Shard a ``GlmMoeModel`` over ``group``: attention and dense layers as ``tensor_parallel_llama`` does; in
    each MoE block every routed expert (bf16 or NVFP4) and the shared expert keep 1/world of their intermediate
    dimension, and the block's two partial outputs are summed by one all-reduce. The router stays whole (every
    rank routes every token the same way). Returns the qualified names sharded."""
    from ..parallel import Column, check_divisible, rank_of, shard_experts, shard_layer

    c = model.config
    rank, world, name = rank_of(group)
    check_divisible({"moe_intermediate_size": c.moe_intermediate_size}, world, "config")
    sharded = tensor_parallel_llama(model, group, capture_all_reduce=capture_all_reduce)
    shared = c.moe_intermediate_size * c.n_shared_experts
    for qualified, module in model.named_modules():
        if isinstance(module, GlmMoE):
            module.shared_gate_up = shard_layer(module.shared_gate_up, Column(sections=(shared, shared)), rank, world,
                                                name, f"{qualified}.shared_gate_up")
            # the row shard without its own all-reduce: the block reduces once, experts included
            module.shared_down = shard_layer(module.shared_down, "row", rank, world, name, f"{qualified}.shared_down").layer
            shard_experts(module.experts, c.moe_intermediate_size, rank, world, f"{qualified}.experts")
            module.reduce = (name, capture_all_reduce)
            sharded.append(qualified)
    return sharded


def example(tokens: int = 7, device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0, **config):
    """A small GLM-style MoE model and its inputs ``(input_ids, positions, kv_cache)`` (usable as a CLI factory)."""
    model, inputs = llama_example(tokens, device, dtype, seed, model_class=GlmMoeModel, config_class=GlmMoeConfig, **config)
    for module in model.modules():
        if isinstance(module, GlmMoE):  # the router's correction bias stays float32, as in HF checkpoints
            module.e_score_correction_bias.data = module.e_score_correction_bias.data.float()
    return model, inputs
