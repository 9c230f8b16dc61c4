"""NVFP4 Triton kernels on CUDA: byte-exact with the reference, GEMM parity, capture in CUDA graphs."""

import pytest
import torch

import piecewise
from piecewise.kernels.nvfp4 import NVFP4Linear, dequantize, global_scale_for, linear, quantize
from piecewise.kernels.nvfp4 import reference, swizzle_scales

pytest.importorskip("triton")  # the kernel modules below need it (a CPU machine may not have it)
from piecewise.kernels.nvfp4.gluon_gemv import AVAILABLE as GLUON, PREFILL_AVAILABLE, WGMMA_AVAILABLE, GemvConfig, WgmmaConfig
from piecewise.kernels.nvfp4.gluon_gemv import PrefillConfig
from piecewise.kernels.nvfp4.gluon_gemv import pick_gemv_config, pick_wgmma_config
from piecewise.kernels.nvfp4.triton_gemm import GemmConfig, pick_config, select_config, sm_count, w4a16_linear

pytestmark = pytest.mark.gpu

SHAPES = [(1, 16), (3, 48), (8, 512), (127, 1040), (128, 4096), (300, 272), (1000, 512), (2049, 64)]


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).norm() / expected.float().norm())


def tricky(rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Gaussian rows of very different magnitudes, plus a zero row, exact grid values, ties and outliers."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=generator) * 10 ** (torch.rand(rows, 1, generator=generator) * 4 - 2)
    if rows >= 4 and cols >= 16:
        x[0] = 0.0
        x[1, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 6, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5, -6])
        x[2] *= 1e-4
        x[3, ::7] = 1e3
    return x.to(dtype)


def assert_bytes_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    a, e = actual.cpu().view(torch.uint8), expected.cpu().view(torch.uint8)
    assert a.shape == e.shape
    mismatches = (a != e).nonzero()
    assert mismatches.numel() == 0, f"{len(mismatches)} bytes differ, first at {mismatches[:5].tolist()}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_quantize_is_byte_exact_with_the_reference(shape, dtype):
    x_cpu = tricky(*shape, dtype, seed=shape[0] * 7 + shape[1])
    x = x_cpu.cuda()
    amax = float(x_cpu.float().abs().max())
    # Usual scale, a saturating one (clamps at 448) and one that puts scales among E4M3 subnormals.
    for scale in (float(global_scale_for(x_cpu)), 1e3 * 2688 / amax, 2688 / amax / 2**12):
        gs = torch.tensor(scale, dtype=torch.float32)
        expected_packed, expected_scales = reference.quantize_reference(x_cpu, gs)
        for swizzle in (False, True):
            packed, scales = quantize(x, gs.cuda(), swizzle=swizzle)
            assert packed.is_cuda and scales.dtype == torch.float8_e4m3fn
            assert_bytes_equal(packed, expected_packed)
            assert_bytes_equal(scales, swizzle_scales(expected_scales) if swizzle else expected_scales)
        # The reference run on CUDA tensors agrees too (it is what CPU-less users of the reference get).
        cuda_packed, cuda_scales = reference.quantize_reference(x, gs.cuda())
        assert_bytes_equal(cuda_packed, expected_packed)
        assert_bytes_equal(cuda_scales, expected_scales)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_dequantize_is_exact(shape, out_dtype):
    x_cpu = tricky(*shape, torch.float32, seed=shape[1])
    gs = global_scale_for(x_cpu)
    packed, scales = reference.quantize_reference(x_cpu, gs)
    expected = reference.dequantize_reference(packed, scales, gs, out_dtype)
    out = dequantize(packed.cuda(), scales.cuda(), gs.cuda(), dtype=out_dtype)
    assert out.dtype == out_dtype
    # Values must be identical; the sign of a zero (code 0x8, "-0") may differ, and -0 == +0.
    assert torch.equal(out.cpu(), expected)
    swizzled = dequantize(packed.cuda(), swizzle_scales(scales).cuda(), gs.cuda(), dtype=out_dtype, swizzled=True)
    assert torch.equal(swizzled.cpu(), expected)


