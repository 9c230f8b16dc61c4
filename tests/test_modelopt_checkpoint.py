"""``load_modelopt_nvfp4``: NVFP4 checkpoints in ModelOpt's Hugging Face format, written here from tiny random
transformers models (every nn.Linear but the head quantized by the reference; stacked experts saved one expert
and one projection at a time, each with its own global scale, as ModelOpt exports them), loaded into a model
built with other random weights, and run under piecewise against transformers' forward on the dequantized
weights."""

import copy
import json
import re

import pytest
import torch
from torch import nn

import piecewise

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from safetensors.torch import save_file  # noqa: E402

from piecewise.integrations.modelopt import load_modelopt_nvfp4  # noqa: E402
from piecewise.integrations.transformers import TokenModel, _is_experts, enable  # noqa: E402
from piecewise.kernels.nvfp4 import NVFP4Linear, dequantize, global_scale_for  # noqa: E402
from piecewise.kernels.nvfp4.reference import quantize_reference  # noqa: E402
from piecewise.models.glm_moe import NVFP4Experts  # noqa: E402
from test_transformers_zoo import build  # noqa: E402

QUANT_CONFIG = {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}


def _quantized(weight: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """ModelOpt's tensors for one weight (decode scale amax/2688) and the dequantized weight."""
    weight = weight.detach().float()
    encode = global_scale_for(weight)
    packed, scales = quantize_reference(weight, encode)
    tensors = {"weight": packed, "weight_scale": scales, "weight_scale_2": (1 / encode).reshape(()).float(),
               "input_scale": torch.tensor(0.25)}
    return tensors, dequantize(packed, scales, encode, dtype=torch.float32)


def modelopt_checkpoint(model: nn.Module, expert_names=("gate_proj", "up_proj", "down_proj")):
    """(the checkpoint's tensors, a float32 copy of ``model`` holding the dequantized weights)."""
    expected = copy.deepcopy(model).float()
    tensors = {}
    done = set()
    for name, module in model.named_modules():
        if type(module) is nn.Linear and name != "lm_head":
            parts, dense = _quantized(module.weight)
            tensors |= {f"{name}.{key}": value for key, value in parts.items()}
            expected.get_submodule(name).weight.data.copy_(dense)
            done.add(f"{name}.weight")
            if module.bias is not None:
                tensors[f"{name}.bias"] = module.bias.detach().clone()
                done.add(f"{name}.bias")
        elif _is_experts(module):
            inter = module.gate_up_proj.shape[1] // 2
            target = expected.get_submodule(name)
            for e in range(module.gate_up_proj.shape[0]):
                for projection, weight, rows in (
                        (expert_names[0], module.gate_up_proj[e, :inter], slice(0, inter)),
                        (expert_names[1], module.gate_up_proj[e, inter:], slice(inter, None)),
                        (expert_names[2], module.down_proj[e], None)):
                    parts, dense = _quantized(weight)
                    tensors |= {f"{name}.{e}.{projection}.{key}": value for key, value in parts.items()}
                    if rows is None:
                        target.down_proj.data[e] = dense
                    else:
                        target.gate_up_proj.data[e, rows] = dense
            done |= {f"{name}.gate_up_proj", f"{name}.down_proj"}
    for key, value in model.state_dict().items():
        if key not in done and key not in tensors:
            tensors[key] = value.detach().clone()
    if getattr(model.config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    return tensors, expected


def write(folder, tensors, quant=QUANT_CONFIG):
    folder.mkdir(parents=True, exist_ok=True)
    save_file({key: value.contiguous() for key, value in tensors.items()}, str(folder / "model.safetensors"))
    (folder / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": quant}))
    return folder


def fresh(name: str, dtype=torch.float32) -> nn.Module:
    """The same architecture with other random weights: everything must come from the checkpoint."""
    torch.manual_seed(123)
    config = build(name).config
    return transformers.AutoModelForCausalLM.from_config(config).eval().to(dtype)


def prefill_and_decode(call, token_model, ids, device="cpu"):
    cache = token_model.make_kv_cache(max_seq_len=32)
    with torch.no_grad():
        steps = [call(ids[:5], torch.arange(5, device=device), cache)]
        steps += [call(ids[p : p + 1], torch.tensor([p], device=device), cache) for p in range(5, 9)]
    return torch.cat(steps)


def assert_runs_as(loaded: nn.Module, expected: nn.Module):
    """Prefill and decode steps of ``loaded`` under piecewise give ``expected``'s logits; returns the runner."""
    ids = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        reference = expected(input_ids=ids[None], use_cache=False).logits[0]
    token_model = TokenModel(enable(loaded))
    runner = piecewise.compile(token_model, piecewise.CaptureConfig(max_tokens=16))
    torch.testing.assert_close(prefill_and_decode(runner, token_model, ids), reference, rtol=1e-4, atol=1e-4)
    return runner


@pytest.mark.parametrize("name", ["Qwen3Moe", "Glm4Moe", "Mixtral", "Qwen2"])
def test_a_modelopt_checkpoint_runs_under_piecewise_as_its_dequantized_weights(name, tmp_path, caplog):
    """Qwen3-MoE, GLM-4-MoE (a router with a correction bias, a dense first layer, shared experts) and Mixtral
    (experts saved as w1 / w3 / w2), and a dense Qwen2 with q/k/v biases: loaded from the folder, every linear
    layer but the head is NVFP4 and the experts are NVFP4 with the gate's and the up projection's own scales;
    prefill and decode steps under piecewise give transformers' logits on the dequantized weights."""
    model = build(name)
    names = ("w1", "w3", "w2") if name == "Mixtral" else ("gate_proj", "up_proj", "down_proj")
    tensors, expected = modelopt_checkpoint(model, names)
    folder = write(tmp_path, tensors)
    loaded = fresh(name)
    with caplog.at_level("INFO", logger="piecewise.integrations.modelopt"):
        converted = load_modelopt_nvfp4(loaded, folder)
    if name != "Qwen2":  # separately quantized gate and up: every expert's scales differ, and the log says so
        assert re.search(r"(\d+) of \1 experts have different gate and up global scales", caplog.text), caplog.text
    linears = [n for n, m in loaded.named_modules() if type(m) is nn.Linear]
    assert linears == ["lm_head"] and converted, linears
    experts = [m.nvfp4 for m in loaded.modules() if isinstance(getattr(m, "nvfp4", None), NVFP4Experts)]
    assert bool(experts) == (name != "Qwen2")
    for module in experts:  # separately quantized gate and up: a decode scale for each half
        assert module.gate_up_scale_2.dim() == 2 and not torch.equal(*module.gate_up_scale_2.unbind(1))
    runner = assert_runs_as(loaded, expected)
    assert runner.stats["traces"] == 1 and runner.stats["graph_breaks"] == 0


def test_tied_embeddings_and_renamed_keys(tmp_path):
    """A head tied to the embeddings is absent from the checkpoint and loads through its tie; ``key_map``
    renames checkpoint keys (here a checkpoint whose names lack the ``model.`` prefix)."""
    model = build("Qwen3")
    model.config.tie_word_embeddings = True
    model.tie_weights()
    tensors, expected = modelopt_checkpoint(model)
    assert "lm_head.weight" not in tensors
    renamed = {key.removeprefix("model."): value for key, value in tensors.items()}
    loaded = fresh("Qwen3")
    loaded.config.tie_word_embeddings = True
    loaded.tie_weights()
    with pytest.raises(ValueError, match=r"no place in the model.*key_map="):
        load_modelopt_nvfp4(copy.deepcopy(loaded), renamed, quant_config=QUANT_CONFIG)
    load_modelopt_nvfp4(loaded, renamed, quant_config=QUANT_CONFIG,
                        key_map=lambda key: key if key.startswith("lm_head") else f"model.{key}")
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    ids = torch.randint(0, 256, (7,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids[None]).logits, expected(input_ids=ids[None]).logits,
                                   rtol=1e-4, atol=1e-4)


def test_bad_checkpoints_are_refused_with_what_is_wrong(tmp_path):
    tensors, _ = modelopt_checkpoint(build("Qwen3Moe"))
    layer = "model.layers.0.self_attn.q_proj"

    model = fresh("Qwen3Moe")
    before = {key: value.clone() for key, value in model.state_dict().items()}

    def load(changed: dict, quant=QUANT_CONFIG, drop=()):
        return load_modelopt_nvfp4(model, {k: v for k, v in (tensors | changed).items() if k not in drop},
                                   quant_config=quant)

    with pytest.raises(ValueError, match="quant_algo is 'FP8'.*NVFP4"):
        load({}, quant={"quant_algo": "FP8"})
    with pytest.raises(ValueError, match="quant_method is 'compressed-tensors': another format"):
        load({}, quant={"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"})
    with pytest.raises(ValueError, match="group_size is 32"):
        load({}, quant=QUANT_CONFIG | {"group_size": 32})
    with pytest.raises(ValueError, match=f"the checkpoint has no {layer}.weight_scale_2"):
        load({}, drop=(f"{layer}.weight_scale_2",))
    encode = 1 / tensors[f"{layer}.weight_scale_2"]  # the commonest NVFP4 bug: the encode scale stored instead
    with pytest.raises(ValueError, match=f"{layer}: weight_scale_2=.* looks like an encode scale"):
        load({f"{layer}.weight_scale_2": encode})
    experts = "model.layers.1.mlp.experts"
    with pytest.raises(ValueError, match=f"{experts}: the checkpoint has no {experts}.3.down_proj.weight_scale"):
        load({}, drop=(f"{experts}.3.down_proj.weight_scale",))
    with pytest.raises(ValueError, match=f"{experts}: the checkpoint has more than the model's 4 experts"):
        load({f"{experts}.4.gate_proj.weight": tensors[f"{experts}.0.gate_proj.weight"]})
    with pytest.raises(ValueError, match="the checkpoint has no model.norm.weight"):
        load({}, drop=("model.norm.weight",))
    after = model.state_dict()  # every refusal left the model as it was
    assert after.keys() == before.keys() and all(torch.equal(after[key], before[key]) for key in before)
    with pytest.raises(ValueError, match="quantization_config"):
        load_modelopt_nvfp4(fresh("Qwen3Moe"), write_plain(tmp_path, tensors))
    with pytest.raises(ValueError, match="needs quant_config="):
        load_modelopt_nvfp4(fresh("Qwen3Moe"), tensors)


def write_plain(folder, tensors):
    save_file({key: value.contiguous() for key, value in tensors.items()}, str(folder / "model.safetensors"))
    return folder


def test_experts_with_one_scale_for_gate_and_up_keep_one():
    """Checkpoints that quantize gate and up with one global scale (ModelOpt's fused-aware export) give one
    decode scale per expert."""
    tensors, _ = modelopt_checkpoint(build("Qwen3Moe"))
    for key in [k for k in tensors if k.endswith("up_proj.weight_scale_2")]:
        tensors[key] = tensors[key.replace("up_proj", "gate_proj")]
    loaded = fresh("Qwen3Moe")
    load_modelopt_nvfp4(loaded, tensors, quant_config=QUANT_CONFIG)
    scales = [m.nvfp4.gate_up_scale_2 for m in loaded.modules() if isinstance(getattr(m, "nvfp4", None), NVFP4Experts)]
    assert scales and all(s.shape == (4,) for s in scales)


def test_per_half_decode_scales_compute_the_separate_projections():
    """Experts whose gate and up halves have decode scales of their own compute what the separately
    dequantized projections compute (CPU reference), also sharded over two tensor-parallel ranks; bad scale
    tensors are refused."""
    from piecewise.kernels.nvfp4.moe import moe_nvfp4_reference
    from piecewise.parallel import shard_experts

    torch.manual_seed(0)
    experts, inter, hidden = 3, 32, 64
    gate_up, down = torch.randn(experts, 2 * inter, hidden), torch.randn(experts, hidden, inter)
    halves = [[_quantized(w) for w in (gate_up[e, :inter], gate_up[e, inter:], down[e])] for e in range(experts)]
    packed = torch.stack([torch.cat([g["weight"], u["weight"]]) for (g, _), (u, _), _ in halves])
    scales = torch.stack([torch.cat([g["weight_scale"], u["weight_scale"]]) for (g, _), (u, _), _ in halves])
    decode = torch.stack([torch.stack([g["weight_scale_2"], u["weight_scale_2"]]) for (g, _), (u, _), _ in halves])
    down_packed = torch.stack([d["weight"] for _, _, (d, _) in halves])
    down_scales = torch.stack([d["weight_scale"] for _, _, (d, _) in halves])
    down_decode = torch.stack([d["weight_scale_2"] for _, _, (d, _) in halves])
    module = NVFP4Experts.from_checkpoint(packed, scales, decode, down_packed, down_scales, down_decode)
    x, ids = torch.randn(5, hidden), torch.randint(0, experts, (5, 2))
    weights = torch.rand(5, 2)
    expected = torch.zeros(5, hidden)
    for t in range(5):
        for j in range(2):
            (_, gate), (_, up), (_, w_down) = halves[int(ids[t, j])]
            expected[t] += weights[t, j] * (torch.nn.functional.silu(x[t] @ gate.T) * (x[t] @ up.T)) @ w_down.T
    def run(experts):
        return moe_nvfp4_reference(x, ids, weights, experts.gate_up, experts.gate_up_scale, experts.gate_up_scale_2,
                                   experts.down, experts.down_scale, experts.down_scale_2)

    torch.testing.assert_close(run(module), expected, rtol=1e-4, atol=1e-4)
    # Tensor parallel: each of two ranks keeps half of the gate rows and half of the up rows; the halves' decode
    # scales stay whole, and the ranks' partial sums add up to the whole.
    partials = []
    for rank in range(2):
        shard = copy.deepcopy(module)
        shard_experts(shard, inter, rank, 2, "experts")
        assert shard.gate_up.shape[1] == inter and shard.gate_up_scale_2.shape == (experts, 2)
        partials.append(run(shard))
    torch.testing.assert_close(partials[0] + partials[1], expected, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=r"gate_up_scale_2 must hold positive finite decode scales of shape \[3\] or \[3, 2\]"):
        NVFP4Experts.from_checkpoint(packed, scales, decode[:, :1], down_packed, down_scales, down_decode)
    with pytest.raises(ValueError, match="down_scale_2=.* looks like an encode scale"):
        NVFP4Experts.from_checkpoint(packed, scales, decode, down_packed, down_scales, 1 / down_decode)


@pytest.mark.parametrize("name", ["Glm4Moe", "Qwen3"])
def test_a_model_built_on_the_meta_device_loads_without_its_16_bit_weights(name, tmp_path):
    """``with torch.device("meta"): from_config(...)`` allocates no weights; the loader puts every tensor on the
    CPU (the parameters in their dtype), computes the rotary tables there, and the model runs as above."""
    model = build(name)
    tensors, expected = modelopt_checkpoint(model)
    with torch.device("meta"):
        loaded = transformers.AutoModelForCausalLM.from_config(model.config).eval()
    load_modelopt_nvfp4(loaded, write(tmp_path, tensors))
    assert not [n for n, t in list(loaded.named_parameters()) + list(loaded.named_buffers()) if t.device.type != "cpu"]
    rotary = [(n, b) for n, b in loaded.named_buffers() if n.endswith("inv_freq")]
    assert rotary and all(torch.equal(b, dict(model.named_buffers())[n]) for n, b in rotary)
    assert_runs_as(loaded, expected)


def test_layers_the_model_class_ignores_are_skipped(tmp_path):
    """GLM-4.5's multi-token-prediction layer (``model.layers.46``, which transformers' class lists in
    ``_keys_to_ignore_on_load_unexpected``) is skipped, quantized or not; other strays are refused. The
    quantization section may also sit in config.json's ``quantization_config``."""
    tensors, expected = modelopt_checkpoint(build("Glm4Moe"))
    extra = {"model.layers.46.mlp.experts.0.gate_proj.weight": tensors["model.layers.1.mlp.experts.0.gate_proj.weight"].clone(),
             "model.layers.46.eh_proj.weight": torch.zeros(64, 128)}
    save_file({key: value.contiguous() for key, value in (tensors | extra).items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "modelopt",
                                                                               "quantization": QUANT_CONFIG}}))
    loaded = fresh("Glm4Moe")
    load_modelopt_nvfp4(loaded, tmp_path)
    assert_runs_as(loaded, expected)
    with pytest.raises(ValueError, match=r"1 checkpoint tensors have no place in the model, e.g. \['model.stray'\]"):
        load_modelopt_nvfp4(fresh("Glm4Moe"), tensors | {"model.stray": torch.zeros(2)}, quant_config=QUANT_CONFIG)


@pytest.mark.parametrize("name", ["Glm4Moe", "Qwen3"])
def test_a_quantized_model_saved_and_loaded_from_the_meta_device_gives_the_same_logits(name, tmp_path):
    """``quantize`` then ``save_modelopt_nvfp4``; a model built on the meta device from the saved config.json and
    loaded from the folder (several files) gives exactly the quantized model's logits. Qwen3 with a head tied
    to the embeddings: the tensor is saved once."""
    from piecewise.integrations.modelopt import save_modelopt_nvfp4
    from piecewise.integrations.transformers import quantize

    model = build(name)
    if name == "Qwen3":
        model.config.tie_word_embeddings = True
        model.tie_weights()
    quantize(enable(model))
    files = save_modelopt_nvfp4(model, tmp_path, max_file_bytes=100_000)
    assert len(files) > 1 and (tmp_path / "config.json").exists()
    quant = json.loads((tmp_path / "hf_quant_config.json").read_text())["quantization"]
    assert quant["quant_algo"] == "NVFP4" and quant["exclude_modules"] == ["lm_head"]
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    with torch.device("meta"):
        loaded = transformers.AutoModelForCausalLM.from_config(config).eval()
    converted = load_modelopt_nvfp4(loaded, tmp_path)
    assert converted == sorted(n for n, m in model.named_modules()
                               if isinstance(m, NVFP4Linear) or isinstance(getattr(m, "nvfp4", None), NVFP4Experts))
    if name == "Qwen3":
        assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert torch.equal(enable(loaded)(input_ids=ids[None]).logits, model(input_ids=ids[None]).logits)
    with pytest.raises(ValueError, match="no NVFP4 layers or experts: quantize it first"):
        save_modelopt_nvfp4(build("Qwen2"), tmp_path / "plain")


def test_the_nvfp4_checkpoint_example_writes_reloads_and_generates():
    """examples/nvfp4_checkpoint.py without a folder: a tiny GLM-MoE quantized, saved, rebuilt on the meta device,
    loaded (same logits) and generating under piecewise."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root / "src"), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(root / "examples" / "nvfp4_checkpoint.py"), "--device", "cpu"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "21 NVFP4 linear layers" in done.stdout and "reloaded logits equal the quantized model's: True" in done.stdout
    assert done.stdout.count("request ") == 3


def test_piecewise_checkpoint_says_what_a_checkpoint_holds_and_what_is_wrong(tmp_path, capsys):
    """``piecewise checkpoint FOLDER`` reads headers and decode scales only: quantized layers, experts, experts
    whose gate and up scales differ, and (exit 1) a decode scale stored as an encode scale, named."""
    from piecewise.cli import main

    model = build("Qwen3Moe")
    tensors, _ = modelopt_checkpoint(model)
    good = write(tmp_path / "good", tensors)
    assert main(["checkpoint", str(good), "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    linears = [n for n, m in model.named_modules() if type(m) is nn.Linear and n != "lm_head"]
    assert sorted(found["quantized"]) == sorted(linears) and found["problems"] == []
    assert found["experts"] == {f"model.layers.{i}.mlp.experts": 4 for i in range(2)}
    assert found["gate_up"]["differ"] == found["gate_up"]["of"] == 8
    assert main(["checkpoint", str(good)]) == 0
    assert "differ in 8 of 8 experts" in capsys.readouterr().out
    layer = "model.layers.0.self_attn.o_proj"
    bad = write(tmp_path / "bad", tensors | {f"{layer}.weight_scale_2": 1 / tensors[f"{layer}.weight_scale_2"]})
    assert main(["checkpoint", str(bad), "--json"]) == 1
    assert any(problem.startswith(f"{layer}.weight_scale_2=") and "encode scale" in problem
               for problem in json.loads(capsys.readouterr().out)["problems"])
    assert main(["checkpoint", str(tmp_path / "missing")]) == 2
