"""Hugging Face transformers causal LMs under piecewise: attention and MoE experts become splitting ops.

    from transformers import AutoModelForCausalLM
    from piecewise.integrations.transformers import TokenModel, enable

    model = AutoModelForCausalLM.from_pretrained(...)   # any model that dispatches through transformers'
    enable(model)                                        # attention (and experts) interfaces
    runner = piecewise.compile(TokenModel(model), piecewise.CaptureConfig(max_tokens=512))
    logits = runner(input_ids, position_ids)             # one sequence, no KV cache: [T] → [T, vocab]

    cache = TokenModel(model).make_kv_cache(max_seq_len=4096)   # prefill, then decode steps, one sequence
    logits = runner(prompt_ids, torch.arange(len(prompt_ids)), cache)
    logits = runner(next_id, torch.tensor([len(prompt_ids)]), cache)

``enable`` registers an attention implementation named ``"piecewise"`` and selects it in the model's config;
for MoE models whose experts dispatch through transformers' experts interface (stacked ``gate_up_proj`` /
``down_proj``, SwiGLU) it keeps transformers' ``grouped_mm`` experts (static shapes, captured with the pieces)
and replaces any other implementation by a ``"piecewise"`` one. Attention runs eagerly between pieces on the
real tokens: causal over the call's tokens without a KV cache, or, given one (``TokenModel.make_kv_cache``;
transformers' own Cache objects are not used), it writes the call's keys and values at ``position_ids`` and
attends causally over the cache (``kernels.attention``; MLA models over latent rows, ``integrations.mla``),
with the layer's sliding window and logit softcap. With ``slots`` the tokens of many sequences share one call.
Piecewise's experts run through ``models.glm_moe.moe_experts`` (a splitting op: the loop over the experts that
got tokens is data dependent) or, with NVFP4 weights, the grouped op captured in the pieces. ``TokenModel`` gives
the model the token-major call piecewise pads: ``input_ids`` and ``position_ids`` [T]. ``quantize`` gives an
enabled model NVFP4 weights (W4A16); ``tensor_parallel`` shards it over a process group.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from ..context import redirect_padding
from ..kernels.attention import attend, attend_over_cache, sdpa
from ..kernels.nvfp4 import quantize_linears
from ..models.attention import attention as cached_attention
from ..models.attention import cache_overflow_named, within_kernel
from ..models.glm_moe import NVFP4Experts, moe_experts
from ..opaque import opaque_op
from ..parallel import reduce_partial
from . import dsa, mla
from .token_model import TokenModel  # noqa: F401 - part of this module's API

NAME = dsa.ATTENTION


def _attention_fake(q, k, v, scaling, window=0, softcap=0.0):
    return q.new_empty(q.shape)


@opaque_op("piecewise_hf::causal_attention", fake=_attention_fake, split=True, capturable=True)
def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, window: int = 0,
                     softcap: float = 0.0) -> torch.Tensor:
    """Causal attention of one sequence, token-major: q [T, Hq, D], k / v [T, Hkv, D] → [T, Hq, D];
    ``window`` / ``softcap`` as in ``kernels.attention.attend_over_cache``."""
    if window > 0 or softcap > 0:  # the call's keys as a cache at positions 0..T-1
        positions = torch.arange(q.shape[0], device=q.device)
        return attend_over_cache(q, k, v, positions, scaling, window, softcap).view(q.shape)
    group = q.shape[1] // k.shape[1]
    keys = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, T, D]
    values = v.repeat_interleave(group, dim=1).transpose(0, 1)
    out = sdpa(q.transpose(0, 1), keys, values, is_causal=True, scale=scaling)
    return out.transpose(0, 1).contiguous()  # as the fake


def _slot_attention_fake(q, k, v, positions, slots, kv_cache, layer, scale, window=0, softcap=0.0):
    return q.new_empty(q.shape)


@opaque_op("piecewise_hf::slot_attention", fake=_slot_attention_fake, mutates_args=("kv_cache",), split=True,
           capturable=within_kernel)
def slot_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                   kv_cache: torch.Tensor, layer: int, scale: float, window: int = 0,
                   softcap: float = 0.0) -> torch.Tensor:
    """Tokens of several sequences, token-major (q [T, Hq, D], k / v [T, Hkv, D]): token t is at ``positions[t]``
    of sequence ``slots[t]``. Its keys and values go to ``kv_cache[layer, :, slots[t], positions[t]]`` (cache
    [layers, 2, sequences, max_seq, Hkv, D]); then each token attends causally over its sequence's cache.

    On CUDA, calls of up to 512 tokens (decode steps, short prefills) run one Triton launch for all sequences
    (``kernels.attention.attend``); longer calls and CPU run one attention per sequence."""
    cache = kv_cache[layer]
    at_slots, at, k_in, v_in = redirect_padding(slots, positions, k, v)  # full graph: pads repeat row 0's write
    with cache_overflow_named(positions, cache.shape[2]):
        cache[0][at_slots, at], cache[1][at_slots, at] = k_in, v_in
    return attend(q, cache[0], cache[1], positions, scale, slots, window, softcap)


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention interface: q [1, Hq, T, D], k / v [1, Hkv, T, D] → ([1, T, Hq, D], None).
    Sliding windows (``sliding_window``) and logit softcapping (``softcap``) are computed; attention sinks
    (``s_aux``) and non-causal modules are refused."""
    sinks = kwargs.get("s_aux") is not None
    if sinks or not getattr(module, "is_causal", True):
        raise ValueError(
            f"{type(module).__name__} asks for {'attention sinks (s_aux)' if sinks else 'non-causal attention'}, "
            f"which the piecewise attention does not compute: leave this model's attn_implementation as it was"
        )
    if query.shape[0] != 1:
        raise ValueError(
            f"the piecewise attention takes one sequence (batch 1), got a batch of {query.shape[0]}: call the "
            f"model through piecewise.integrations.transformers.TokenModel, or give transformers its own attention "
            f"back with piecewise.integrations.transformers.disable(model) (enable(), which piecewise.generate "
            f"applies, routed it through piecewise)"
        )
    indices = kwargs.get("indices")  # DeepSeek sparse attention: each query's selected keys (dsa_select)
    if attention_mask is not None and indices is None:  # the causal mask is never built (_no_mask): the model's own
        raise ValueError(
            f"{type(module).__name__} passes an attention mask of its own ({tuple(attention_mask.shape)}), which the "
            f"piecewise attention does not apply (it computes causal, sliding-window and softcapped attention): "
            f"leave this model's attn_implementation as it was"
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    window = _window(module, kwargs)
    softcap = float(kwargs.get("softcap") or 0.0)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # token-major [T, H, D]
    value_dim = v.shape[-1]
    if q.shape[-1] != value_dim:  # MLA (DeepSeek-V3): zero columns up to one width leave q·k unchanged
        width = max(q.shape[-1], value_dim)
        q, k, v = (F.pad(t, (0, width - t.shape[-1])) for t in (q, k, v))
    call = {**getattr(module, "_piecewise_call", {}), **kwargs}  # TokenModel's call arguments (enable()'s dict)
    kv_cache = call.get("piecewise_kv_cache")
    if torch.is_autocast_enabled(q.device.type):  # rotary leaves q, k in float32: one dtype, autocast's as SDPA's
        dtype = kv_cache.dtype if kv_cache is not None and kv_cache.dtype in _FLOATS else \
            torch.get_autocast_dtype(q.device.type)  # (or the cache's, which is written and read whole)
        q, k, v = (t.to(dtype) for t in (q, k, v))
    if kv_cache is None and k.shape[0] != q.shape[0]:  # keys from transformers' own cache: not aligned by position
        raise ValueError(
            f"{type(module).__name__} got {k.shape[0]} keys for {q.shape[0]} queries: the model was called with "
            f"transformers' own cache (past_key_values), which the piecewise attention does not read. Call it "
            f"through piecewise.integrations.transformers.TokenModel with a cache from make_kv_cache, or give "
            f"transformers its own attention back with piecewise.integrations.transformers.disable(model) (enable(), "
            f"which piecewise.generate applies, routed it through piecewise)"
        )
    if kv_cache is not None and tuple(kv_cache.shape[-2:]) != tuple(k.shape[1:]):
        raise ValueError(
            f"{type(module).__name__} (layer {module.layer_idx}) has {k.shape[1]} key/value heads of width "
            f"{k.shape[2]}, the KV cache {kv_cache.shape[-2]} of width {kv_cache.shape[-1]}: make the cache with "
            f"TokenModel(model).make_kv_cache (it reads them from the config), after tensor_parallel if used"
        )
    if indices is not None:
        positions = call.get("piecewise_positions")
        if positions is None:
            positions = call["position_ids"][0] if call.get("position_ids") is not None else torch.arange(
                q.shape[0], device=q.device)
        out = dsa.dsa_attention(q, k, v, positions, call.get("piecewise_slots"), kv_cache, module.layer_idx, scale,
                                indices[0].long())
    elif kv_cache is None:
        out = causal_attention(q, k, v, scale, window, softcap)
    else:
        positions = call.get("piecewise_positions")
        if positions is None:
            if call.get("position_ids") is None:
                raise ValueError(
                    f"{type(module).__name__} passes no position_ids to the attention, which the KV cache needs: "
                    f"call the model through piecewise.integrations.transformers.TokenModel"
                )
            positions = call["position_ids"][0]
        if call.get("piecewise_slots") is not None:
            out = slot_attention(q, k, v, positions, call["piecewise_slots"], kv_cache, module.layer_idx, scale,
                                 window, softcap)
        else:
            out = cached_attention(q, k, v, positions, kv_cache, module.layer_idx, scale, window,
                                   softcap).view(q.shape)
    return out[..., :value_dim].unsqueeze(0), None


def experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' experts interface for stacked SwiGLU experts: hidden_states [T, H] → [T, H]."""
    nvfp4 = getattr(self, "nvfp4", None)
    if nvfp4 is not None:
        out = nvfp4(hidden_states, top_k_index, top_k_weights)
    else:
        out = _dense_experts(self, hidden_states, top_k_index, top_k_weights)
    reduce = getattr(self, "piecewise_reduce", None)  # (group, in_graph) when tensor_parallel sharded the experts
    return reduce_partial(out, *reduce) if reduce is not None else out


def _dense_experts(self, hidden_states, top_k_index, top_k_weights):
    act = getattr(getattr(self, "config", None), "hidden_act", "silu")
    if (getattr(self, "has_bias", False) or not getattr(self, "has_gate", True) or getattr(self, "is_transposed", False)
            or not getattr(self, "is_concatenated", True) or act not in ("silu", "swish")):
        raise ValueError(
            f"{type(self).__name__}: the piecewise experts take stacked gate_up_proj [E, 2I, H] (gate, then up) and "
            f"down_proj [E, H, I], without bias, with SiLU; this model's experts differ (activation {act!r}): "
            f"enable(model, experts=False) keeps transformers' own"
        )
    return moe_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj)


