"""ModelOpt NVFP4 checkpoints on CUDA: the grouped experts kernel with a decode scale per gate/up half, and a
loaded model in bf16 on CUDA graphs."""

import pytest
import torch

import piecewise

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from test_modelopt_checkpoint import QUANT_CONFIG, _quantized, fresh, modelopt_checkpoint, prefill_and_decode  # noqa: E402
from test_transformers_zoo import build  # noqa: E402

from piecewise.integrations.modelopt import load_modelopt_nvfp4  # noqa: E402
from piecewise.integrations.transformers import TokenModel, enable  # noqa: E402
from piecewise.kernels.nvfp4.moe import moe_nvfp4_cuda, moe_nvfp4_reference  # noqa: E402


def rel_error(out, ref):
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def test_grouped_kernel_applies_each_halfs_decode_scale():
    """Up weights 8× larger than the gate's: their decode scales differ by ~8×, and the kernel must use each
    half's own (the gate's for both would be off by that factor)."""
    torch.manual_seed(0)
    experts, inter, hidden, tokens = 4, 128, 256, 40
    stacked = []
    for e in range(experts):
        parts = [_quantized(w)[0] for w in (torch.randn(inter, hidden), 8 * torch.randn(inter, hidden),
                                             torch.randn(hidden, inter))]
        stacked.append(parts)
    gate_up = torch.stack([torch.cat([g["weight"], u["weight"]]) for g, u, _ in stacked]).cuda()
    gate_up_scale = torch.stack([torch.cat([g["weight_scale"], u["weight_scale"]]) for g, u, _ in stacked]).cuda()
    gate_up_scale_2 = torch.stack([torch.stack([g["weight_scale_2"], u["weight_scale_2"]]) for g, u, _ in stacked]).cuda()
    down = torch.stack([d["weight"] for _, _, d in stacked]).cuda()
    down_scale = torch.stack([d["weight_scale"] for _, _, d in stacked]).cuda()
    down_scale_2 = torch.stack([d["weight_scale_2"] for _, _, d in stacked]).cuda()
    assert float((gate_up_scale_2[:, 1] / gate_up_scale_2[:, 0]).min()) > 4
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, experts, (tokens, 2), device="cuda")
    weights = torch.rand(tokens, 2, device="cuda")
    args = (gate_up, gate_up_scale, gate_up_scale_2, down, down_scale, down_scale_2)
    out = moe_nvfp4_cuda(x, ids, weights, *args)
    expected = moe_nvfp4_reference(x.float().cpu(), ids.cpu(), weights.cpu(), *(a.cpu() for a in args))
    assert rel_error(out.cpu(), expected) <= 1e-2


@pytest.mark.parametrize("name,meta", [("Qwen3Moe", False), ("Glm4Moe", True)])
def test_a_loaded_checkpoint_on_cuda_graphs(name, meta):
    """bf16 on CUDA (GLM-4-MoE built on the meta device and loaded to CUDA): the graphs replay what the same
    model computes eagerly, bit for bit, and both are within bf16 rounding of transformers' float32 forward on
    the dequantized weights."""
    model = build(name)
    tensors, expected = modelopt_checkpoint(model)
    if meta:
        with torch.device("meta"):
            loaded = transformers.AutoModelForCausalLM.from_config(model.config, torch_dtype=torch.bfloat16).eval()
    else:
        loaded = fresh(name, torch.bfloat16).cuda()
    load_modelopt_nvfp4(loaded, tensors, quant_config=QUANT_CONFIG, device="cuda")
    assert all(t.is_cuda for t in loaded.state_dict().values())
    ids = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        reference = expected(input_ids=ids[None], use_cache=False).logits[0]
    token_model = TokenModel(enable(loaded))
    runner = piecewise.compile(token_model, piecewise.CaptureConfig(max_tokens=16))
    graphs = prefill_and_decode(runner, token_model, ids.cuda(), "cuda")
    eager = prefill_and_decode(token_model, token_model, ids.cuda(), "cuda")
    assert runner.stats["cuda_graphs"] and runner.stats["replays"] > 0
    assert torch.equal(graphs, eager)
    assert rel_error(graphs.cpu(), reference) <= 3e-2
