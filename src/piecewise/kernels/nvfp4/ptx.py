"""Inline PTX used by the Triton kernels, kept free of Triton so CPU tests can check it.

``DECODE_ASM[dtype]`` turns 4 packed NVFP4 bytes into 8 16-bit floats; ``tests/test_nvfp4.py`` runs it through
a small PTX emulator for every byte value.
"""

from __future__ import annotations


def _decode_asm(out_dtype: str, k_order: bool = False) -> str:
    """PTX: 4 packed bytes (8 E2M1 codes) → 8 16-bit floats ``e2m1(c) · 2^bias``, as two outputs of 4.

    Input ``$4``: the 4 bytes. Outputs ``$0``/``$1``: the values of the low nibbles of bytes 0..3, ``$2``/``$3``:
    the high nibbles. Byte lookup tables (``prmt``: the 3 magnitude bits pick a byte, the sign bit ORs in 0x80);
    14 instructions per 8 values (12 for f16, whose E2M1 values all have a zero low byte).

    ``k_order``: the same tables, but the last byte permutes put codes in K order, code c in output ``$c`` (a
    16-bit half; input ``$8``): registers hold the pairs (2j, 2j + 1), ready for a 16-byte store.
    """
    high = (_LUT_BF16_HIGH_0_3, _LUT_BF16_HIGH_4_7) if out_dtype == "bf16" else (_LUT_F16_HIGH_0_3, _LUT_F16_HIGH_4_7)
    word = "$8" if k_order else "$4"
    lines = [
        "{",
        ".reg .b32 sgn, sgn_lo, sgn_hi, mag, mag_hi, hi_lo, hi_hi, s_lo, s_hi, lo_lo, lo_hi"
        + (", p0, p1, p2, p3;" if k_order else ";"),
        f"and.b32 sgn, {word}, {_SIGN_BITS};",
        "shr.u32 sgn_lo, sgn, 3;",  # sign of codes 0..3 at bit 0 of their nibble
        "shr.u32 sgn_hi, sgn, 19;",  # codes 4..7
        f"and.b32 mag, {word}, {_MAGNITUDE_BITS};",
        "shr.u32 mag_hi, mag, 16;",
        f"prmt.b32 hi_lo, {high[0]}, {high[1]}, mag;",
        f"prmt.b32 hi_hi, {high[0]}, {high[1]}, mag_hi;",
        "prmt.b32 s_lo, 32768, 0, sgn_lo;",  # byte 1 of 32768 is 0x80: sign bit → 0x80, else 0x00
        "prmt.b32 s_hi, 32768, 0, sgn_hi;",
        "or.b32 hi_lo, hi_lo, s_lo;",
        "or.b32 hi_hi, hi_hi, s_hi;",
    ]
    if out_dtype == "bf16":
        lines += [
            f"prmt.b32 lo_lo, {_LUT_BF16_LOW_0_3}, {_LUT_BF16_LOW_4_7}, mag;",
            f"prmt.b32 lo_hi, {_LUT_BF16_LOW_0_3}, {_LUT_BF16_LOW_4_7}, mag_hi;",
        ]
    else:
        lines += ["mov.b32 lo_lo, 0;", "mov.b32 lo_hi, 0;"]
    # Code i of the word sits in byte i of the (lo_*, hi_*) pairs; bytes 0, 2 are low nibbles, 1, 3 high ones.
    if k_order:
        lines += [
            "prmt.b32 p0, lo_lo, hi_lo, 20800;",  # 0x5140: codes 0, 1
            "prmt.b32 p1, lo_lo, hi_lo, 29538;",  # 0x7362: codes 2, 3
            "prmt.b32 p2, lo_hi, hi_hi, 20800;",  # codes 4, 5
            "prmt.b32 p3, lo_hi, hi_hi, 29538;",  # codes 6, 7
        ]
        lines += [f"mov.b32 {{${2 * n}, ${2 * n + 1}}}, p{n};" for n in range(4)]
        return "\n".join(lines + ["}"])
    lines += [
        "prmt.b32 $0, lo_lo, hi_lo, 25152;",  # 0x6240: codes 0, 2 (low nibbles of bytes 0, 1)
        "prmt.b32 $1, lo_hi, hi_hi, 25152;",  # codes 4, 6 (bytes 2, 3)
        "prmt.b32 $2, lo_lo, hi_lo, 29521;",  # 0x7351: codes 1, 3 (high nibbles of bytes 0, 1)
        "prmt.b32 $3, lo_hi, hi_hi, 29521;",
        "}",
    ]
    return "\n".join(lines)