def _is_experts(module: nn.Module) -> bool:
    """A stacked-experts module (transformers' experts interface: ``gate_up_proj`` [E, 2I, H], ``down_proj``
    [E, H, I] tensors). Dense MLPs with layers of those names (Phi-3, GLM-4: ``nn.Linear``) are not."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return isinstance(gate_up, torch.Tensor) and gate_up.dim() == 3 and isinstance(down, torch.Tensor)


def _window(module: nn.Module, kwargs: dict) -> int:
    """The layer's sliding window as the model passes it (Mistral, Gemma), else as its mask (which ``_no_mask`` drops)
    would apply it: the module's own (Qwen2-MoE's sliding layers), the config's for a ``sliding_attention`` layer,
    or without layer types the config's for every layer (PhiMoE); 0 for none."""
    if "sliding_window" in kwargs or "sliding_window" in vars(module):
        return int(kwargs.get("sliding_window", vars(module).get("sliding_window")) or 0)
    config = getattr(module, "config", None)
    window, layer_types = getattr(config, "sliding_window", None), getattr(config, "layer_types", None)
    if not window or not layer_types:
        return int(window or 0)
    return int(window) if layer_types[getattr(module, "layer_idx", 0)] == "sliding_attention" else 0


def _no_mask(*args, **kwargs):
    """transformers' mask interface: no mask, the attention op is causal by itself. A 2-D mask given to
    ``create_causal_mask`` is refused whatever its values (reading them would be a data-dependent branch in the
    trace): the caller's padding, or a mask of ones the model makes when it gets none (BioGPT; OPT until
    transformers 5.18, which keeps it for the positions only and passes ``None``)."""
    mask = kwargs.get("attention_mask")
    if mask is not None:
        raise ValueError(
            f"the model builds its attention mask from a padding mask {tuple(mask.shape)}, which the piecewise "
            f"attention (causal, over unpadded tokens) cannot apply: call the model through "
            f"piecewise.integrations.transformers.TokenModel, which passes none. Models that make a mask of ones "
            f"themselves (BioGPT; OPT before transformers 5.18) are not supported"
        )
    if dsa.is_indexed(kwargs.get("config")):
        return dsa.dummy_mask(kwargs)
    return None  # the attention op is causal by itself


