"""NVFP4 reference semantics, layouts and NVFP4Linear on CPU (the Triton kernels are checked in tests/gpu)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from piecewise.kernels import nvfp4
from piecewise.kernels.nvfp4 import NVFP4Linear, dequantize, global_scale_for, quantize
from piecewise.kernels.nvfp4.layout import swizzled_offset
from piecewise.kernels.nvfp4.reference import E2M1_MAGNITUDES, unpack_codes

FAST = settings(max_examples=15, deadline=None)


def codes_of(x: torch.Tensor, global_scale: float) -> torch.Tensor:
    packed, _ = quantize(x, global_scale)
    return unpack_codes(packed)


def block_with_six(values: list[float]) -> torch.Tensor:
    """One row: ``values`` padded to blocks of 16, each block holding a 6 so that gs=1 gives scale exactly 1."""
    rows = []
    for start in range(0, len(values), 15):
        chunk = values[start : start + 15]
        rows += chunk + [0.0] * (15 - len(chunk)) + [6.0]
    return torch.tensor([rows], dtype=torch.float32)


# --- element rounding -----------------------------------------------------------------------------------


def test_every_e2m1_value_both_signs_maps_to_its_code():
    values = list(E2M1_MAGNITUDES) + [-v for v in E2M1_MAGNITUDES[1:]]
    x = block_with_six(values)
    _, scales = quantize(x, 1.0)
    assert scales.float().unique().tolist() == [1.0]
    codes = codes_of(x, 1.0)[0, : len(values)].tolist()
    assert codes == list(range(8)) + list(range(9, 16))
    assert dequantize(*quantize(x, 1.0), 1.0, dtype=torch.float32)[0, : len(values)].tolist() == values


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_tie_points_round_to_even_code(sign):
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    expected = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    x = block_with_six([sign * t for t in ties])
    out = dequantize(*quantize(x, 1.0), 1.0, dtype=torch.float32)[0, : len(ties)]
    assert out.tolist() == [sign * e if e else sign * 0.0 for e in expected]
    # Sign bit set even when the value rounds to zero (-0.25 → -0).
    assert (codes_of(x, 1.0)[0, 0].item() == 8) == (sign < 0)


def test_values_beside_tie_points_round_to_nearest():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    below = torch.nextafter(ties, torch.zeros_like(ties))
    above = torch.nextafter(ties, torch.full_like(ties, 10.0))
    x = block_with_six(below.tolist() + above.tolist())
    out = dequantize(*quantize(x, 1.0), 1.0, dtype=torch.float32)[0]
    assert out[:7].tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0]
    assert out[7:14].tolist() == [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_packing_puts_the_first_element_in_the_low_nibble():
    x = block_with_six([0.5, 6.0, -1.0, 3.0])
    packed, _ = quantize(x, 1.0)
    assert packed.dtype == torch.uint8 and packed.shape == (1, 8)
    assert packed[0, 0].item() == 0x71  # 0.5 → code 1 (low), 6 → code 7 (high)
    assert packed[0, 1].item() == 0x5A  # -1 → code 10 (low), 3 → code 5 (high)


# --- block scales ---------------------------------------------------------------------------------------


def test_block_scale_is_rounded_e4m3_of_gs_amax_over_6():
    x = torch.zeros(1, 32)
    x[0, 3] = 300.0  # gs=6: gs·amax/6 = 300 → nearest E4M3 is 288 (grid step 32 above 256)
    x[0, 20] = 0.01
    _, scales = quantize(x, 6.0)
    assert scales.dtype == torch.float8_e4m3fn and scales.shape == (1, 2)
    assert scales.float().tolist() == [[288.0, float(torch.tensor(0.01).to(torch.float8_e4m3fn).float())]]


def test_scale_saturates_at_448_instead_of_overflowing():
    x = torch.full((1, 16), 1.0)
    packed, scales = quantize(x, 1e6)  # gs·amax/6 ≈ 166667 > 448: clamp, not NaN
    assert scales.float().item() == 448.0
    out = dequantize(packed, scales, 1e6, dtype=torch.float32)
    assert torch.allclose(out, torch.full_like(out, 6 * 448 / 1e6))  # elements clamp to ±6 · s_b


def test_zero_block_has_zero_scale_and_zero_output():
    x = torch.randn(2, 48)
    x[1, 16:32] = 0.0
    gs = global_scale_for(x)
    packed, scales = quantize(x, gs)
    assert scales[1, 1].view(torch.uint8).item() == 0
    assert unpack_codes(packed)[1, 16:32].eq(0).all()
    out = dequantize(packed, scales, gs, dtype=torch.float32)
    assert out[1, 16:32].eq(0).all() and out[1, :16].ne(0).any()


def test_global_scale_for_is_encode_scale_and_handles_zero():
    x = torch.tensor([[0.5, -4.0, 2.0, 1.0]])
    assert global_scale_for(x).item() == pytest.approx(2688 / 4.0)
    assert global_scale_for(x).dtype == torch.float32
    assert global_scale_for(torch.zeros(3, 16)).item() == 1.0


# --- swizzled layout ------------------------------------------------------------------------------------


@FAST
@given(rows=st.integers(1, 300), groups=st.integers(1, 20))
def test_swizzle_unswizzle_identity_and_offsets(rows, groups):
    scales = torch.randint(1, 120, (rows, groups), dtype=torch.uint8).view(torch.float8_e4m3fn)
    swizzled = nvfp4.swizzle_scales(scales)
    padded_rows, padded_cols = math.ceil(rows / 128) * 128, math.ceil(groups / 4) * 4
    assert swizzled.shape == (padded_rows, padded_cols) and swizzled.dtype == torch.float8_e4m3fn
    flat = swizzled.view(torch.uint8).flatten()
    r = torch.arange(rows).repeat_interleave(groups)
    c = torch.arange(groups).repeat(rows)
    offsets = swizzled_offset(r, c, padded_cols)
    assert torch.equal(flat[offsets], scales.view(torch.uint8).flatten())
    padding = torch.ones_like(flat, dtype=torch.bool)
    padding[offsets] = False
    assert flat[padding].eq(0).all()
    assert torch.equal(nvfp4.unswizzle_scales(swizzled, rows, groups).view(torch.uint8), scales.view(torch.uint8))


def test_swizzle_offset_formula_on_known_entries():
    # tile = (r//128)·(padded Kb/4) + c//4; offset = tile·512 + (r%32)·16 + ((r%128)//32)·4 + c%4
    r = torch.tensor([0, 1, 32, 127, 128, 5])
    c = torch.tensor([0, 0, 0, 3, 0, 6])
    assert swizzled_offset(r, c, 8).tolist() == [0, 16, 4, 31 * 16 + 12 + 3, 1024, 512 + 80 + 2]


def test_quantize_swizzled_scales_match_linear_and_dequantize():
    x = torch.randn(130, 80, dtype=torch.bfloat16)
    gs = global_scale_for(x)
    packed, linear_scales = quantize(x, gs)
    packed_s, swizzled = quantize(x, gs, swizzle=True)
    assert torch.equal(packed, packed_s) and swizzled.shape == (256, 8)
    assert torch.equal(nvfp4.unswizzle_scales(swizzled, 130, 5).view(torch.uint8), linear_scales.view(torch.uint8))
    assert torch.equal(dequantize(packed, swizzled, gs, swizzled=True), dequantize(packed, linear_scales, gs))
    with pytest.raises(ValueError, match="swizzled=True"):
        dequantize(packed, swizzled, gs)


# --- round trip -----------------------------------------------------------------------------------------


@FAST
@given(
    rows=st.integers(1, 40),
    blocks=st.integers(1, 12),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_round_trip_error_within_half_a_grid_step(rows, blocks, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    magnitude = 10 ** (torch.rand(rows, 1, generator=generator) * 3 - 1.5)  # rows differ by up to 10^3
    x = (torch.randn(rows, blocks * 16, generator=generator) * magnitude).to(dtype)
    gs = global_scale_for(x)
    packed, scales = quantize(x, gs)
    out = dequantize(packed, scales, gs, dtype=torch.float32)
    unit = (scales.float() / gs).repeat_interleave(16, dim=1)  # value of one E2M1 unit in this block
    exact = x.float()
    scaled = exact.abs() / unit
    half_step = torch.where(scaled <= 2, 0.25, torch.where(scaled <= 4, 0.5, 1.0)) * unit
    # The E4M3 scale is rounded (by ≤ 1/16): a block's largest element may then land above 6 and clamp; its
    # error stays below the top half step (1 unit), which the last bucket already allows.
    assert ((out - exact).abs() <= half_step * (1 + 1e-6) + 1e-30).all()


# --- linear layer ---------------------------------------------------------------------------------------


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


# Bound for NVFP4Linear vs the bf16 layer. In a block of 16 Gaussian weights the largest maps to 6 and one E2M1
# unit is amax/6 ≈ 0.3σ; elements round to a grid of step 0.5, 1 or 2 units (≈45%, 32%, 23% of them), so the
# rounding error has RMS ≈ 0.3σ · sqrt((0.45·0.25 + 0.32·1 + 0.23·4) / 12) ≈ 0.1σ: a relative weight error of
# ~0.1, which carries over to the outputs for independent inputs. Measured: 0.094–0.096 (Gaussian weights),
# 0.100–0.103 (nn.Linear's uniform init). 0.13 leaves margin for seeds and still fails on any real bug (a swapped
# nibble or a scale off by one E4M3 step gives ≥ 0.2; a wrong global scale gives ≫ 1).
LINEAR_RELATIVE_BOUND = 0.13


@pytest.mark.parametrize("init", ["gaussian", "default"])
def test_nvfp4_linear_matches_bf16_linear_within_format_bound(init):
    torch.manual_seed(0)
    dense = torch.nn.Linear(256, 96, bias=True).to(torch.bfloat16)
    if init == "gaussian":
        torch.nn.init.normal_(dense.weight, std=0.02)
    layer = NVFP4Linear.from_linear(dense)
    x = torch.randn(3, 5, 256, dtype=torch.bfloat16)
    out = layer(x)
    assert out.shape == (3, 5, 96) and out.dtype == torch.bfloat16
    error = relative_error(out, dense(x))
    assert 0.03 < error < LINEAR_RELATIVE_BOUND  # the lower bound proves the weight really is 4-bit
    assert relative_error(layer.dequantized_weight(), dense.weight) < LINEAR_RELATIVE_BOUND


def test_quantize_linears_replaces_every_linear_but_the_skipped_and_the_unquantizable():
    from piecewise.kernels.nvfp4 import quantize_linears
    from piecewise.models import example

    model, args = example(tokens=5, dtype=torch.bfloat16)
    model.extra = torch.nn.Sequential(torch.nn.Linear(24, 8))  # in_features not a multiple of 16: stays
    expected = model(*args)
    linears = {name for name, m in model.named_modules() if type(m) is torch.nn.Linear}
    replaced = quantize_linears(model)
    assert set(replaced) == {n for n in linears if "lm_head" not in n and n != "extra.0"} and replaced
    assert type(model.lm_head) is torch.nn.Linear and type(model.extra[0]) is torch.nn.Linear
    assert all(type(model.get_submodule(n)) is NVFP4Linear for n in replaced)
    error = relative_error(model(*args), expected)
    assert 0 < error < 2 * LINEAR_RELATIVE_BOUND  # 4-bit weights through a few layers, not a broken model
    assert quantize_linears(model) == []  # nothing left to replace


def test_from_checkpoint_with_decode_scale_matches_from_linear():
    torch.manual_seed(1)
    dense = torch.nn.Linear(128, 64).to(torch.bfloat16)
    reference = NVFP4Linear.from_linear(dense)
    # What a ModelOpt exporter writes: packed weight, linear E4M3 scales, weight_scale_2 = amax / (448·6).
    amax = dense.weight.detach().abs().max().float()
    weight, weight_scale = quantize(dense.weight.detach(), 448 * 6 / amax)
    layer = NVFP4Linear.from_checkpoint(weight, weight_scale, amax / 2688, input_scale=torch.tensor([0.5]),
                                        bias=dense.bias.detach())
    x = torch.randn(7, 128, dtype=torch.bfloat16)
    assert torch.equal(layer.weight, reference.weight)
    assert torch.allclose(layer.weight_scale_2, reference.weight_scale_2, rtol=1e-6)
    assert relative_error(layer(x), reference(x)) < 1e-2
    assert layer.input_scale.item() == 0.5


def test_from_checkpoint_rejects_an_encode_scale():
    dense = torch.nn.Linear(64, 32).to(torch.bfloat16)
    amax = dense.weight.detach().abs().max().float()
    weight, weight_scale = quantize(dense.weight.detach(), 2688 / amax)
    with pytest.raises(ValueError, match="encode scale"):
        NVFP4Linear.from_checkpoint(weight, weight_scale, 2688 / amax)
    # Opting out loads it — and shows the silent error the check prevents: outputs off by ~(2688/amax)².
    wrong = NVFP4Linear.from_checkpoint(weight, weight_scale, 2688 / amax, check_scale=False)
    right = NVFP4Linear.from_checkpoint(weight, weight_scale, amax / 2688)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    assert (wrong(x).float().norm() / right(x).float().norm()).item() > 1e4


def test_from_checkpoint_checks_shapes_and_dtypes():
    weight = torch.zeros(32, 32, dtype=torch.uint8)
    scales = torch.zeros(32, 4, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="unswizzle_scales"):
        NVFP4Linear.from_checkpoint(weight, torch.zeros(128, 4, dtype=torch.float8_e4m3fn), 0.01)
    with pytest.raises(ValueError, match="view"):
        NVFP4Linear.from_checkpoint(weight.view(torch.int8), scales, 0.01)
    with pytest.raises(ValueError, match="positive"):
        NVFP4Linear.from_checkpoint(weight, scales, 0.0)
    layer = NVFP4Linear.from_checkpoint(weight, scales, torch.tensor([0.01]))
    with pytest.raises(ValueError, match="inputs"):
        layer(torch.zeros(2, 48, dtype=torch.bfloat16))


def test_quantize_rejects_a_decode_scale_passed_as_global_scale():
    w = torch.randn(16, 64) * 0.02
    amax = w.abs().max().item()
    with pytest.raises(ValueError, match="decode scale"):
        quantize(w, amax / 2688)


# --- user errors ----------------------------------------------------------------------------------------


def test_k_not_a_multiple_of_16_is_rejected():
    with pytest.raises(ValueError, match="K=40"):
        quantize(torch.randn(4, 40), 1.0)
    with pytest.raises(ValueError, match="in_features=40"):
        NVFP4Linear(40, 8)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_rejected(bad):
    x = torch.randn(2, 32)
    x[1, 7] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize(x, 1.0)


def test_bad_global_scale_is_rejected():
    with pytest.raises(ValueError, match="positive"):
        quantize(torch.randn(2, 16), 0.0)
    with pytest.raises(ValueError, match="positive"):
        quantize(torch.randn(2, 16), torch.tensor(-1.0))


# --- opaque ops -----------------------------------------------------------------------------------------


def test_cuda_ops_are_opaque_with_fakes_for_their_shapes():
    ops = torch.ops.piecewise_nvfp4
    x = torch.empty(5, 64, dtype=torch.bfloat16, device="meta")
    scale = torch.empty((), device="meta")
    packed, scales = ops.quantize(x, scale, True)
    assert packed.shape == (5, 32) and packed.dtype == torch.uint8
    assert scales.shape == (128, 4) and scales.dtype == torch.float8_e4m3fn
    weight = torch.empty(48, 32, dtype=torch.uint8, device="meta")
    weight_scale = torch.empty(48, 4, dtype=torch.float8_e4m3fn, device="meta")
    out = ops.w4a16_linear(x, weight, weight_scale, scale, None)
    assert out.shape == (5, 48) and out.dtype == torch.bfloat16
    deq = ops.dequantize(weight, weight_scale, scale, torch.float16)
    assert deq.shape == (48, 64) and deq.dtype == torch.float16


def test_nvfp4_linear_traces_in_piecewise_compile_on_cpu():
    import piecewise

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(64, 128).to(torch.bfloat16)
            self.down = NVFP4Linear.from_linear(torch.nn.Linear(128, 64).to(torch.bfloat16))

        def forward(self, x):
            return self.down(torch.nn.functional.silu(self.up(x)))

    model = Block()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=16), dynamic={"x": 0})
    for tokens in (5, 3):
        x = torch.randn(tokens, 64, dtype=torch.bfloat16)
        assert torch.equal(runner(x), model(x))
    assert runner.stats["traces"] == 1 and runner.stats["graph_breaks"] == 0


# --- the Triton GEMM's decode PTX, run through a small emulator ------------------------------------------


def _prmt(a: int, b: int, selector: int) -> int:
    data = a | (b << 32)
    out = 0
    for i in range(4):
        nibble = (selector >> (4 * i)) & 0xF
        byte = (data >> (8 * (nibble & 7))) & 0xFF
        if nibble & 8:  # sign-replicate mode
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _words_with_every_byte(seed: int):
    """(bytes, 32-bit word) pairs: every byte value at every position, the other 3 bytes random."""
    generator = torch.Generator().manual_seed(seed)
    for position in range(4):
        for byte in range(256):
            others = torch.randint(0, 256, (4,), generator=generator).tolist()
            others[position] = byte
            yield others, sum(b << (8 * i) for i, b in enumerate(others))


def _run_ptx(asm: str, word: int, word_operand: str = "$4", outputs: int = 4) -> list[int]:
    regs = {word_operand: word}

    def value(token: str) -> int:
        return int(token) & 0xFFFFFFFF if token.lstrip("-").isdigit() else regs[token]

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        if rest.startswith("{"):  # mov.b32 {lo, hi}, r: split into 16-bit halves
            halves, source = rest[1:].split("}")
            low, high = [t.strip() for t in halves.split(",")]
            regs[low], regs[high] = value(source.strip(" ,")) & 0xFFFF, value(source.strip(" ,")) >> 16
            continue
        dest, *sources = [t.strip() for t in rest.split(",")]
        args = [value(t) for t in sources]
        result = {
            "and.b32": lambda: args[0] & args[1],
            "or.b32": lambda: args[0] | args[1],
            "shr.u32": lambda: args[0] >> args[1],
            "shl.b32": lambda: args[0] << args[1],
            "mov.b32": lambda: args[0],
            "prmt.b32": lambda: _prmt(*args),
        }[op]()
        regs[dest] = result & 0xFFFFFFFF
    return [regs[f"${i}"] for i in range(outputs)]


@pytest.mark.parametrize("dtype,bias", [(torch.bfloat16, 2.0**120), (torch.float16, 2.0**8)])
def test_decode_ptx_gives_every_code_times_its_bias_in_pack_order(dtype, bias):
    from piecewise.kernels.nvfp4.ptx import DECODE_ASM

    asm = DECODE_ASM["bf16" if dtype == torch.bfloat16 else "f16"]
    magnitudes = list(E2M1_MAGNITUDES)
    for others, word in _words_with_every_byte(seed=0):
        out = _run_ptx(asm, word)
        # Output 0 ($0, $1) holds the low-nibble values of bytes 0..3, output 1 ($2, $3) the high ones;
        # element i of an output is 16-bit half (i % 2) of its register i // 2.
        halves = torch.tensor([[r & 0xFFFF, r >> 16] for r in out], dtype=torch.int32).to(torch.int16)
        values = halves.view(dtype).float().reshape(2, 4).tolist()
        for i, b in enumerate(others):
            for nibble, got in ((b & 0xF, values[0][i]), (b >> 4, values[1][i])):
                expected = (-1.0 if nibble & 8 else 1.0) * magnitudes[nibble & 7] * bias
                assert got == expected, (hex(word), i, nibble, got, expected)


@pytest.mark.parametrize("dtype,bias", [(torch.bfloat16, 2.0**120), (torch.float16, 2.0**8)])
def test_k_order_decode_ptx_gives_code_c_in_output_c(dtype, bias):
    from piecewise.kernels.nvfp4.ptx import DECODE_K_ORDER_ASM

    asm = DECODE_K_ORDER_ASM["bf16" if dtype == torch.bfloat16 else "f16"]
    magnitudes = list(E2M1_MAGNITUDES)
    for _, word in _words_with_every_byte(seed=2):
        out = _run_ptx(asm, word, word_operand="$8", outputs=8)
        got = torch.tensor(out, dtype=torch.int32).to(torch.int16).view(dtype).double().tolist()
        for c in range(8):
            nibble = (word >> (4 * c)) & 0xF  # code c: nibble c, the low nibble of byte c // 2 first
            expected = (-1.0 if nibble & 8 else 1.0) * magnitudes[nibble & 7] * bias
            assert got[c] == expected, (hex(word), c, nibble, got[c], expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_shift_decode_ptx_gives_every_code_as_a_scaled_16_bit_float(dtype):
    from piecewise.kernels.nvfp4.ptx import DECODE_SHIFT_ASM, DECODE_SHIFT_BIAS

    key = "bf16" if dtype == torch.bfloat16 else "f16"
    magnitudes = list(E2M1_MAGNITUDES)
    for _, word in _words_with_every_byte(seed=1):
        out = _run_ptx(DECODE_SHIFT_ASM[key], word, word_operand="$8", outputs=8)
        # Output c is code c of the word: nibble c, low nibble of byte c // 2 first.
        got = torch.tensor(out, dtype=torch.int32).to(torch.int16).view(dtype).double().tolist()
        for c in range(8):
            nibble = (word >> (4 * c)) & 0xF
            expected = (-1.0 if nibble & 8 else 1.0) * magnitudes[nibble & 7] * 2.0 ** -DECODE_SHIFT_BIAS[key]
            assert got[c] == expected, (hex(word), c, nibble, got[c], expected)


def test_decode_kernel_config_rules():
    pytest.importorskip("triton")
    from piecewise.kernels.nvfp4.gluon_gemv import GemvConfig, pick_gemv_config

    assert pick_gemv_config(1, 4096, 1040, sms=132) is None  # K not a multiple of 128: the tl kernel runs
    for rows in range(1, 17):
        for n in (512, 4096, 8192):
            for k in (128, 384, 1536, 4096, 5120, 14336):
                config = pick_gemv_config(rows, n, k, sms=132)
                groups = (k // 128) // config.steps
                assert (k // 128) % config.steps == 0 and config.warps_k <= groups, (rows, n, k, config)
    assert pick_gemv_config(1, 384, 384, sms=132) == GemvConfig(warps_k=2, row_tiles=1, steps=1)  # 3 steps
    assert pick_gemv_config(1, 4096, 4096, sms=132) == GemvConfig(warps_k=8, row_tiles=1, steps=2)
    assert pick_gemv_config(1, 8192, 8192, sms=132) == GemvConfig(warps_k=4, row_tiles=1, steps=4)
    assert pick_gemv_config(9, 8192, 8192, sms=132).row_tiles == 2  # the activation fragment serves 32 rows
    assert pick_gemv_config(8, 4096, 4096, sms=132) == GemvConfig(warps_k=4, row_tiles=1, steps=2, prefetch=2)
    assert pick_gemv_config(5, 8192, 8192, sms=132) == GemvConfig(warps_k=4, row_tiles=2, steps=1)
    # K = 44 and 11 steps of 128: the warps stay (an uneven split), the steps halve until they divide K.
    assert pick_gemv_config(1, 2048, 5632, sms=132) == GemvConfig(warps_k=8, row_tiles=1, steps=2)
    assert pick_gemv_config(1, 4096, 1408, sms=132) == GemvConfig(warps_k=8, row_tiles=1, steps=1)
    for bad in ({"warps_k": 3}, {"warps_k": 8, "row_tiles": 0}, {"warps_k": 8, "prefetch": 3}):
        with pytest.raises(ValueError, match="powers of two"):
            GemvConfig(**bad)


_KERNEL_ARGS = ["x_ptr", "weight_ptr", "scales_ptr", "decode_scale_ptr", "bias_ptr", "out_ptr", "rows", "out_features",
                "row_bytes", "row_groups", "stride_x_row", "stride_out_row"]


def compile_for_hopper(kernel_name: str, int_args: list[str], dtype: str, constants: dict, num_warps: int) -> str:
    """PTX of a Gluon kernel of ``gluon_gemv`` built for sm_90 without a GPU (its layout checks run at compile time)."""
    pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    from piecewise.kernels.nvfp4 import gluon_gemv
    from piecewise.kernels.nvfp4.ptx import DECODE_SHIFT_ASM

    if not gluon_gemv.AVAILABLE:
        pytest.skip("this Triton has no Gluon: the tl kernel runs instead")
    import triton
    from triton.experimental.gluon._runtime import GluonASTSource

    extra = [(arg.split(":") + ["i32"])[:2] for arg in int_args]  # "name" (i32) or "name:type"
    names = _KERNEL_ARGS + [name for name, _ in extra]
    types = [f"*{dtype}", "*u8", "*u8", "*fp32", f"*{dtype}", f"*{dtype}"] + ["i32"] * 6 + [t for _, t in extra]
    constants = {"HAS_BIAS": True, "IS_FP16": dtype == "fp16",
                 "DECODE": DECODE_SHIFT_ASM["f16" if dtype == "fp16" else "bf16"]} | constants
    signature = dict(zip(names, types)) | {name: "constexpr" for name in constants}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names) if i < 6 or name != "rows"}
    source = GluonASTSource(fn=getattr(gluon_gemv, kernel_name), signature=signature, constexprs=constants, attrs=aligned)
    try:
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    except RuntimeError as exc:
        if "ptxas" in str(exc).lower() and "not found" in str(exc).lower():
            pytest.skip(f"no ptxas here: {exc}")
        raise
    return kernel.asm["ptx"]


@pytest.mark.parametrize("dtype,block_m,row_tiles,prefetch,even",
                         [("bf16", 8, 1, 1, True), ("fp16", 16, 2, 2, True), ("bf16", 8, 1, 2, False)])
def test_decode_kernel_compiles_for_hopper_without_a_gpu(dtype, block_m, row_tiles, prefetch, even):
    """The Gluon decode kernel builds for sm_90 with this Triton (its mma-operand layout checks run at compile time)."""
    ptx = compile_for_hopper(
        "_gemv_kernel", ["iterations", "total_iterations"], dtype,
        {"BLOCK_M": block_m, "WARPS_K": 4, "ROW_TILES": row_tiles, "STEPS": 2, "PREFETCH": prefetch, "EVEN": even},
        num_warps=4)
    assert ptx.count("mma.sync.aligned.m16n8k16") > 0 and "ld.global.v4" in ptx


@pytest.mark.parametrize("dtype,block_m,warps,steps,split", [("bf16", 32, 4, 2, False), ("fp16", 128, 8, 1, False),
                                                             ("bf16", 64, 4, 1, True)])
def test_wgmma_kernel_compiles_for_hopper_without_a_gpu(dtype, block_m, warps, steps, split):
    """The Gluon wgmma kernel builds for sm_90: the decoded weight is wgmma's register operand A (a layout that
    is not a register renaming of the loaded words fails the compile). Split over K, the tile's programs meet at
    one acq_rel counter, taken once per program (one thread), and the last one resets it."""
    pytest.importorskip("triton")
    from piecewise.kernels.nvfp4 import gluon_gemv

    if not gluon_gemv.WGMMA_AVAILABLE:
        pytest.skip("this Triton's Gluon has no Hopper wgmma")
    ptx = compile_for_hopper("_wgmma_kernel", ["iterations", "partial_ptr:*fp32", "counter_ptr:*i32", "split_k"],
                             dtype, {"BLOCK_M": block_m, "WARPS": warps, "STEPS": steps, "SPLIT": split},
                             num_warps=warps)
    assert ptx.count("wgmma.mma_async") > 0 and "ld.global.v4" in ptx
    atomics = [line.strip() for line in ptx.splitlines() if line.strip().startswith(("atom.", "@"))
               and "atom." in line]
    if split:
        assert len(atomics) == 2 and ".gpu.acq_rel.add" in atomics[0] and ".exch" in atomics[1], atomics
        assert all(line.startswith("@") for line in atomics), atomics  # predicated: one thread per program
    else:
        assert not atomics


@pytest.mark.parametrize("dtype,block_m,block_n", [("bf16", 256, 128), ("fp16", 128, 64)])
def test_prefill_kernel_compiles_for_hopper_without_a_gpu(dtype, block_m, block_n):
    """The Gluon prefill kernel builds for sm_90: TMA for both tiles, wgmma from shared memory, one proxy fence
    per iteration and no global load of the weight outside TMA."""
    pytest.importorskip("triton")
    from piecewise.kernels.nvfp4 import gluon_gemv

    if not gluon_gemv.PREFILL_AVAILABLE:
        pytest.skip("this Triton's Gluon has no Hopper TMA")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from piecewise.kernels.nvfp4 import _gluon_prefill
    from piecewise.kernels.nvfp4.ptx import DECODE_K_ORDER_ASM

    x_layout = gl.NVMMASharedLayout.get_default_for([block_m, 64], gl.bfloat16 if dtype == "bf16" else gl.float16)
    w_layout = gl.NVMMASharedLayout.get_default_for([block_n, 8], gl.int32)
    names = ["x_desc", "w_desc", "scales_ptr", "decode_scale_ptr", "bias_ptr", "out_ptr", "rows", "out_features",
             "row_groups", "stride_out_row", "iterations"]
    types = [f"tensordesc<{dtype}[{block_m}, 64],{x_layout!r}>", f"tensordesc<i32[{block_n}, 8],{w_layout!r}>",
             "*u8", "*fp32", f"*{dtype}", f"*{dtype}"] + ["i32"] * 5
    constants = {"HAS_BIAS": True, "IS_FP16": dtype == "fp16", "STAGES": gluon_gemv.PREFILL_STAGES,
                 "DECODE": DECODE_K_ORDER_ASM["f16" if dtype == "fp16" else "bf16"], "num_warps": 8}
    signature = dict(zip(names, types)) | {name: "constexpr" for name in constants}
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(2, 6)}
    source = GluonASTSource(fn=_gluon_prefill._prefill_kernel, signature=signature, constexprs=constants,
                            attrs=aligned)
    try:
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    except RuntimeError as exc:
        if "ptxas" in str(exc).lower() and "not found" in str(exc).lower():
            pytest.skip(f"no ptxas here: {exc}")
        raise
    ptx = kernel.asm["ptx"]
    assert ptx.count("cp.async.bulk.tensor") >= 2 and ptx.count("wgmma.mma_async") > 0
    assert ptx.count("fence.proxy.async") == 1 and "ld.global.v4" not in ptx
    assert kernel.metadata.shared <= 227 * 1024


def test_kernel_choice_by_token_count_gpu_and_gluon_failures(monkeypatch):
    """``select_config``'s rules with the device queries stubbed (an sm_90 with 132 SMs, then others)."""
    pytest.importorskip("triton")
    from piecewise.kernels.nvfp4 import gluon_gemv, triton_gemm
    from piecewise.kernels.nvfp4.triton_gemm import GemmConfig, GemvConfig, WgmmaConfig

    if not gluon_gemv.WGMMA_AVAILABLE:
        pytest.skip("this Triton has no Gluon: the tl kernel runs for every token count")
    monkeypatch.setattr(triton_gemm, "sm_count", lambda index: 132)
    monkeypatch.setattr(gluon_gemv, "_capability_major", lambda index: 9)
    monkeypatch.setattr(triton_gemm, "_gluon_failure", {})

    def pick(rows, dtype=torch.bfloat16, k=4096):
        return triton_gemm.select_config(rows, 4096, k, dtype, 0)

    assert isinstance(pick(1), GemvConfig) and isinstance(pick(16), GemvConfig)
    assert isinstance(pick(17), WgmmaConfig) and isinstance(pick(255), WgmmaConfig)
    assert isinstance(pick(100, torch.float16), WgmmaConfig)
    assert pick(256) is None and pick(4096) is None  # bf16 prefill: dequantize + cuBLAS
    # fp16 prefill: the prefill kernel, 128 tokens per program while 256 would leave half the SMs idle.
    assert pick(256, torch.float16) == gluon_gemv.PrefillConfig(128, 128)
    assert pick(4096, torch.float16) == gluon_gemv.PrefillConfig(256, 128)
    assert isinstance(pick(256, torch.float16, k=1040), GemmConfig)  # K not a multiple of 64
    # bf16 on layers of at least 2^26 weights up to 512 tokens: the prefill kernel (no dequantize pass).
    assert triton_gemm.select_config(256, 8192, 8192, torch.bfloat16, 0) == gluon_gemv.PrefillConfig(128, 128)
    assert triton_gemm.select_config(512, 28672, 4096, torch.bfloat16, 0) == gluon_gemv.PrefillConfig(256, 128)
    assert triton_gemm.select_config(513, 8192, 8192, torch.bfloat16, 0) is None
    assert triton_gemm.select_config(256, 4096, 14336, torch.bfloat16, 0) is None
    assert isinstance(pick(1, k=1040), GemmConfig) and isinstance(pick(64, k=1040), GemmConfig)
    monkeypatch.setattr(gluon_gemv, "_capability_major", lambda index: 10)  # wgmma is Hopper's; mma.sync is not
    assert isinstance(pick(64), GemmConfig) and isinstance(pick(1), GemvConfig)
    monkeypatch.setattr(gluon_gemv, "_capability_major", lambda index: 9)
    monkeypatch.setattr(triton_gemm, "_gluon_failure", {"wgmma": "AttributeError: no attribute 'thread_barrier'"})
    assert isinstance(pick(64), GemmConfig) and isinstance(pick(1), GemvConfig)  # the decode kernel stays on
    monkeypatch.setattr(triton_gemm, "_gluon_failure", {"decode": "CompilationError"})
    assert isinstance(pick(1), GemmConfig) and isinstance(pick(64), WgmmaConfig)
    monkeypatch.setattr(triton_gemm, "_gluon_failure", {"prefill": "CompilationError"})
    assert isinstance(pick(256, torch.float16), GemmConfig) and isinstance(pick(64), WgmmaConfig)
    monkeypatch.setattr(triton_gemm, "_gluon_failure", {})
    monkeypatch.setattr(gluon_gemv, "_capability_major", lambda index: 10)  # TMA + wgmma as written: sm_90 only
    assert isinstance(pick(256, torch.float16), GemmConfig)


