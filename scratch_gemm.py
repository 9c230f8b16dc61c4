"""Scratch: correctness + config sweep of the W4A16 kernel (device)."""
import json, os, sys, time, math
import torch, triton
from triton.testing import do_bench
sys.path.insert(0, "benchmarks")
from nvfp4 import graph_ms, copies_for
from piecewise.kernels.nvfp4 import dequantize, global_scale_for
from piecewise.kernels.nvfp4.reference import quantize_reference
from piecewise.kernels.nvfp4.triton_gemm import GemmConfig, w4a16_linear, prepack_weight, pick_config, sm_count

out_dir = os.environ.get("OUT", "out"); os.makedirs(out_dir, exist_ok=True)
log = open(f"{out_dir}/scratch.txt", "w")
def say(*a):
    s = " ".join(str(x) for x in a); print(s, flush=True); log.write(s + "\n"); log.flush()

def rel(a, b): return float((a.float() - b.float()).norm() / b.float().norm())

def weight(n, k, seed, subnormal=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.float32) * 0.02
    if subnormal:  # some rows with tiny blocks → E4M3 subnormal scales
        w[: n // 2, : k // 2] *= 1e-5
    gs = global_scale_for(w)
    packed, scales = quantize_reference(w, gs)
    return packed, scales, torch.reciprocal(gs)

t0 = time.time()
# --- correctness
for (n, k) in [(256, 512), (520, 1040), (4096, 4096), (384, 11008)]:
    for sub in (False, True):
        packed, scales, decode = weight(n, k, n + k, sub)
        dense = dequantize(packed, scales, torch.reciprocal(decode), dtype=torch.float32)
        nsub = int(((scales.view(torch.uint8) >> 3) == 0).sum())
        for dt in (torch.bfloat16, torch.float16):
            for rows in (1, 3, 16, 64, 300):
                x = torch.randn(rows, k, device="cuda", dtype=dt)
                exp = x.float() @ dense.T
                configs = [None, GemmConfig(16, 64, 128, 4, 4, 7), GemmConfig(128, 128, 64, 8, 3, 2), GemmConfig(32, 32, 64, 4, 2, 3)]
                for c in configs:
                    o = w4a16_linear(x, packed, scales, decode, config=c)
                    e = rel(o, exp)
                    if e > 1e-2: say("FAIL", n, k, sub, dt, rows, c, e)
                if k % 128 == 0:
                    pp = prepack_weight(packed)
                    for c in [GemmConfig(16, 64, 128, 4, 4, 1), GemmConfig(16, 64, 256, 4, 3, 4), GemmConfig(128, 128, 128, 8, 3, 1)]:
                        o = w4a16_linear(x, pp, scales, decode, config=c, prepacked=True)
                        e = rel(o, exp)
                        if e > 1e-2: say("FAIL perm", n, k, sub, dt, rows, c, e)
        say("checked", n, k, "subnormal scales:", nsub)
# exactness of subnormal scale path: rows with only-subnormal blocks
say("correctness done", round(time.time() - t0, 1), "s")

bw = 4241e9
res = []
def bench(size, m, cands):
    n = k = size
    packed, scales, decode = weight(n, k, 1)
    pp = prepack_weight(packed)
    wb = n * k // 2 + n * k // 16
    copies = copies_for(wb, 50 * 2**20, 8)
    P = [packed.clone() for _ in range(copies)]; PP = [pp.clone() for _ in range(copies)]
    S = [scales.clone() for _ in range(copies)]
    xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    floor = (wb + m * k * 2 + m * n * 2) / bw * 1e3
    rows = []
    for c, perm in cands:
        W = PP if perm else P
        calls = [(lambda i=i: w4a16_linear(xs[i % 4], W[i], S[i], decode, config=c, prepacked=perm)) for i in range(copies)]
        try:
            ms = graph_ms(calls, do_bench)
        except Exception as ex:
            say("ERR", size, m, c, perm, type(ex).__name__, str(ex)[:200]); continue
        rows.append((ms, c, perm))
    rows.sort(key=lambda r: r[0])
    for ms, c, perm in rows[:4]:
        say(f"K=N={size} M={m} {ms*1e3:.1f}us roof {floor/ms:.0%} perm={perm} {c}")
        res.append({"size": size, "M": m, "us": ms * 1e3, "roof": floor / ms, "perm": perm, "config": c.__dict__})
    dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies_for(n * k * 2, 50 * 2**20, 2))]
    bms = graph_ms([(lambda i=i: xs[0] @ dense[i].T) for i in range(len(dense))], do_bench)
    say(f"  bf16 {bms*1e3:.1f}us  best speedup {bms/rows[0][0]:.2f}x")

small = []
for bn, bk, w, st in ((64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 4, 4), (128, 256, 8, 3)):
    for split in (1, 2, 4, 8, 16):
        for perm in (True, False):
            small.append((GemmConfig(16, bn, bk, w, st, split), perm))
for size in (4096, 8192):
    bench(size, 1, small)
    say("t", round(time.time() - t0))
bench(4096, 16, small[::2])
mid = [(GemmConfig(64, bn, bk, w, st, split), perm) for bn, bk, w, st in ((64, 128, 4, 3), (128, 128, 4, 3), (128, 128, 8, 3)) for split in (1, 2, 4, 8) for perm in (True, False)]
bench(4096, 64, mid)
big = [(GemmConfig(bm, bn, bk, w, st, split), perm) for bm, bn, bk, w, st in ((128, 128, 128, 8, 3), (128, 128, 128, 8, 4), (128, 256, 128, 8, 3), (64, 128, 128, 4, 4), (128, 128, 64, 8, 4)) for split in (1,) for perm in (True, False) if not (perm and bk < 128)]
for size in (4096, 8192):
    bench(size, 1024, big)
    bench(size, 4096, big)
    say("t", round(time.time() - t0))
json.dump(res, open(f"{out_dir}/scratch.json", "w"), indent=1)