_LAYER_TYPES = {"full_attention", "sliding_attention", *dsa.INDEXED}


def _check_config(config) -> None:
    """Refuse attention variants the piecewise attention would get wrong, before any forward."""
    layer_types = set(getattr(config, "layer_types", None) or ()) - _LAYER_TYPES
    if layer_types:
        raise ValueError(
            f"piecewise.integrations.transformers cannot run this model's attention: layer_types "
            f"{sorted(layer_types)} (full and sliding-window causal attention and DeepSeek sparse attention are "
            f"supported)"
        )


def enable(model: nn.Module, *, experts: bool | None = None, latent_cache: bool = True) -> nn.Module:
    """Route ``model``'s attention (and its stacked MoE experts, see ``experts``) through piecewise's ops.

    ``experts=True``: piecewise's experts op (bf16: the per-expert loop as a splitting op; NVFP4 after
    ``quantize``: the grouped op captured with the pieces). ``False``: the model's own implementation stays
    inside the pieces. ``None`` (default): transformers' ``grouped_mm`` implementation is kept (static shapes,
    device-side offsets: traced and captured with the rest) where its weights are bf16 or on the CPU; any other
    is replaced by piecewise's op (its eager loop branches on which experts got tokens, and under tracing
    transformers runs CUDA experts of other dtypes through a fallback that copies the offsets to the host).

    ``latent_cache``: MLA models cache one latent row per token and layer (``integrations.mla``); False keeps
    per-head keys and values (57 times the bytes for GLM-5), as transformers 5.17 does, for comparison."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    _check_config(model.config)
    _check_attention_modules(model)
    if "_piecewise_original" not in vars(model):  # what disable() puts back
        model._piecewise_original = (model.config._attn_implementation,
                                     getattr(model.config, "_experts_implementation", None))
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, _no_mask)
    model.config._attn_implementation = NAME
    _share_call_arguments(model)
    if dsa.is_indexed(model.config):
        dsa.enable_indexed(model, model._piecewise_call)
    mla.enable_latent(model, latent_cache)
    if experts is None:
        stacked = [m.gate_up_proj for m in model.modules() if _is_experts(m)]
        experts = getattr(model.config, "_experts_implementation", None) != "grouped_mm" or any(
            w.is_cuda and w.dtype != torch.bfloat16 for w in stacked)
    if experts:
        _use_piecewise_experts(model)
    return model


def disable(model: nn.Module) -> nn.Module:
    """Undo ``enable``: transformers' own attention, mask and experts again (and MLA's and DSA's own forwards), so
    that the model's ``generate`` and calls with ``past_key_values`` work as before. ``TokenModel`` then refuses a
    KV cache (nothing would read it) until ``enable`` is called again (``piecewise.generate`` calls it); graphs
    already captured keep replaying what they captured."""
    original = vars(model).pop("_piecewise_original", None)
    if original is None:
        return model  # never enabled
    attention, experts = original
    model.config._attn_implementation = attention
    if experts is not None:
        model.config._experts_implementation = experts
    mla.enable_latent(model, False)
    for module in dsa.indexers(model):
        module.__dict__.pop("forward", None)
    model._piecewise_call = None
    return model


def _attention_modules(model: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """(parent, attention module) pairs: transformers names its attention classes ``*Attention``."""
    return [(parent, child) for parent in model.modules() for child in parent.children()
            if type(child).__name__.endswith("Attention")]


def _check_attention_modules(model: nn.Module) -> None:
    """Refuse a model whose attention classes compute attention in their own code (Falcon, Bloom, GPT-J, MPT,
    CodeGen): they never call transformers' attention interface, so piecewise's attention and KV cache would
    not be used, and with the mask function replaced they fail or compute without a mask."""
    for cls in {type(child) for _, child in _attention_modules(model)}:
        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):  # no source to read: assume the interface
            continue
        if "ALL_ATTENTION_FUNCTIONS" not in source:
            raise ValueError(
                f"piecewise.integrations.transformers cannot run {type(model).__name__}: {cls.__name__} computes "
                f"attention in its own code, not through transformers' attention interface (ALL_ATTENTION_FUNCTIONS), "
                f"so piecewise's attention and KV cache would not be used. Compile the model without enable(), "
                f"or use an architecture whose attention goes through the interface"
            )


def _share_call_arguments(model: nn.Module) -> None:
    """One dict per model, seen by every attention module: ``TokenModel.forward`` puts the call's cache, slots and
    positions in it for the length of the model call. The attention reads them from there, so they arrive even
    where a decoder layer or an attention module does not pass its keyword arguments on (StableLM and GPT-NeoX
    layers drop them: the attention would run without the cache and attend to the call's own tokens only;
    GPTBigCode and Persimmon pass no ``position_ids`` to the attention)."""
    shared = getattr(model, "_piecewise_call", None)
    if shared is None:
        shared = model._piecewise_call = {}
    for _, child in _attention_modules(model):
        child._piecewise_call = shared


def _use_piecewise_experts(model: nn.Module) -> None:
    if any(_is_experts(m) for m in model.modules()):
        from transformers.integrations.moe import ExpertsInterface

        ExpertsInterface.register(NAME, experts_forward)
        model.config._experts_implementation = NAME


def quantize(model: nn.Module, *, grouped_experts: bool = True) -> list[str]:
    """NVFP4 weights for an ``enable``d model, in place: every ``nn.Linear`` but the output head (and MLA's
    ``kv_b_proj`` over a latent cache, read as a weight) and every stacked-experts module (``NVFP4Experts``;
    ``grouped_experts``: the grouped op, captured with the pieces; False: the per-expert loop as a splitting op),
    which switch to piecewise's experts op, the only one that runs them. Returns the qualified names converted."""
    _use_piecewise_experts(model)
    converted = quantize_linears(model, skip=("lm_head", "kv_b_proj") if mla.uses_latent_cache(model) else ("lm_head",))
    for name, module in model.named_modules():
        if _is_experts(module):
            stacked = SimpleNamespace(gate_up=module.gate_up_proj, down=module.down_proj)
            module.nvfp4 = NVFP4Experts(stacked, grouped=grouped_experts)
            del module.gate_up_proj, module.down_proj
            converted.append(name)
    return converted


