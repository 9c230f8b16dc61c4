"""Load an NVFP4 checkpoint in NVIDIA ModelOpt's Hugging Face format into a transformers model.

``save_modelopt_nvfp4(model, folder)`` writes a model quantized by ``integrations.transformers.quantize`` in the
same format, so a large model is quantized once and later loaded from the meta device.

``load_modelopt_nvfp4(model, path)``: ``model`` is the transformers model built from the checkpoint's
``config.json`` (``AutoModelForCausalLM.from_config``, in any dtype, on a device or on the ``meta`` device);
``path`` the checkpoint's folder (``*.safetensors`` and
``hf_quant_config.json``, or ``config.json`` with a ``quantization_config``). Every ``nn.Linear`` whose
checkpoint entry is quantized (``<name>.weight`` packed uint8 [N, K/2], ``<name>.weight_scale`` float8_e4m3fn
[N, K/16], ``<name>.weight_scale_2`` the float32 decode scale amax/2688) becomes an ``NVFP4Linear``; stacked
experts (transformers' ``gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I]) whose checkpoint holds them one
expert at a time (``<experts>.<e>.gate_proj`` / ``up_proj`` / ``down_proj``, or Mixtral's ``w1`` / ``w3`` /
``w2``) become ``NVFP4Experts``; every other tensor is copied into the model as it is. ``input_scale`` (the
activation scale of W4A4 kernels) is kept on the layers and unused: activations stay 16-bit (W4A16).

Gate and up projections quantized with different global scales keep both (a decode scale per half of the
fused gate_up rows), so the experts compute exactly what the checkpoint holds, without a warning to read.

Tensors are read one at a time with ``safetensors.safe_open``, so the whole checkpoint is never in memory at
once. Missing tensors, a quantization other than NVFP4 with 16-element blocks, and checkpoint tensors the model
has no place for raise ``ValueError`` naming them; tensors the model class declares it ignores
(``_keys_to_ignore_on_load_unexpected``: the multi-token-prediction layers of GLM-4.5 and DeepSeek-V3) are skipped.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
from torch import nn

from ..kernels.nvfp4 import NVFP4Linear
from ..models.glm_moe import NVFP4Experts

logger = logging.getLogger(__name__)

EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
"""Per-expert checkpoint names of (gate, up, down): Llama-style, and Mixtral's."""
_IGNORED_SUFFIXES = ("k_scale", "v_scale", "input_scale")  # FP8 KV-cache and activation scales: W4A16 uses neither


