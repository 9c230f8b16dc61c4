"""Inline PTX used by the Triton kernels, kept free of Triton so CPU tests can check it.

``DECODE_ASM[dtype]`` turns 4 packed NVFP4 bytes into 8 16-bit floats; ``tests/test_nvfp4.py`` runs it through
a small PTX emulator for every byte value.
"""

from __future__ import annotations


def _decode_asm(out_dtype: str, pairs: bool = False, table_operands: bool = False) -> str:
    """PTX: 4 packed bytes (8 E2M1 codes) → 8 16-bit floats ``e2m1(c) · 2^bias``, as two outputs of 4.

    Input ``$4``: the 4 bytes. Outputs ``$0``/``$1``: the values of the low nibbles of bytes 0..3, ``$2``/``$3``:
    the high nibbles. With ``pairs``, register ``$i`` holds instead the two codes of byte ``i`` (low nibble in
    the low half): codes 0..3 of the word in ``$0``/``$1``, codes 4..7 in ``$2``/``$3``. Byte lookup tables (``prmt``: the 3 magnitude bits pick a byte, the sign bit ORs in 0x80);
    14 instructions per 8 values (12 for f16, whose E2M1 values all have a zero low byte).
    """
    high = (_LUT_BF16_HIGH_0_3, _LUT_BF16_HIGH_4_7) if out_dtype == "bf16" else (_LUT_F16_HIGH_0_3, _LUT_F16_HIGH_4_7)
    low_0_3, sign_table = _LUT_BF16_LOW_0_3, 32768
    if table_operands:  # the first word of each table comes in a register ($5, $9, $13: see TABLE_WORDS)
        high, low_0_3, sign_table = ("$5", high[1]), "$9", "$13"
    lines = [
        "{",
        ".reg .b32 sgn, sgn_lo, sgn_hi, mag, mag_hi, hi_lo, hi_hi, s_lo, s_hi, lo_lo, lo_hi;",
        f"and.b32 sgn, $4, {_SIGN_BITS};",
        "shr.u32 sgn_lo, sgn, 3;",  # sign of codes 0..3 at bit 0 of their nibble
        "shr.u32 sgn_hi, sgn, 19;",  # codes 4..7
        f"and.b32 mag, $4, {_MAGNITUDE_BITS};",
        "shr.u32 mag_hi, mag, 16;",
        f"prmt.b32 hi_lo, {high[0]}, {high[1]}, mag;",
        f"prmt.b32 hi_hi, {high[0]}, {high[1]}, mag_hi;",
        f"prmt.b32 s_lo, {sign_table}, 0, sgn_lo;",  # byte 1 of 32768 is 0x80: sign bit → 0x80, else 0x00
        f"prmt.b32 s_hi, {sign_table}, 0, sgn_hi;",
        "or.b32 hi_lo, hi_lo, s_lo;",
        "or.b32 hi_hi, hi_hi, s_hi;",
    ]
    if out_dtype == "bf16":
        lines += [
            f"prmt.b32 lo_lo, {low_0_3}, {_LUT_BF16_LOW_4_7}, mag;",
            f"prmt.b32 lo_hi, {low_0_3}, {_LUT_BF16_LOW_4_7}, mag_hi;",
        ]
    else:
        lines += ["mov.b32 lo_lo, 0;", "mov.b32 lo_hi, 0;"]
    # Code i of the word sits in byte i of the (lo_*, hi_*) pairs; bytes 0, 2 are low nibbles, 1, 3 high ones.
    if pairs:
        lines += [
            "prmt.b32 $0, lo_lo, hi_lo, 20800;",  # 0x5140: codes 0, 1 (byte 0)
            "prmt.b32 $1, lo_lo, hi_lo, 29538;",  # 0x7362: codes 2, 3 (byte 1)
            "prmt.b32 $2, lo_hi, hi_hi, 20800;",  # codes 4, 5 (byte 2)
            "prmt.b32 $3, lo_hi, hi_hi, 29538;",  # codes 6, 7 (byte 3)
        ]
    else:
        lines += [
            "prmt.b32 $0, lo_lo, hi_lo, 25152;",  # 0x6240: codes 0, 2 (low nibbles of bytes 0, 1)
            "prmt.b32 $1, lo_hi, hi_hi, 25152;",  # codes 4, 6 (bytes 2, 3)
            "prmt.b32 $2, lo_lo, hi_lo, 29521;",  # 0x7351: codes 1, 3 (high nibbles of bytes 0, 1)
            "prmt.b32 $3, lo_hi, hi_hi, 29521;",
        ]
    lines.append("}")
    return "\n".join(lines)


def _decode_word_asm(out_dtype: str) -> str:
    """``DECODE_PAIRS_ASM`` for one 32-bit word in, eight 16-bit values out (code ``i`` of the word in ``$i``).

    Operands: ``$8`` the word, ``$9``/``$10``/``$11`` the table words (``TABLE_WORDS``). Each pair register is
    split into its two halves; ptxas merges them back when they feed an mma fragment register.
    """
    body = _decode_asm(out_dtype, pairs=True, table_operands=True)
    for old, new in (("$13", "%t2"), ("$9", "%t1"), ("$5", "%t0"), ("$4", "%w"),
                     ("$0", "%pair0"), ("$1", "%pair1"), ("$2", "%pair2"), ("$3", "%pair3")):
        body = body.replace(old, new)
    body = body.replace("%t2", "$11").replace("%t1", "$10").replace("%t0", "$9").replace("%w", "$8")
    inner = body.strip()[1:-1]  # drop the outer braces
    return "\n".join([
        "{", ".reg .b32 %pair0, %pair1, %pair2, %pair3;", inner.strip(),
        "mov.b32 {$0, $1}, %pair0;", "mov.b32 {$2, $3}, %pair1;", "mov.b32 {$4, $5}, %pair2;", "mov.b32 {$6, $7}, %pair3;", "}",
    ])


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
DECODE_PAIRS_ASM = {
    "bf16": _decode_asm("bf16", pairs=True, table_operands=True), "f16": _decode_asm("f16", pairs=True, table_operands=True)
}
"""The same decode with the codes of each byte side by side in one register (the mma fragment order), taking
the first word of each table as an operand (``TABLE_WORDS``): a table word that ptxas sees as a constant is
re-materialised before every ``prmt`` that reads it (the operand must be a register), one extra instruction
per lookup."""
DECODE_WORD_ASM = {"bf16": _decode_word_asm("bf16"), "f16": _decode_word_asm("f16")}
"""For ``inline_asm_elementwise`` on an int32 tensor (pack=1): constraints ``"=h" * 8, "r" * 4``."""
TABLE_WORDS = {"bf16": (_LUT_BF16_HIGH_0_3, _LUT_BF16_LOW_0_3, 32768), "f16": (_LUT_F16_HIGH_0_3, 0, 32768)}
"""Operands ``$5``, ``$9``, ``$13`` of ``DECODE_PAIRS_ASM`` (int32 tensors with pack=4: one register each is read)."""