# prmt byte tables (signed 32-bit decimals, the form PTX immediates take): byte c = a byte of e2m1(c) · 2^bias.
# bf16: bias 120 (0.5·2^120 = 0x7B00 ... 6·2^120 = 0x7CC0); f16: bias 8 (0.5·2^8 = 0x5800 ... 6·2^8 = 0x6600).
_LUT_BF16_LOW_0_3 = -1065353216  # 0xC0800000: low bytes for codes 0..3
_LUT_BF16_LOW_4_7 = -1065336832  # 0xC0804000: codes 4..7
_LUT_BF16_HIGH_0_3 = 0x7B7B7B00
_LUT_BF16_HIGH_4_7 = 0x7C7C7C7C
_LUT_F16_HIGH_0_3 = 0x5E5C5800
_LUT_F16_HIGH_4_7 = 0x66646260
_SIGN_BITS = -2004318072  # 0x88888888
_MAGNITUDE_BITS = 2004318071  # 0x77777777


DECODE_ASM = {"bf16": _decode_asm("bf16"), "f16": _decode_asm("f16")}
"""PTX for ``tl.inline_asm_elementwise(..., constraints="=r,=r,=r,=r,r", pack=4)``, by output dtype."""
DECODE_K_ORDER_ASM = {"bf16": _decode_asm("bf16", k_order=True), "f16": _decode_asm("f16", k_order=True)}
"""For ``inline_asm_elementwise`` on an int32 tensor (pack=1, constraints ``"=h" * 8, "r"``): code ``c`` of the
word in output ``c``, as ``e2m1 · 2^120`` (bf16) or ``e2m1 · 2^8`` (f16), the bias of ``DECODE_ASM``."""


def _decode_shift_asm(out_dtype: str) -> str:
    """PTX: one 32-bit word (8 E2M1 codes) → 8 16-bit floats ``e2m1(c) · 2^-bias`` by shifts and masks, no tables.

    The 3 magnitude bits of a code are exactly the low exponent bits and the top mantissa bit of a 16-bit float
    whose exponent bits above them are zero: bf16 then holds ``e2m1 · 2^-126``, f16 ``e2m1 · 2^-14`` — for the
    codes 0 and ±0.5 as subnormals, which the mma and the packed multiplies take as they are. Codes ``n`` and
    ``n + 4`` lie 16 bits apart in the word, so one shift places both magnitudes and one more both signs; a
    register holds the pair (``$n``: code n, ``$n+4``: code n + 4). 4 integer operations per pair, and ptxas
    may issue the left shifts as ``IMAD.SHL`` on the FMA pipe. Input ``$8``.
    """
    magnitude_at = 6 if out_dtype == "bf16" else 9  # bit of the mantissa's top bit
    mask = 0x01C001C0 if out_dtype == "bf16" else 0x0E000E00
    lines = ["{", ".reg .b32 mag, sgn, p0, p1, p2, p3;"]
    for n in range(4):
        shift = magnitude_at - 4 * n
        op = f"shl.b32 mag, $8, {shift};" if shift >= 0 else f"shr.u32 mag, $8, {-shift};"
        lines += [op, f"and.b32 mag, mag, {mask};"]
        lines += [f"shl.b32 sgn, $8, {12 - 4 * n};" if n < 3 else "mov.b32 sgn, $8;", f"and.b32 sgn, sgn, {_PAIR_SIGNS};"]
        lines.append(f"or.b32 p{n}, mag, sgn;")
    lines += [f"mov.b32 {{${n}, ${n + 4}}}, p{n};" for n in range(4)]
    lines.append("}")
    return "\n".join(lines)


_PAIR_SIGNS = -2147450880  # 0x80008000
DECODE_SHIFT_ASM = {"bf16": _decode_shift_asm("bf16"), "f16": _decode_shift_asm("f16")}
"""For ``inline_asm_elementwise`` on an int32 tensor (pack=1, constraints ``"=h" * 8, "r"``): code ``c`` of the
word in output ``c``, as ``e2m1 · 2^-126`` (bf16) or ``e2m1 · 2^-14`` (f16)."""
DECODE_SHIFT_BIAS = {"bf16": 126, "f16": 14}