TENSOR_PARALLEL_PLAN = {
    "*.q_proj": "column", "*.k_proj": "column", "*.v_proj": "column", "*.o_proj": "row",
    "*.gate_proj": "column", "*.up_proj": "column", "*.down_proj": "row",
}
"""Llama-style layer names: attention by heads, the MLPs (dense and shared experts) by their columns."""


def tensor_parallel(model: nn.Module, group=None, *, capture_all_reduce: bool = False) -> list[str]:
    """Shard an ``enable``d Llama-style model over ``group`` (``piecewise.parallel.tensor_parallel`` with
    ``TENSOR_PARALLEL_PLAN``). transformers' attention reshapes by ``head_dim``, so each rank simply runs its
    share of the heads; ``TokenModel.make_kv_cache`` then sizes the cache for this rank's KV heads. Stacked
    routed experts (bf16 or NVFP4) keep their share of the intermediate dimension and their partial output is
    all-reduced, when they run as piecewise's experts (``enable(model, experts=True)``, or after ``quantize``);
    transformers' own (``grouped_mm``) stay whole on every rank. Returns the qualified names sharded."""
    from ..parallel import check_divisible, rank_of, shard_experts
    from ..parallel import tensor_parallel as shard

    c = model.config
    rank, world, name = rank_of(group)
    check_divisible({"num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
                     "intermediate_size": getattr(c, "intermediate_size", world)}, world, "config")
    sharded = shard(model, TENSOR_PARALLEL_PLAN, group, capture_all_reduce=capture_all_reduce)
    ours = getattr(c, "_experts_implementation", None) == NAME  # transformers' own experts would not all-reduce
    for qualified, module in model.named_modules():
        nvfp4 = getattr(module, "nvfp4", None)  # the NVFP4 copies quantize made, or the bf16 stacks
        if ours and (_is_experts(module) or nvfp4 is not None):
            if nvfp4 is None:
                shard_experts(module, c.moe_intermediate_size, rank, world, qualified, "gate_up_proj", "down_proj")
            else:
                shard_experts(nvfp4, c.moe_intermediate_size, rank, world, qualified)
            module.piecewise_reduce = (name, capture_all_reduce)
            sharded.append(qualified)
    model.piecewise_world_size = world
    return sharded