def random_weight(out_features: int, in_features: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.02
    gs = global_scale_for(weight)
    packed, scales = reference.quantize_reference(weight, gs)
    return packed.cuda(), scales.cuda(), torch.reciprocal(gs).cuda()


@pytest.mark.parametrize("rows", [1, 3, 16, 64, 300, 1024])
@pytest.mark.parametrize("out_features,in_features", [(256, 512), (4096, 4096), (1000, 1040), (384, 11008)])
def test_gemm_matches_dequantize_then_matmul(rows, out_features, in_features):
    packed, scales, decode = random_weight(out_features, in_features, seed=rows + in_features)
    x = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(out_features, device="cuda", dtype=torch.bfloat16)
    dense = dequantize(packed, scales, torch.reciprocal(decode), dtype=torch.float32)
    for b in (None, bias):
        expected = x.float() @ dense.T + (b.float() if b is not None else 0.0)
        out = linear(x, packed, scales, decode, b)
        assert out.shape == (rows, out_features) and out.dtype == torch.bfloat16
        assert rel_error(out, expected) <= 1e-2


@pytest.mark.parametrize(
    "config",
    [
        GemmConfig(16, 64, 128, 4, 4, split_k=1),
        GemmConfig(16, 64, 128, 4, 4, split_k=7),  # uneven split: the last split runs past K
        GemmConfig(32, 32, 64, 4, 2, split_k=3),  # below wgmma's 64 rows: mma.sync path
        GemmConfig(128, 128, 64, 8, 3, split_k=2),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemm_configs_and_fp16_activations(config, dtype):
    packed, scales, decode = random_weight(520, 1040, seed=3)
    x = torch.randn(37, 1040, device="cuda", dtype=dtype)
    bias = torch.randn(520, device="cuda", dtype=dtype)
    dense = dequantize(packed, scales, torch.reciprocal(decode), dtype=torch.float32)
    out = w4a16_linear(x, packed, scales, decode, bias, config=config)
    assert out.dtype == dtype
    assert rel_error(out, x.float() @ dense.T + bias.float()) <= 1e-2


def test_config_table_splits_k_for_decode_and_not_for_prefill():
    sms = sm_count(torch.cuda.current_device())
    for size in (4096, 8192):
        config = pick_config(1, size, size, sms)
        k_steps = size // config.block_k
        assert config.split_k > 1 and k_steps % config.split_k == 0
        assert config.split_k & (config.split_k - 1) == 0
    assert pick_config(200, 4096, 4096, sms).block_m == 128


def assert_matches_dense_and_tl(rows, packed, scales, decode, dtype, config, tl_config):
    """A Gluon kernel's output, with and without bias, against dequantize + matmul and (same products, float32
    summation order aside) the tl kernel."""
    out_features, in_features = packed.shape[0], packed.shape[1] * 2
    x = torch.randn(rows, in_features, device="cuda", dtype=dtype) * 3
    bias = torch.randn(out_features, device="cuda", dtype=dtype)
    dense = dequantize(packed, scales, torch.reciprocal(decode), dtype=torch.float32)
    for b in (None, bias):
        out = w4a16_linear(x, packed, scales, decode, b, config=config)
        expected = x.float() @ dense.T + (b.float() if b is not None else 0.0)
        assert out.dtype == dtype and out.shape == (rows, out_features)
        assert rel_error(out, expected) <= 1e-2
        assert rel_error(out, w4a16_linear(x, packed, scales, decode, b, config=tl_config)) <= 2e-3


@pytest.mark.skipif(not GLUON, reason="this Triton has no Gluon")
@pytest.mark.parametrize("rows", [1, 5, 8, 9, 16])
@pytest.mark.parametrize(
    "out_features,in_features,config",
    [
        (4096, 4096, None),  # the table's pick
        (48, 384, GemvConfig(warps_k=1)),
        (1536, 5120, None),
        (256, 2048, GemvConfig(warps_k=4, row_tiles=2, steps=2)),
        (512, 4096, GemvConfig(warps_k=16, row_tiles=1, steps=2, prefetch=2)),
        (240, 1024, GemvConfig(warps_k=2, row_tiles=1, steps=4)),
        (1000, 1024, GemvConfig(warps_k=8, row_tiles=2, steps=1)),  # N not a multiple of the row tile
        (4352, 2048, None),  # a wide layer: 4 warps on K, 4 steps (≤ 8 tokens) or 2 in flight (9..16)
        (2048, 5632, GemvConfig(warps_k=8, steps=1, prefetch=2)),  # 44 steps on 8 warps: the last takes 2 of 6
        (300, 1408, GemvConfig(warps_k=16, row_tiles=2)),  # 11 steps on 16 warps: 5 warps have none
        (2048, 5632, None),
        (1536, 1408, None),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gluon_decode_kernel_matches_dequantize_then_matmul(rows, out_features, in_features, config, dtype):
    packed, scales, decode = random_weight(out_features, in_features, seed=rows * 7 + in_features)
    config = config or pick_gemv_config(rows, out_features, in_features, sm_count(torch.cuda.current_device()))
    assert config is not None
    assert_matches_dense_and_tl(rows, packed, scales, decode, dtype, config, GemmConfig(16, 64, 128, 4, 3))


def test_decode_kernel_is_picked_only_where_it_applies():
    sms = sm_count(torch.cuda.current_device())
    assert pick_gemv_config(1, 4096, 4096, sms) is not None
    assert pick_gemv_config(16, 8192, 8192, sms).row_tiles == 2
    assert pick_gemv_config(1, 8192, 8192, sms).warps_k * pick_gemv_config(1, 8192, 8192, sms).steps == 16
    assert pick_gemv_config(1, 1000, 1040, sms) is None  # K not a multiple of 128: the tl kernel runs


HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.skipif(not (WGMMA_AVAILABLE and HOPPER), reason="the wgmma kernel needs Gluon and sm_90")
@pytest.mark.parametrize("rows", [17, 33, 64, 100, 255])
@pytest.mark.parametrize(
    "out_features,in_features,config",
    [
        (4096, 4096, None),  # the table's pick
        (4352, 2048, None),  # a wide layer
        (1000, 2048, WgmmaConfig(64, 8, 1)),  # N not a multiple of the 128 rows of a program
        (520, 384, WgmmaConfig(32, 4, 1)),  # 3 iterations
        (64, 128, WgmmaConfig(128, 4, 1)),  # one iteration, one program of rows
        (256, 1024, WgmmaConfig(16, 8, 2)),
        (384, 11008, None),  # K = 86 steps of 128
        # split over K: the last program of a tile adds the float32 partials
        (1000, 2048, WgmmaConfig(64, 8, 1, split_k=4)),  # 4 iterations each; N not a multiple of 128
        (256, 1024, WgmmaConfig(32, 4, 2, split_k=4)),  # one iteration per split
        (520, 384, WgmmaConfig(32, 4, 1, split_k=2)),  # 3 iterations do not split: one program
        (384, 11008, WgmmaConfig(32, 4, 1, split_k=8)),  # 86 iterations: split in two
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gluon_wgmma_kernel_matches_dequantize_then_matmul(rows, out_features, in_features, config, dtype):
    packed, scales, decode = random_weight(out_features, in_features, seed=rows * 5 + in_features)
    config = config or pick_wgmma_config(rows, out_features, in_features, sm_count(torch.cuda.current_device()))
    assert isinstance(config, WgmmaConfig)
    assert_matches_dense_and_tl(rows, packed, scales, decode, dtype, config, GemmConfig(64, 64, 128, 4, 3))


@pytest.mark.skipif(not (WGMMA_AVAILABLE and HOPPER), reason="the wgmma kernel needs Gluon and sm_90")
def test_each_token_count_gets_its_kernel():
    device = torch.cuda.current_device()
    assert isinstance(select_config(16, 4096, 4096, torch.bfloat16, device), GemvConfig)
    for rows in (17, 32, 128, 255):
        assert isinstance(select_config(rows, 4096, 4096, torch.bfloat16, device), WgmmaConfig)
    assert select_config(256, 4096, 4096, torch.bfloat16, device) is None  # dequantize + cuBLAS
    fp16_prefill = select_config(256, 4096, 4096, torch.float16, device)
    assert isinstance(fp16_prefill, PrefillConfig if PREFILL_AVAILABLE else GemmConfig)
    assert isinstance(select_config(300, 1000, 1040, torch.float16, device), GemmConfig)  # K not a multiple of 64
    big_bf16 = select_config(256, 8192, 8192, torch.bfloat16, device)  # a large layer: no dequantize pass
    assert isinstance(big_bf16, PrefillConfig) if PREFILL_AVAILABLE else big_bf16 is None
    assert isinstance(select_config(64, 1000, 1040, torch.bfloat16, device), GemmConfig)  # K not a multiple of 128


@pytest.mark.skipif(not (PREFILL_AVAILABLE and HOPPER), reason="the prefill kernel needs Gluon and sm_90")
@pytest.mark.parametrize("rows", [1, 200, 256, 300, 1024])
@pytest.mark.parametrize(
    "out_features,in_features,config",
    [
        (4096, 4096, None),  # the pick
        (1000, 1408, PrefillConfig(128, 128)),  # N not a multiple of 128, K = 22 iterations of 64
        (200, 128, PrefillConfig(256, 64)),  # 2 iterations: the first refill is past the end
        (384, 64, PrefillConfig(128, 256)),  # one iteration
        (256, 11008, PrefillConfig(256, 128)),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gluon_prefill_kernel_matches_dequantize_then_matmul(rows, out_features, in_features, config, dtype):
    packed, scales, decode = random_weight(out_features, in_features, seed=rows * 3 + in_features)
    config = config or PrefillConfig()
    assert_matches_dense_and_tl(rows, packed, scales, decode, dtype, config, GemmConfig(64, 64, 64, 4, 3))


@pytest.mark.skipif(not (PREFILL_AVAILABLE and HOPPER), reason="the prefill kernel needs Gluon and sm_90")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gluon_prefill_kernel_subnormal_scales_and_activation_views(dtype):
    """E4M3-subnormal block scales; activation views: a column slice (read through its row stride), a base off
    16 bytes (copied: TMA cannot address it)."""
    packed, scales, decode = subnormal_scale_weight(512, 1024)
    dense = dequantize(packed, scales, torch.reciprocal(decode), dtype=torch.float32)
    wide = torch.randn(300, 1024 + 72, device="cuda", dtype=dtype)
    for x in (wide[:, :1024], wide.flatten()[1:1 + 300 * 1024].view(300, 1024), wide[:, 8:1032].contiguous()):
        out = w4a16_linear(x, packed, scales, decode, config=PrefillConfig(128, 128))
        expected = x.float() @ dense.T
        assert rel_error(out[:, :256], expected[:, :256]) <= 1e-2  # the subnormal-scale rows
        assert rel_error(out[:, 256:], expected[:, 256:]) <= 1e-2


@pytest.mark.skipif(not (PREFILL_AVAILABLE and HOPPER), reason="the prefill kernel needs Gluon and sm_90")
def test_gluon_prefill_kernel_captures_in_a_cuda_graph():
    packed, scales, decode = random_weight(1024, 2048, seed=11)
    x = torch.randn(512, 2048, device="cuda", dtype=torch.float16)
    eager = w4a16_linear(x, packed, scales, decode)
    assert isinstance(select_config(512, 1024, 2048, torch.float16, 0), PrefillConfig)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = w4a16_linear(x, packed, scales, decode)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(captured, w4a16_linear(x, packed, scales, decode)) and not torch.equal(captured, eager)


@pytest.mark.parametrize("rows,kernel,dtype", [(3, "w4a16_gemv", torch.bfloat16), (40, "w4a16_wgmma", torch.bfloat16),
                                              (300, "w4a16_prefill", torch.float16)])
def test_a_gluon_failure_falls_back_to_the_tl_kernel_with_one_warning(monkeypatch, caplog, rows, kernel, dtype):
    from piecewise.kernels.nvfp4 import gluon_gemv, triton_gemm

    packed, scales, decode = random_weight(256, 1024, seed=5)
    x = torch.randn(rows, 1024, device="cuda", dtype=dtype)
    expected = w4a16_linear(x, packed, scales, decode, config=pick_config(rows, 256, 1024, sm_count(0)))

    def broken(*args, **kwargs):
        raise AttributeError("module 'triton.experimental.gluon.language' has no attribute 'DistributedLinearLayout'")

    monkeypatch.setattr(gluon_gemv, kernel, broken)
    monkeypatch.setattr(triton_gemm, "_gluon_failure", {})
    if not isinstance(select_config(rows, 256, 1024, dtype, 0), (GemvConfig, WgmmaConfig, PrefillConfig)):
        pytest.skip("no Gluon kernel for this call on this GPU")
    with caplog.at_level("WARNING", logger="piecewise.kernels.nvfp4.triton_gemm"):
        first = w4a16_linear(x, packed, scales, decode)
        second = w4a16_linear(x, packed, scales, decode)
    assert torch.equal(first, expected) and torch.equal(second, expected)
    warnings = [r.getMessage() for r in caplog.records]
    name = {"w4a16_gemv": "decode", "w4a16_wgmma": "wgmma", "w4a16_prefill": "prefill"}[kernel]
    assert len(warnings) == 1 and f"Gluon {name} kernel failed" in warnings[0] and "DistributedLinearLayout" in warnings[0]
    assert set(triton_gemm._gluon_failure) == {name}  # the other Gluon kernel stays on


def subnormal_scale_weight(out_features: int, in_features: int):
    """A weight whose first half of rows is ~2e-5 of the rest: all their block scales are E4M3 subnormals."""
    generator = torch.Generator(device="cuda").manual_seed(7)
    weight = torch.randn(out_features, in_features, device="cuda", generator=generator) * 0.02
    weight[: out_features // 2] *= 2e-5
    gs = global_scale_for(weight)
    packed, scales = reference.quantize_reference(weight, gs)
    exponent = scales.view(torch.uint8) >> 3
    assert bool((exponent[: out_features // 2] == 0).all()) and bool((scales[: out_features // 2].float() > 0).any())
    return packed, scales, torch.reciprocal(gs)


@pytest.mark.parametrize("rows", [1, 16, 100, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemm_with_subnormal_block_scales(rows, dtype):
    packed, scales, decode = subnormal_scale_weight(512, 1024)
    dense = dequantize(packed, scales, torch.reciprocal(decode), dtype=torch.float32)
    x = torch.randn(rows, 1024, device="cuda", dtype=dtype)
    out = w4a16_linear(x, packed, scales, decode)
    expected = x.float() @ dense.T
    # The tiny half alone: flushing subnormal scales to zero would zero it.
    assert rel_error(out[:, :256], expected[:, :256]) <= 1e-2
    assert rel_error(out[:, 256:], expected[:, 256:]) <= 1e-2


def assert_same_on_two_streams(call, expected):
    """``call()`` 10 times on each of two streams, interleaved: every result equals ``expected`` bit for bit."""
    streams = [torch.cuda.Stream() for _ in range(2)]
    results = []
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())
    for _ in range(10):
        for stream in streams:
            with torch.cuda.stream(stream):
                results.append(call())
    torch.cuda.synchronize()
    assert all(torch.equal(r, expected) for r in results)


def test_split_k_is_deterministic_across_calls_and_streams():
    packed, scales, decode = random_weight(4096, 4096, seed=11)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    config = pick_config(1, 4096, 4096, sm_count(torch.cuda.current_device()))
    assert config.split_k > 1
    first = w4a16_linear(x, packed, scales, decode, config=config)
    assert_same_on_two_streams(lambda: w4a16_linear(x, packed, scales, decode, config=config), first)


@pytest.mark.skipif(not (WGMMA_AVAILABLE and HOPPER), reason="the wgmma kernel needs Gluon and sm_90")
def test_split_wgmma_kernel_is_deterministic_and_replays_in_a_cuda_graph():
    """Split over K, every call gives the same bits (the partials are added in split order), on two streams
    and in a captured graph replayed with new activations; the counters are back at zero after each call."""
    from piecewise.kernels.nvfp4 import splitk

    packed, scales, decode = random_weight(2048, 4096, seed=12)
    config = WgmmaConfig(32, 4, 2, split_k=8)
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    first = w4a16_linear(x, packed, scales, decode, config=config)
    assert rel_error(first, w4a16_linear(x, packed, scales, decode, config=GemmConfig(64, 64, 128, 4, 3))) <= 1e-2
    assert_same_on_two_streams(lambda: w4a16_linear(x, packed, scales, decode, config=config), first)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = w4a16_linear(x, packed, scales, decode, config=config)
    x.copy_(torch.randn_like(x))
    for _ in range(3):
        graph.replay()
    assert torch.equal(captured, w4a16_linear(x, packed, scales, decode, config=config))
    torch.cuda.synchronize()
    assert all(int(counters.count_nonzero()) == 0 for counters in splitk._counters.values())


def test_nvfp4_linear_from_linear_on_cuda_matches_cpu():
    torch.manual_seed(0)
    dense = torch.nn.Linear(1024, 768).to(torch.bfloat16)
    on_cpu = NVFP4Linear.from_linear(dense)
    on_gpu = NVFP4Linear.from_linear(dense.cuda())  # quantized by the Triton kernel
    assert_bytes_equal(on_gpu.weight, on_cpu.weight)
    assert_bytes_equal(on_gpu.weight_scale, on_cpu.weight_scale)
    x = torch.randn(9, 1024, dtype=torch.bfloat16)
    assert rel_error(on_gpu(x.cuda()), on_cpu(x).cuda()) <= 1e-2
    assert rel_error(on_gpu(x.cuda()), dense(x.cuda())) < 0.13  # the format's error bound (tests/test_nvfp4.py)


def test_fp32_activations_on_cuda_are_rejected_with_a_remedy():
    layer = NVFP4Linear.from_linear(torch.nn.Linear(64, 32).to(torch.bfloat16)).cuda()
    with pytest.raises(ValueError, match="bf16/fp16"):
        layer(torch.randn(2, 64, device="cuda"))


@pytest.mark.parametrize("tokens", [1, 16, 40, 200])
def test_nvfp4_linear_in_a_cuda_graph_equals_eager(tokens):
    torch.manual_seed(tokens)
    layer = NVFP4Linear.from_linear(torch.nn.Linear(2048, 1536).to(torch.bfloat16).cuda())
    static_x = torch.randn(tokens, 2048, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(static_x)  # compiles the Triton kernels outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = layer(static_x)
    for _ in range(3):
        static_x.copy_(torch.randn(tokens, 2048, device="cuda", dtype=torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, layer(static_x))


def test_quantize_captures_in_a_cuda_graph():
    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
    gs = global_scale_for(x)
    expected = quantize(x, gs, swizzle=True)  # eager call: value checks, kernel compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        packed, scales = quantize(x, gs, swizzle=True)  # no host sync allowed here
    graph.replay()
    torch.cuda.synchronize()
    assert_bytes_equal(packed, expected[0])
    assert_bytes_equal(scales, expected[1])


class MLP(torch.nn.Module):
    """Linear → SiLU → NVFP4Linear → residual: a Linear-ish stack with one NVFP4 layer."""

    def __init__(self, hidden: int = 512, inner: int = 1024):
        super().__init__()
        self.up = torch.nn.Linear(hidden, inner, dtype=torch.bfloat16, device="cuda")
        self.down = NVFP4Linear.from_linear(torch.nn.Linear(inner, hidden, dtype=torch.bfloat16, device="cuda"))

    def forward(self, x):
        return x + self.down(torch.nn.functional.silu(self.up(x)))


def test_nvfp4_linear_in_a_piecewise_model_equals_eager():
    torch.manual_seed(0)
    model = MLP()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=64), dynamic={"x": 0})
    for tokens in (1, 3, 16, 40, 64):
        x = torch.randn(tokens, 512, device="cuda", dtype=torch.bfloat16)
        replays = runner.stats["replays"]
        out = runner(x)
        # Padded token counts may pick another GEMM configuration (another summation order): not bitwise.
        assert rel_error(out, model(x)) <= 1e-2, tokens
        assert runner.stats["replays"] > replays, f"{tokens} tokens did not replay a graph"
    assert runner.stats["graphs"] > 0
    assert runner.stats["traces"] == 1
