"""A tiny random transformers GLM-MoE model (no download), as factories for the piecewise CLI.

    piecewise doctor examples/glm_moe_transformers.py:as_is     # transformers' eager expert loop: blocked
    piecewise doctor examples/glm_moe_transformers.py:enabled   # attention and experts as splitting ops: safe
    piecewise run examples/glm_moe_transformers.py:enabled
"""

import torch
import transformers

from piecewise.integrations.transformers import TokenModel, enable


def model(experts_implementation: str | None = "eager", device: str = "cpu", dtype: torch.dtype = torch.float32):
    """The model (seed 0); ``experts_implementation`` None keeps transformers' choice (grouped_mm where it can)."""
    torch.manual_seed(0)
    config = transformers.Glm4MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
        n_group=2, topk_group=1, first_k_dense_replace=1, use_qk_norm=True, attention_bias=True)
    glm = transformers.Glm4MoeForCausalLM(config).to(device=device, dtype=dtype).eval()
    for module in glm.modules():  # expert weights outside from_pretrained are left uninitialised
        if hasattr(module, "gate_up_proj"):
            torch.nn.init.normal_(module.gate_up_proj, std=0.1)
            torch.nn.init.normal_(module.down_proj, std=0.1)
    if experts_implementation is not None:
        glm.config._experts_implementation = experts_implementation
    return glm


def inputs(tokens: int = 9):
    return torch.randint(0, 256, (tokens,)), torch.arange(tokens)


def as_is():
    return TokenModel(model()), inputs()


def enabled():
    return TokenModel(enable(model())), inputs()
