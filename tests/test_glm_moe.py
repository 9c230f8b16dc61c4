"""The GLM-style MoE model on CPU: router semantics, experts, NVFP4 experts, piecewise parity, the doctor on an
HF-style expert loop."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import piecewise
from piecewise.kernels.nvfp4 import dequantize, quantize_linears
from piecewise.models.glm_moe import GlmMoeConfig, NVFP4Experts, example, quantize_experts, route


def route_per_token(logits, bias, c: GlmMoeConfig):
    """The glm4_moe router written out token by token (sets of experts, weights by expert)."""
    chosen = []
    for row, scores in enumerate(logits.float().sigmoid()):
        choice = scores + bias
        size = c.num_experts // c.n_group
        group_score = [sorted(choice[g * size : (g + 1) * size].tolist())[-2:] for g in range(c.n_group)]
        best_groups = sorted(range(c.n_group), key=lambda g: -sum(group_score[g]))[: c.topk_group]
        candidates = [e for g in best_groups for e in range(g * size, (g + 1) * size)]
        experts = sorted(candidates, key=lambda e: -float(choice[e]))[: c.top_k]
        weights = {e: float(scores[e]) for e in experts}
        total = sum(weights.values()) if c.norm_topk_prob else 1.0
        chosen.append({e: w / (total + (1e-20 if c.norm_topk_prob else 0)) * c.routed_scaling_factor for e, w in weights.items()})
    return chosen


@pytest.mark.parametrize("config", [
    GlmMoeConfig(num_experts=8, top_k=2, n_group=2, topk_group=1),
    GlmMoeConfig(num_experts=16, top_k=4, n_group=4, topk_group=2, norm_topk_prob=False, routed_scaling_factor=1.0),
    GlmMoeConfig(num_experts=12, top_k=3, n_group=1, topk_group=1),
])
def test_router_matches_the_per_token_rules(config):
    generator = torch.Generator().manual_seed(config.num_experts)
    logits = torch.randn(9, config.num_experts, generator=generator)
    # large enough to change choices, and to make some choice scores negative (masked experts must still lose)
    bias = torch.randn(config.num_experts, generator=generator) - 0.5
    weights, ids = route(logits, bias, config)
    expected = route_per_token(logits, bias, config)
    for row in range(9):
        got = {int(e): float(w) for e, w in zip(ids[row], weights[row])}
        assert set(got) == set(expected[row]), row
        for expert, weight in expected[row].items():
            assert got[expert] == pytest.approx(weight, rel=1e-6)
    unbiased_ids = route(logits, torch.zeros_like(bias), config)[1]
    assert not torch.equal(unbiased_ids.sort(dim=1).values, ids.sort(dim=1).values)  # the bias does choose


def moe_per_token(moe, x):
    """The MoE block token by token: Σ weight · expert(x) over the chosen experts, plus the shared expert."""
    weights, ids = route(F.linear(x.float(), moe.router.weight.float()), moe.e_score_correction_bias, moe.config)
    rows = []
    for t in range(x.shape[0]):
        total = torch.zeros(x.shape[1])
        for w, e in zip(weights[t], ids[t]):
            gate, up = (moe.experts.gate_up[e] @ x[t]).chunk(2)
            total += w * (moe.experts.down[e] @ (F.silu(gate) * up))
        gate, up = moe.shared_gate_up(x[t]).chunk(2)
        rows.append(total + moe.shared_down(F.silu(gate) * up))
    return torch.stack(rows)


def test_moe_block_equals_the_per_token_sum():
    model, _ = example(num_layers=2)
    moe = model.layers[1].mlp
    x = torch.randn(11, model.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(moe(x), moe_per_token(moe, x), rtol=1e-5, atol=1e-5)


def test_piecewise_equals_eager_and_cuts_at_the_experts():
    model, (ids, positions, cache) = example(tokens=7, num_layers=3, first_k_dense_replace=1)
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=16))
    with torch.no_grad():
        for tokens in (7, 1, 12, 16, 20):
            ids = torch.randint(0, model.config.vocab_size, (tokens,))
            positions = torch.arange(tokens)
            cache.zero_()
            out = runner(ids, positions, cache)
            ref = model(ids, positions, model.make_kv_cache())
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    stats = runner.stats
    assert stats["traces"] == 1
    assert stats["pieces"] == 3 + 2 + 1  # cut at 3 attentions and at the experts of the 2 MoE layers
    assert stats["splitting_op_calls"] == 5


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped-op", "splitting-op"])
def test_nvfp4_experts_compute_with_their_dequantized_weights(grouped):
    model, (ids, positions, cache) = example(tokens=5, num_layers=2, hidden_size=64, moe_intermediate_size=32)
    moe = model.layers[1].mlp
    x = torch.randn(6, 64)
    dense = moe.experts
    assert quantize_experts(model, grouped=grouped) == 1 and isinstance(moe.experts, NVFP4Experts)
    assert moe.experts.grouped is grouped
    for name in ("gate_up", "down"):  # put the NVFP4 values back into the dense experts: same sums expected
        q = moe.experts
        values = [dequantize(p, s, 1 / d, dtype=torch.float32)
                  for p, s, d in zip(getattr(q, name), getattr(q, f"{name}_scale"), getattr(q, f"{name}_scale_2"))]
        getattr(dense, name).data.copy_(torch.stack(values))
    with torch.no_grad():
        got = moe(x)
        moe.experts = dense
        expected = moe(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    replaced = quantize_linears(model, skip=("lm_head", "router"))
    assert "layers.1.mlp.shared_down" in replaced and not any("router" in name for name in replaced)


def test_config_errors_name_the_fields():
    with pytest.raises(ValueError, match="n_group=3 groups of at least 2"):
        GlmMoeConfig(num_experts=8, n_group=3)
    with pytest.raises(ValueError, match="top_k=5"):
        GlmMoeConfig(num_experts=8, n_group=2, topk_group=1, top_k=5)


class HFStyleExperts(nn.Module):
    """An expert loop written as HF transformers does: capture is impossible (it branches on token counts)."""

    def __init__(self, hidden=16, experts=4):
        super().__init__()
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(experts))

    def forward(self, x):
        weights, ids = self.router(x).sigmoid().topk(2, dim=-1)
        out = torch.zeros_like(x)
        mask = F.one_hot(ids, len(self.experts)).permute(2, 0, 1)
        for index, expert in enumerate(self.experts):
            token, slot = torch.where(mask[index])
            if token.numel() > 0:  # the blocker
                out.index_add_(0, token, expert(x[token]) * weights[token, slot, None])
        return out


def test_the_runtime_runs_a_data_dependent_expert_loop_eagerly_with_a_warning_not_a_dynamo_error():
    model = HFStyleExperts()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend="dynamo"))
    with torch.no_grad():
        with pytest.warns(UserWarning, match=r"(?s)runs eagerly between captured pieces.*Data-dependent branching: "
                                             r"a Python condition.*test_glm_moe.py:\d+ in forward"):
            x = torch.randn(5, 16)
            torch.testing.assert_close(runner(x), model(x))
        for tokens in (3, 12):
            x = torch.randn(tokens, 16)
            torch.testing.assert_close(runner(x), model(x))


def test_doctor_names_the_expert_loop_and_the_splitting_op_fix():
    report = piecewise.doctor(HFStyleExperts(), torch.randn(5, 16))
    assert not report.ok
    blocker = report.blockers[0]
    assert blocker.location.code.strip() == "if token.numel() > 0:  # the blocker"
    assert blocker.location.function == "forward"
    assert "split=True" in blocker.fix and "MoE" in blocker.fix
