"""A small Llama-style decoder: RMSNorm, rotary GQA attention (a splitting op), SwiGLU MLP."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from .attention import attention


@dataclass
class LlamaConfig:
    vocab_size: int = 512
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    max_seq_len: int = 1024
    rope_theta: float = 10000.0


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype) * self.weight


def rotary_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, 1, D/2] for ``positions`` [T]; computed once per forward, shared by all layers."""
    half = head_dim // 2
    freqs = theta ** (-torch.arange(half, device=positions.device, dtype=torch.float32) / half)
    angles = positions.float()[:, None] * freqs[None, :]
    return angles.cos()[:, None, :], angles.sin()[:, None, :]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on [T, H, D]."""
    half = x.shape[-1] // 2
    x1, x2 = x.float()[..., :half], x.float()[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, index: int, attend=attention):
        super().__init__()
        self.config = config
        self.index = index
        self.attend = attend
        hidden, heads, kv_heads, head_dim = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        self.input_norm = RMSNorm(hidden)
        self.qkv = nn.Linear(hidden, (heads + 2 * kv_heads) * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.post_norm = RMSNorm(hidden)
        self.build_mlp(config)

    def build_mlp(self, config: LlamaConfig) -> None:
        """The SwiGLU MLP's layers (subclasses build another MLP)."""
        self.gate_up = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def pre_attention(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]):
        """Norm, QKV projection and rotary: [T, hidden] → q [T, Hq, D], k/v [T, Hkv, D]."""
        c = self.config
        tokens = x.shape[0]
        q, k, v = self.qkv(self.input_norm(x)).split(
            [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim], dim=-1
        )
        q = rotate(q.view(tokens, c.num_heads, c.head_dim), *rotary)
        k = rotate(k.view(tokens, c.num_kv_heads, c.head_dim), *rotary)
        return q, k, v.view(tokens, c.num_kv_heads, c.head_dim)

    def post_attention(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Output projection, residual, norm and SwiGLU MLP."""
        x = x + self.o_proj(attended)
        gate, up = self.gate_up(self.post_norm(x)).chunk(2, dim=-1)
        return x + self.down(nn.functional.silu(gate) * up)

    def forward(self, x, positions, kv_cache, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        q, k, v = self.pre_attention(x, rotary)
        return self.post_attention(x, self.attend(q, k, v, positions, kv_cache, self.index))


class TinyLlama(nn.Module):
    """Decoder-only model over one sequence: ``forward(input_ids [T], positions [T], kv_cache) -> logits [T, V]``."""

    def __init__(self, config: LlamaConfig | None = None, attend=attention):
        super().__init__()
        self.config = config = config or LlamaConfig()
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.make_layer(config, i, attend) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def make_layer(self, config: LlamaConfig, index: int, attend) -> nn.Module:
        """Decoder layer ``index`` (subclasses pick other layers)."""
        return DecoderLayer(config, index, attend)

    def make_kv_cache(self, device=None, dtype=None, max_seq_len: int | None = None) -> torch.Tensor:
        """[layers, 2, max_seq_len (default: the config's), kv heads, head dim]: positions 0 to max_seq_len - 1."""
        c = self.config
        weight = self.lm_head.weight
        return torch.zeros(
            (c.num_layers, 2, max_seq_len or c.max_seq_len, c.num_kv_heads, c.head_dim),
            device=device or weight.device,
            dtype=dtype or weight.dtype,
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        rotary = rotary_tables(positions, self.config.head_dim, self.config.rope_theta)
        for layer in self.layers:
            x = layer(x, positions, kv_cache, rotary)
        return self.lm_head(self.norm(x))


def example(tokens: int = 7, device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0, *,
            model_class: type[TinyLlama] | None = None, config_class: type[LlamaConfig] = LlamaConfig, **config):
    """The bundled demo: ``(model, (input_ids, positions, kv_cache))`` (usable as a CLI factory); ``model_class``
    and ``config_class`` give other models of the same forward (``TinyLlama`` and ``LlamaConfig`` by default)."""
    torch.manual_seed(seed)
    model = (model_class or TinyLlama)(config_class(**config)).to(device=device, dtype=dtype).eval()
    input_ids = torch.randint(0, model.config.vocab_size, (tokens,), device=device)
    positions = torch.arange(tokens, device=device)
    return model, (input_ids, positions, model.make_kv_cache())


def tensor_parallel_llama(model: TinyLlama, group=None, *, capture_all_reduce: bool = False) -> list[str]:
    """Shard a ``TinyLlama`` / ``DecodeLlama`` over ``group`` (``piecewise.parallel.tensor_parallel``): QKV and
    gate+up column-parallel by heads and by MLP columns, the output and down projections row-parallel with an
    all-reduce; each rank's config then has its share of the heads and of the MLP (so its KV cache too).
    Returns the qualified names sharded."""
    from ..parallel import Column, check_divisible, tensor_parallel, world_size

    c = model.config
    world = world_size(group)
    check_divisible({field: getattr(c, field) for field in ("num_heads", "num_kv_heads", "intermediate_size")},
                    world, "config")  # KV heads are not replicated
    plan = {
        "layers.*.qkv": Column(sections=(c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim)),
        "layers.*.o_proj": "row",
    }
    if any(hasattr(layer, "gate_up") for layer in model.layers):  # dense MLPs (all of them but in MoE models)
        plan |= {"layers.*.gate_up": Column(sections=(c.intermediate_size, c.intermediate_size)), "layers.*.down": "row"}
    sharded = tensor_parallel(model, plan, group, capture_all_reduce=capture_all_reduce)
    local = replace(c, num_heads=c.num_heads // world, num_kv_heads=c.num_kv_heads // world,
                    intermediate_size=c.intermediate_size // world)
    model.config = local
    for layer in model.layers:
        layer.config = local
    return sharded
