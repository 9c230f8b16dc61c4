"""Experiment: programmatic dependent launch for the Gluon decode kernel (see results/2026-11-29-h200-pdl-experiment.md)."""
import sys, os, json
sys.path.insert(0, "benchmarks")
import torch
from triton.testing import do_bench
from nvfp4 import copies_for, graph_ms
from piecewise.kernels.nvfp4 import dequantize, global_scale_for
from piecewise.kernels.nvfp4.reference import quantize_reference
from piecewise.kernels.nvfp4 import gluon_gemv
from piecewise.kernels.nvfp4.triton_gemm import w4a16_linear, GemvConfig
out = os.environ.get("OUT", ".")
l2 = torch.cuda.get_device_properties(0).L2_cache_size
res = []
for size in (4096, 8192):
    n = k = size
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    gs = global_scale_for(w); packed, scales = quantize_reference(w, gs); decode = torch.reciprocal(gs).reshape(())
    ref_w = dequantize(packed, scales, gs, dtype=torch.float32)
    copies = copies_for(n * k // 2 + n * k // 16, l2, 8)
    pc = [packed.clone() for _ in range(copies)]; sc = [scales.clone() for _ in range(copies)]
    dense = [w.clone() for _ in range(copies_for(n * k * 2, l2, 2))]
    for m in (1, 2, 4, 8, 16):
        xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        row = {"M": m, "N=K": size}
        row["bf16"] = graph_ms([(lambda i=i: torch.matmul(xs[i % 4], dense[i].T)) for i in range(len(dense))], do_bench)
        row["bf16_chain"] = graph_ms([(lambda i=i: (xs[i % 4].mul_(1.0), torch.matmul(xs[i % 4], dense[i].T))) for i in range(len(dense))], do_bench)
        row["producer"] = graph_ms([(lambda i=i: xs[i % 4].mul_(1.0)) for i in range(copies)], do_bench)
        for mode in ("off", "capture"):
            gluon_gemv.PDL = mode
            # correctness inside a graph with the mode
            g = torch.cuda.CUDAGraph(); outs = []
            s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                w4a16_linear(xs[0], packed, scales, decode)
            torch.cuda.current_stream().wait_stream(s)
            with torch.cuda.graph(g):
                for i in range(3):
                    xs[0].mul_(1.0); outs.append(w4a16_linear(xs[0], packed, scales, decode))
            g.replay(); torch.cuda.synchronize()
            exp = xs[0].float() @ ref_w.T
            row[f"err_{mode}"] = max(float((o.float() - exp).norm() / exp.norm()) for o in outs)
            row[f"ours_{mode}"] = graph_ms([(lambda i=i: w4a16_linear(xs[i % 4], pc[i], sc[i], decode)) for i in range(copies)], do_bench)
            row[f"chain_{mode}"] = graph_ms([(lambda i=i: (xs[i % 4].mul_(1.0), w4a16_linear(xs[i % 4], pc[i], sc[i], decode))) for i in range(copies)], do_bench)
        gluon_gemv.PDL = "capture"
        print(json.dumps({k: (round(v * 1e3, 2) if isinstance(v, float) and not k.startswith("err") else v) for k, v in row.items()}), flush=True)
        res.append(row)
json.dump(res, open(f"{out}/pdl.json", "w"), indent=1)
