"""``piecewise checkpoint FOLDER``: what a ModelOpt NVFP4 checkpoint holds, read from its headers and decode scales."""

from __future__ import annotations

import re
from pathlib import Path

from ..kernels.nvfp4.module import encode_scale_problem
from .modelopt import EXPERT_NAMES, _Folder, _check_quant_config, read_quant_config


def inspect_checkpoint(folder: str | Path) -> dict:
    """What a ModelOpt NVFP4 checkpoint holds, from its headers and its float32 decode scales only (no weights
    are read): ``quant``, ``quantized`` (layer names), ``experts`` ({experts module: count}), ``other`` (number of
    tensors kept as they are), ``gate_up`` (experts whose gate and up decode scales differ, out of how many, and
    the up/gate ratio range) and ``problems`` (messages: decode scales that look like encode scales, layers
    missing a scale)."""
    folder = Path(folder)
    quant = read_quant_config(folder)
    tensors = _Folder(folder)
    problems = []
    try:
        _check_quant_config(quant)
    except ValueError as exc:
        problems.append(str(exc))
    prefixes = sorted({key[: -len(".weight_scale")] for key in tensors if key.endswith(".weight_scale")})
    experts: dict[str, int] = {}
    quantized, scales = [], {}
    for prefix in prefixes:
        match = re.fullmatch(r"(.+)\.(\d+)\.([^.]+)", prefix)
        if match and any(match.group(3) in names for names in EXPERT_NAMES):
            experts[match.group(1)] = max(experts.get(match.group(1), 0), int(match.group(2)) + 1)
        else:
            quantized.append(prefix)
        if f"{prefix}.weight_scale_2" not in tensors or f"{prefix}.weight" not in tensors:
            problems.append(f"{prefix} has a weight_scale but no weight or weight_scale_2")
            continue
        value = float(tensors[f"{prefix}.weight_scale_2"].float().reshape(-1)[0])
        scales[prefix] = value
        problem = encode_scale_problem(value, f"{prefix}.weight_scale_2")
        if problem:
            problems.append(problem)
    ratios = []
    for module, count in experts.items():
        names = next(n for n in EXPERT_NAMES if f"{module}.0.{n[0]}" in scales or f"{module}.0.{n[1]}" in scales)
        for e in range(count):
            gate, up = scales.get(f"{module}.{e}.{names[0]}"), scales.get(f"{module}.{e}.{names[1]}")
            if gate and up:
                ratios.append(up / gate)
    used = {f"{p}.{s}" for p in prefixes for s in ("weight", "weight_scale", "weight_scale_2", "input_scale")}
    return {
        "quant": quant, "quantized": quantized, "experts": experts, "other": sum(k not in used for k in tensors),
        "gate_up": {"differ": sum(r != 1 for r in ratios), "of": len(ratios),
                    "ratio": (min(ratios), max(ratios)) if ratios else None},
        "problems": problems,
    }