def test_gluon_kernels_get_the_weight_on_a_word_boundary():
    """The Gluon kernels read the packed weight as 32-bit words: a view starting mid-word is copied first."""
    pytest.importorskip("triton")
    from piecewise.kernels.nvfp4 import gluon_gemv

    x = torch.zeros(3, 256, dtype=torch.bfloat16)
    out = torch.empty(3, 64, dtype=torch.bfloat16)
    scales, decode = torch.zeros(64, 16, dtype=torch.uint8), torch.ones(())
    storage = torch.randint(0, 256, (64 * 128 + 16,), dtype=torch.uint8)
    for offset in (0, 1, 4):
        weight = storage[offset : offset + 64 * 128].view(64, 128)
        (_, passed, *_), constexprs = gluon_gemv._shared_arguments(x, weight, scales, decode, None, out)
        assert passed.data_ptr() % 16 == 0 and torch.equal(passed, weight)
        assert (passed is weight) == (weight.data_ptr() % 16 == 0)
    assert constexprs["HAS_BIAS"] is False and constexprs["IS_FP16"] is False


@pytest.mark.parametrize("kernel", ["gemv", "wgmma"])
def test_gluon_launches_bind_every_kernel_parameter(monkeypatch, kernel):
    """The host wrappers' launch arguments, bound to the kernels' parameter lists (no GPU: the launch is recorded)."""
    pytest.importorskip("triton")
    from piecewise.kernels.nvfp4 import gluon_gemv

    if not gluon_gemv.WGMMA_AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    name = "_gemv_kernel" if kernel == "gemv" else "_wgmma_kernel"
    real = getattr(gluon_gemv, name)
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((grid, args, kwargs))

    monkeypatch.setattr(gluon_gemv, name, Recorder())
    rows, n, k = 40, 300, 1024
    x, out = torch.zeros(rows, k, dtype=torch.float16), torch.empty(rows, n, dtype=torch.float16)
    weight, scales = torch.zeros(n, k // 2, dtype=torch.uint8), torch.zeros(n, k // 16, dtype=torch.uint8)
    bias, decode = torch.zeros(n, dtype=torch.float16), torch.ones(())
    if kernel == "gemv":
        gluon_gemv.w4a16_gemv(x[:16], weight, scales, decode, bias, out[:16], gluon_gemv.GemvConfig(4, 2, 2))
    else:
        gluon_gemv.w4a16_wgmma(x, weight, scales, decode, bias, out, gluon_gemv.WgmmaConfig(32, 4, 2))
    (grid, args, kwargs), = launches
    names = real.arg_names
    bound = dict(zip(names, args)) | {key: value for key, value in kwargs.items() if key in names}
    assert set(bound) == set(names) and len(args) == sum(not p.is_constexpr for p in real.params)
    assert bound["x_ptr"] is x or bound["x_ptr"].data_ptr() == x.data_ptr()
    assert bound["bias_ptr"] is bias and bound["out_features"] == n and bound["row_bytes"] == k // 2
    assert bound["row_groups"] == k // 16 and bound["HAS_BIAS"] and bound["IS_FP16"]
    if kernel == "gemv":
        assert grid == (n // 32 + 1,) and bound["iterations"] == 1 and bound["total_iterations"] == 4
        assert bound["EVEN"]
        launches.clear()  # K = 11 steps of 128 over 4 warps: 3 iterations each, the last warp's third is empty
        k = 11 * 128
        x, weight, scales = torch.zeros(1, k, dtype=torch.float16), weight[:, : k // 2], scales[:, : k // 16]
        gluon_gemv.w4a16_gemv(x, weight.contiguous(), scales.contiguous(), decode, None, out[:1],
                              gluon_gemv.GemvConfig(4, 1, 1))
        (_, args, kwargs), = launches
        bound = dict(zip(names, args)) | kwargs
        assert bound["iterations"] == 3 and bound["total_iterations"] == 11 and not bound["EVEN"]
    else:
        assert grid == (n // 64 + 1, 2, 1) and bound["iterations"] == k // 256 and bound["BLOCK_M"] == 32
        assert bound["split_k"] == 1 and not bound["SPLIT"]
        # Split over K in 2: each program takes half the iterations; a float32 partial tile per program.
        counters = torch.zeros(1024, dtype=torch.int32)
        monkeypatch.setattr(gluon_gemv, "split_counters", lambda device, tiles: counters[:tiles])
        launches.clear()
        gluon_gemv.w4a16_wgmma(x, weight, scales, decode, bias, out, gluon_gemv.WgmmaConfig(32, 4, 2, split_k=2))
        (grid, args, kwargs), = launches
        bound = dict(zip(names, args)) | kwargs
        assert grid == (n // 64 + 1, 2, 2) and bound["iterations"] == k // 512 and bound["SPLIT"]
        assert bound["split_k"] == 2 and bound["partial_ptr"].shape == (grid[0] * 2, 2, 64, 32)
        assert bound["counter_ptr"].data_ptr() == counters.data_ptr()
        launches.clear()  # 8 iterations in 8 programs: one each
        gluon_gemv.w4a16_wgmma(x, weight, scales, decode, bias, out, gluon_gemv.WgmmaConfig(32, 4, 1, split_k=8))
        (grid, args, kwargs), = launches
        assert grid[2] == 8 and dict(zip(names, args))["iterations"] == 1


def test_wgmma_kernel_config_rules():
    pytest.importorskip("triton")
    from piecewise.kernels.nvfp4.gluon_gemv import WgmmaConfig, pick_wgmma_config

    for rows in (1, 16, 256, 4096):
        assert pick_wgmma_config(rows, 4096, 4096, sms=132) is None  # other kernels' token counts
    # up to 32 tokens the split aims at one program per SM: 64 programs of 8192 rows split in 4, not 2
    assert pick_wgmma_config(17, 8192, 8192, sms=132) == WgmmaConfig(64, 8, 1, split_k=4)
    assert pick_wgmma_config(64, 4096, 1040, sms=132) is None  # K not a multiple of 128: the tl kernel runs
    # 32 programs of 128 rows × 64 tokens: K split in 4 (half the SMs is 66 programs; at most 4 splits)
    assert pick_wgmma_config(64, 4096, 4096, sms=132) == WgmmaConfig(64, 8, 1, split_k=4)
    assert pick_wgmma_config(100, 4096, 4096, sms=132) == WgmmaConfig(64, 8, 1, split_k=2)  # 64 programs
    assert pick_wgmma_config(200, 4096, 4096, sms=132) == WgmmaConfig(128, 8, 1, split_k=2)
    assert pick_wgmma_config(40, 8192, 8192, sms=132) == WgmmaConfig(64, 8, 1, split_k=2)
    assert pick_wgmma_config(100, 8192, 8192, sms=132) == WgmmaConfig(64, 8, 1)  # 128 programs: no split
    assert pick_wgmma_config(200, 28672, 4096, sms=132) == WgmmaConfig(128, 8, 1)
    assert pick_wgmma_config(64, 2048, 5632, sms=132).split_k == 4  # 44 iterations: 11 per split
    assert pick_wgmma_config(64, 2048, 1408, sms=132).split_k == 1  # 11 iterations do not split in twos
    assert pick_wgmma_config(64, 2048, 512, sms=132).split_k == 2  # 4 iterations: at least 2 per split
    assert pick_wgmma_config(64, 4096, 4096, sms=264).split_k == 4 and pick_wgmma_config(64, 4096, 4096, sms=60).split_k == 1
    with pytest.raises(ValueError, match="block_m must be"):
        WgmmaConfig(48, 4)
    with pytest.raises(ValueError, match="split_k 1, 2, 4 or 8"):
        WgmmaConfig(64, 8, 1, split_k=3)


def test_a_models_dtype_change_keeps_the_nvfp4_scales():
    """``model.half()`` / ``model.to(torch.bfloat16)`` after quantizing convert the biases, not the E4M3 block
    scales and float32 decode scales of NVFP4 layers and experts (before: rounded to 16-bit floats, which the
    CUDA kernels refuse and the CPU path used as they were)."""
    from types import SimpleNamespace

    from piecewise.kernels.nvfp4 import NVFP4Linear
    from piecewise.models.glm_moe import NVFP4Experts

    torch.manual_seed(0)
    layer = NVFP4Linear.from_linear(torch.nn.Linear(64, 32))
    experts = NVFP4Experts(SimpleNamespace(gate_up=torch.randn(2, 64, 32), down=torch.randn(2, 32, 32)))
    model = torch.nn.ModuleDict({"layer": layer, "experts": experts})
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    expected = layer(x)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    model.half()
    model.to(torch.bfloat16)
    scales = [key for key in before if "scale" in key]
    assert len(scales) == 6
    for key in scales:
        assert model.state_dict()[key].dtype == before[key].dtype and torch.equal(model.state_dict()[key], before[key])
    assert layer.bias.dtype == torch.bfloat16 and torch.equal(layer(x), expected)