class _Folder(Mapping):
    """The tensors of a folder's ``*.safetensors`` files by name, each read when asked for. The files stay open
    (memory-mapped): opening one again per tensor parses its header each time, ~4 ms for 5000 tensors, which
    for the ~10^5 tensors of a large MoE checkpoint would take minutes."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        _check_folder(folder)
        self._files: dict[str, object] = {}
        for file in sorted(folder.glob("*.safetensors")):
            opened = safe_open(file, framework="pt")
            for key in opened.keys():
                self._files[key] = opened
        if not self._files:
            raise ValueError(f"{folder} holds no *.safetensors files")

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._files[key].get_tensor(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


def _check_folder(folder: Path) -> None:
    if not folder.is_dir():
        raise ValueError(f"{folder}: {'not a folder' if folder.exists() else 'no such folder'}; a ModelOpt NVFP4 "
                         f"checkpoint is a folder of *.safetensors files with hf_quant_config.json (or a "
                         f"quantization_config in config.json)")


def read_quant_config(folder: Path) -> dict:
    """The quantization section of ``hf_quant_config.json`` (``{"quantization": {...}}``) or of
    ``config.json`` (``"quantization_config"``)."""
    _check_folder(folder)
    quant_file, config_file = folder / "hf_quant_config.json", folder / "config.json"
    if quant_file.exists():
        return json.loads(quant_file.read_text()).get("quantization", {})
    if config_file.exists():
        config = json.loads(config_file.read_text()).get("quantization_config")
        if config is not None:
            return config.get("quantization", config)
    raise ValueError(f"{folder} has neither hf_quant_config.json nor a quantization_config in config.json: "
                     "is it a ModelOpt NVFP4 checkpoint?")


def _check_quant_config(quant: dict) -> None:
    algo = quant.get("quant_algo")
    if algo != "NVFP4":
        method = quant.get("quant_method")
        other = (f" (its quant_method is {method!r}: another format, whose tensor names and scale conventions "
                 f"differ)") if method not in (None, "modelopt") else ""
        raise ValueError(f"the checkpoint's quant_algo is {algo!r}{other}; load_modelopt_nvfp4 reads ModelOpt's NVFP4 "
                         "checkpoints (quant_algo \"NVFP4\")")
    group = quant.get("group_size", 16)
    if group != 16:
        raise ValueError(f"the checkpoint's group_size is {group}; NVFP4 has one scale per 16 weights")


def load_modelopt_nvfp4(
    model: nn.Module,
    checkpoint: str | Path | Mapping[str, torch.Tensor],
    *,
    quant_config: dict | None = None,
    key_map: Callable[[str], str] | None = None,
    grouped_experts: bool = True,
    device: str | torch.device | None = None,
) -> list[str]:
    """Load ``checkpoint`` (a folder, or a mapping of tensor names to tensors with ``quant_config`` the
    ``"quantization"`` section) into ``model`` in place; returns the qualified names made NVFP4.

    ``model`` may be built on the ``meta`` device (``with torch.device("meta"): from_config(...)``), so that
    its 16-bit weights are never allocated: the loaded tensors then go to ``device`` (default: where the model's
    parameters are, or the CPU for a meta model), each non-quantized one in its parameter's dtype, and the
    rotary tables are computed there (transformers' ``_init_weights``). ``key_map`` renames checkpoint keys to
    the model's (for checkpoints whose names differ from the transformers model's). ``grouped_experts`` as in
    ``integrations.transformers.quantize``. Call ``integrations.transformers.enable(model)`` before or after;
    the experts switch to piecewise's experts op, the only one that runs NVFP4 experts.
    """
    from .transformers import _is_experts, _use_piecewise_experts

    if isinstance(checkpoint, (str, Path)):
        folder = Path(checkpoint)
        tensors: Mapping[str, torch.Tensor] = _Folder(folder)
        quant = quant_config if quant_config is not None else read_quant_config(folder)
    else:
        if quant_config is None:
            raise ValueError("a checkpoint given as a mapping of tensors needs quant_config= (the \"quantization\" "
                             "section of its hf_quant_config.json)")
        tensors, quant = checkpoint, quant_config
    _check_quant_config(quant)  # which layers are quantized is read from the tensors (weight_scale present)
    if device is None:
        device = next((t.device for t in model.parameters() if t.device.type != "meta"), torch.device("cpu"))
    device = torch.device(device)
    if key_map is not None:
        tensors = _Renamed(tensors, {key_map(key): key for key in tensors})
    used: set[str] = set()

    def take(key: str) -> torch.Tensor:
        if key not in tensors:
            raise ValueError(f"the checkpoint has no {key}")
        used.add(key)
        return tensors[key]

    # Build every NVFP4 module and check the whole checkpoint first: an error leaves the model as it was.
    layers: dict[str, nn.Module] = {}
    experts: dict[str, NVFP4Experts] = {}
    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear and f"{name}.weight_scale" in tensors:
            dtype = module.weight.dtype if module.weight.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
            try:
                layer = NVFP4Linear.from_checkpoint(
                    take(f"{name}.weight"), take(f"{name}.weight_scale"), take(f"{name}.weight_scale_2"),
                    take(f"{name}.input_scale") if f"{name}.input_scale" in tensors else None,
                    take(f"{name}.bias") if module.bias is not None else None, dtype=dtype)
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from exc
            if (layer.in_features, layer.out_features) != (module.in_features, module.out_features):
                raise ValueError(f"{name}: the checkpoint's weight is {layer.out_features} × {layer.in_features}, "
                                 f"the model's layer {module.out_features} × {module.in_features}")
            layers[name] = layer.to(device)
        elif _is_experts(module) and (names := _expert_names(tensors, name)) is not None:
            try:
                loaded = _load_experts(module, name, names, tensors, take, grouped_experts)
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from exc
            experts[name] = loaded.to(device)
    converted = list(layers) + list(experts)

    # Everything else, as it is; tied parameters need one of their names in the checkpoint.
    state, missing = {}, []
    for group in _aliases(model, converted):
        key = next((alias for alias in group if alias in tensors), None)
        if key is None:
            missing.append(group[0] + (f" (nor {', '.join(group[1:])})" if group[1:] else ""))
        else:
            state[group[0]] = key
    ignored = [re.compile(pattern) for pattern in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    from_state = set(state.values())
    left = sorted(key for key in tensors if key not in used and key not in from_state
                  and key.rsplit(".", 1)[-1] not in _IGNORED_SUFFIXES and not any(p.search(key) for p in ignored))
    hint = (f"{len(left)} checkpoint tensors have no place in the model, e.g. {left[:3]}: pass key_map= to rename "
            f"checkpoint keys to the model's names") if left else ""
    if missing:
        raise ValueError(f"the checkpoint has no {missing[0]}" + (f" and {len(missing) - 1} more" if missing[1:] else "")
                         + (f"; {hint}" if hint else ""))
    if hint:
        raise ValueError(hint)

    _use_piecewise_experts(model)  # (stacked experts, if any: the only experts op that runs NVFP4 experts)
    for name, layer in layers.items():
        model.set_submodule(name, layer)
    for name, loaded in experts.items():
        module = model.get_submodule(name)
        module.nvfp4 = loaded
        del module.gate_up_proj, module.down_proj
    _load_rest(model, {name: take(key) for name, key in state.items()}, device)
    split = [e.gate_up_scale_2 for e in experts.values() if e.gate_up_scale_2.dim() == 2]
    if split:
        ratios = torch.cat([(s[:, 1] / s[:, 0]).float().cpu() for s in split])
        differ = ratios != 1
        logger.info("%d of %d experts have different gate and up global scales (up/gate from %.3g to %.3g): each "
                    "half keeps its own", int(differ.sum()), ratios.numel(), float(ratios.min()), float(ratios.max()))
    logger.info("loaded %d NVFP4 linear layers and %d expert groups", len(layers), len(experts))
    return sorted(converted)


def _load_rest(model: nn.Module, state: dict[str, torch.Tensor], device: torch.device) -> None:
    """Copy ``state`` into the model's tensors; tensors still on the meta device are replaced by the loaded ones
    (on ``device``, in their own dtype), their ties restored, and meta non-persistent buffers (rotary tables)
    computed on ``device`` by transformers' ``_init_weights``."""
    targets = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    on_meta = {name for name in state if targets[name].device.type == "meta"}
    model.load_state_dict({name: value for name, value in state.items() if name not in on_meta}, strict=False)
    if on_meta:
        model.load_state_dict({name: state[name].to(device=device, dtype=targets[name].dtype) for name in on_meta},
                              strict=False, assign=True)
        if hasattr(model, "tie_weights"):
            model.tie_weights()
    for module in model.modules():
        meta = [name for name, buffer in module.named_buffers(recurse=False) if buffer.device.type == "meta"]
        if not meta:
            continue
        if list(module.parameters(recurse=False)) or not hasattr(model, "_init_weights"):
            break
        for name in meta:
            setattr(module, name, torch.empty_like(getattr(module, name), device=device))
        model._init_weights(module)
    left = [name for name, tensor in list(model.named_parameters()) + list(model.named_buffers())
            if tensor.device.type == "meta"]
    if left:
        raise ValueError(f"{len(left)} tensors of the model are still on the meta device after loading, e.g. "
                         f"{left[:3]}: build the model on a real device, or load them yourself")


