"""Scratch: quantize block-shape sweep (device)."""
import torch
from triton.testing import do_bench
from piecewise.kernels.nvfp4 import global_scale_for
from piecewise.kernels.nvfp4 import triton_quant as q
from piecewise.kernels.nvfp4.reference import quantize_reference
x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
gs = global_scale_for(x)
nbytes = 8192 * 8192 * (2 + 0.5 + 1 / 16)
ref = quantize_reference(x[:512], gs)
for rows, groups, warps in ((8, 32, 4), (16, 32, 4), (32, 32, 4), (16, 32, 8), (32, 32, 8), (16, 64, 8)):
    q._QUANT_BLOCK_ROWS, q._QUANT_BLOCK_GROUPS, q._QUANT_WARPS = rows, groups, warps
    run = lambda: q.quantize_triton(x, gs, False)
    packed, scales = run()
    exact = torch.equal(packed[:512], ref[0]) and torch.equal(scales[:512].view(torch.uint8), ref[1].view(torch.uint8))
    ms = do_bench(run, warmup=25, rep=200, return_mode="median")
    print(f"quantize rows={rows} groups={groups} warps={warps}: {ms*1e3:.1f} us {nbytes/ms/1e9:.0f} GB/s {nbytes/ms/1e9/4241:.0%} exact={exact}", flush=True)