class _Renamed(Mapping):
    def __init__(self, source: Mapping[str, torch.Tensor], renamed: dict[str, str]):
        self._source, self._renamed = source, renamed

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._source[self._renamed[key]]

    def __iter__(self) -> Iterator[str]:
        return iter(self._renamed)

    def __len__(self) -> int:
        return len(self._renamed)


def _expert_names(tensors: Mapping[str, torch.Tensor], name: str) -> tuple[str, str, str] | None:
    """The (gate, up, down) names the checkpoint stores ``name``'s experts under, one expert at a time."""
    for names in EXPERT_NAMES:
        if f"{name}.0.{names[0]}.weight" in tensors:
            return names
    return None


def _load_experts(module: nn.Module, name: str, names: tuple[str, str, str], tensors: Mapping[str, torch.Tensor],
                  take: Callable[[str], torch.Tensor], grouped: bool) -> NVFP4Experts:
    experts, inter2, hidden = module.gate_up_proj.shape
    if f"{name}.{experts}.{names[0]}.weight" in tensors:
        raise ValueError(f"the checkpoint has more than the model's {experts} experts")
    parts: dict[str, list[list[torch.Tensor]]] = {}
    for projection in names:
        loaded = [[take(f"{name}.{e}.{projection}.{suffix}") for suffix in ("weight", "weight_scale", "weight_scale_2")]
                  for e in range(experts)]
        parts[projection] = [list(column) for column in zip(*loaded)]
    gate, up, down = (parts[projection] for projection in names)
    gate_up = torch.cat([torch.stack(gate[0]), torch.stack(up[0])], dim=1)
    gate_up_scale = torch.cat([torch.stack(gate[1]), torch.stack(up[1])], dim=1)
    scales = torch.stack([torch.stack([g.reshape(()), u.reshape(())]) for g, u in zip(gate[2], up[2])]).float()
    if bool((scales[:, 0] == scales[:, 1]).all()):
        scales = scales[:, 0].contiguous()  # one decode scale per expert: the common case
    if tuple(gate_up.shape) != (experts, inter2, hidden // 2):
        raise ValueError(f"the checkpoint's gate and up weights stack to {tuple(gate_up.shape)} (packed), the model's "
                         f"gate_up_proj is {(experts, inter2, hidden)}")
    down_scale_2 = torch.stack([s.reshape(()) for s in down[2]]).float()
    return NVFP4Experts.from_checkpoint(gate_up, gate_up_scale, scales, torch.stack(down[0]), torch.stack(down[1]),
                                        down_scale_2, grouped=grouped)


def _aliases(model: nn.Module, converted: list[str]) -> list[list[str]]:
    """The model's parameter and buffer names outside ``converted`` modules, grouped by the tensor they name
    (tied weights share one), in the model's order."""
    groups: dict[int, list[str]] = {}
    inside = tuple(f"{name}." for name in converted)
    for name, tensor in list(model.named_parameters(remove_duplicate=False)) + list(
            model.named_buffers(remove_duplicate=False)):
        if name.startswith(inside) or tensor is None:
            continue
        groups.setdefault(id(tensor), []).append(name)
    persistent = set(model.state_dict())
    return [group for group in groups.values() if group[0] in persistent]


def save_modelopt_nvfp4(
    model: nn.Module,
    folder: str | Path,
    *,
    expert_names: tuple[str, str, str] = EXPERT_NAMES[0],
    max_file_bytes: int = 5 * 2**30,
) -> list[Path]:
    """Write ``model`` (quantized by ``integrations.transformers.quantize`` or loaded by ``load_modelopt_nvfp4``)
    as a ModelOpt-format NVFP4 checkpoint into ``folder``: ``NVFP4Linear`` layers under their names, stacked
    NVFP4 experts one expert and one projection at a time (``expert_names``: gate, up, down), every other tensor
    as it is (a tied tensor once), in ``*.safetensors`` files of at most ``max_file_bytes``, with
    ``hf_quant_config.json`` and, for a transformers model, its ``config.json``. ``load_modelopt_nvfp4`` reads it
    back into a model built on the meta device, which is quicker than quantizing again. Returns the files
    written."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    skipped: list[str] = []
    for name, module in model.named_modules():
        experts = getattr(module, "nvfp4", None)
        if isinstance(experts, NVFP4Experts):
            tensors |= _expert_tensors(name, experts, expert_names)
            skipped.append(f"{name}.nvfp4.")
    quantized = [name for name, module in model.named_modules() if isinstance(module, NVFP4Linear)]
    unquantized = [name for name, module in model.named_modules() if type(module) is nn.Linear]
    if not quantized and not skipped:
        raise ValueError("the model has no NVFP4 layers or experts: quantize it first "
                         "(integrations.transformers.quantize) or save it with save_pretrained")
    seen: set[tuple] = set()
    for key, tensor in model.state_dict().items():
        same = (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype)
        if key.startswith(tuple(skipped)) or (tensor.numel() and same in seen):
            continue  # tied weights (one tensor under two names) are saved once
        seen.add(same)
        tensors[key] = tensor.detach().contiguous().cpu()
    files = []
    for index, part in enumerate(_parts(tensors, max_file_bytes)):
        path = folder / f"model-{index:05d}.safetensors"
        save_file(part, str(path), metadata={"format": "pt"})
        files.append(path)
    quant = {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": unquantized}
    (folder / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "piecewise"}, "quantization": quant},
                                                            indent=2))
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_json_file"):
        config.to_json_file(str(folder / "config.json"))
    return files


def _expert_tensors(name: str, experts: NVFP4Experts, names: tuple[str, str, str]) -> dict[str, torch.Tensor]:
    """One expert and one projection at a time, as ModelOpt stores them."""
    half = experts.gate_up.shape[1] // 2
    decode = experts.gate_up_scale_2
    tensors = {}
    for e in range(experts.gate_up.shape[0]):
        for j, (projection, rows) in enumerate(((names[0], slice(0, half)), (names[1], slice(half, None)))):
            tensors[f"{name}.{e}.{projection}.weight"] = experts.gate_up[e, rows]
            tensors[f"{name}.{e}.{projection}.weight_scale"] = experts.gate_up_scale[e, rows]
            tensors[f"{name}.{e}.{projection}.weight_scale_2"] = decode[e, j] if decode.dim() == 2 else decode[e]
        tensors[f"{name}.{e}.{names[2]}.weight"] = experts.down[e]
        tensors[f"{name}.{e}.{names[2]}.weight_scale"] = experts.down_scale[e]
        tensors[f"{name}.{e}.{names[2]}.weight_scale_2"] = experts.down_scale_2[e]
    # copies: slices of one stacked tensor share its storage, which safetensors refuses to save
    return {key: value.detach().to("cpu", copy=True).contiguous() for key, value in tensors.items()}


def _parts(tensors: dict[str, torch.Tensor], max_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    part, size = {}, 0
    for key, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if part and size + nbytes > max_bytes:
            yield part
            part, size = {}, 0
        part[key] = tensor
        size += nbytes
    if part:
        yield part
