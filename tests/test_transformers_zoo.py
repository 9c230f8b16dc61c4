"""More transformers architectures under piecewise on CPU (tiny random configs, no downloads): dense, MoE
(stacked experts through the experts interface) and MLA (DeepSeek-V3). Each: a 6-token prefill into the KV
cache, then 5 one-token decode steps, against transformers' forward over the whole sequence. And the
architectures piecewise refuses, with the reason."""

import pytest
import torch
from packaging.version import Version

import piecewise

transformers = pytest.importorskip("transformers")
from piecewise.integrations.mla import uses_latent_cache  # noqa: E402
from piecewise.integrations.transformers import TokenModel, enable  # noqa: E402

OPT_PASSES_NO_MASK = Version(transformers.__version__) >= Version("5.18")
"""Until transformers 5.18, OPT made a padding mask of ones when it got none and gave it to create_causal_mask,
which piecewise refuses (it cannot tell it from real padding); since then the ones only compute positions."""

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
             eos_token_id=1)
ARCHITECTURES = {
    "Mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "Qwen2Moe": ("Qwen2MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                        shared_expert_intermediate_size=64)),
    "Qwen3Moe": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
    "Qwen2": ("Qwen2Config", {}),
    "Qwen3": ("Qwen3Config", {}),
    "Phi3": ("Phi3Config", {}),
    "Glm4": ("Glm4Config", {}),  # like Phi-3, a dense MLP whose layers are named gate_up_proj / down_proj
    "Gemma3Text": ("Gemma3TextConfig", dict(sliding_window=4)),
    "Olmo2": ("Olmo2Config", {}),
    # decoder layers that call their attention without passing keyword arguments on (the cache is routed)
    "StableLm": ("StableLmConfig", {}),  # also partial rotary (a quarter of each head)
    "GPTNeoX": ("GPTNeoXConfig", dict(num_key_value_heads=None)),  # fused qkv, parallel residual
    "Gemma2": ("Gemma2Config", dict(sliding_window=4)),  # logit softcapping, alternating sliding window
    "Cohere2": ("Cohere2Config", dict(sliding_window=4)),
    "Starcoder2": ("Starcoder2Config", dict(sliding_window=4)),  # LayerNorm, biases
    "GraniteMoe": ("GraniteMoeConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "Glm4Moe": ("Glm4MoeConfig", dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                      first_k_dense_replace=1, n_group=1, topk_group=1)),
    # attention modules that pass no position_ids to the attention (TokenModel's positions are shared)
    "GPTBigCode": ("GPTBigCodeConfig", dict(n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                            num_key_value_heads=None, head_dim=None)),
    "Persimmon": ("PersimmonConfig", dict(num_key_value_heads=None, head_dim=None)),
    # MLA: keys of nope + rope width, values of another; the trace assumes more than one token (key assembly)
    "DeepseekV3": ("DeepseekV3Config", dict(num_key_value_heads=4, head_dim=None, n_routed_experts=4,
                                            num_experts_per_tok=2, moe_intermediate_size=32, q_lora_rank=16,
                                            kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                                            first_k_dense_replace=1, n_group=1, topk_group=1)),
}
OPT = {
    # learned positions (offset 2), the query scaled before the attention (scaling=1.0), biases, ReLU
    "OPT": ("OPTConfig", dict(ffn_dim=128, word_embed_proj_dim=64, num_key_value_heads=None, head_dim=None)),
    # OPT-350m's layout: LayerNorm after each block, embeddings projected in and out (project_in / project_out)
    "OPT-post-norm": ("OPTConfig", dict(ffn_dim=128, word_embed_proj_dim=32, do_layer_norm_before=False,
                                        num_key_value_heads=None, head_dim=None)),
}
if OPT_PASSES_NO_MASK:  # ARCHITECTURES is also what tests/gpu/test_transformers_zoo_gpu.py runs
    ARCHITECTURES.update(OPT)
NAMES = list(ARCHITECTURES) + [
    pytest.param(name, marks=pytest.mark.skip(reason="OPT makes a mask of ones before transformers 5.18 (refused: "
                                              "test_attention_masks_the_op_cannot_apply_are_refused_at_the_call)"))
    for name in OPT if name not in ARCHITECTURES]


def logits_of_steps(call, token_model, ids: torch.Tensor) -> torch.Tensor:
    """``call`` (the token model or a runner of it) on a fresh cache: ``ids[:5]`` as a prompt, then one decode
    step per remaining token; the logits of every call, in order."""
    cache = token_model.make_kv_cache(max_seq_len=32)
    with torch.no_grad():
        steps = [call(ids[:5], torch.arange(5), cache)]
        steps += [call(ids[p : p + 1], torch.tensor([p]), cache) for p in range(5, len(ids))]
    return torch.cat(steps)


def build(name: str):
    config_name, extra = ARCHITECTURES[name] if name in ARCHITECTURES else OPT[name]
    config_class = getattr(transformers, config_name, None)
    if config_class is None:
        pytest.skip(f"this transformers has no {config_name}")
    values = {key: value for key, value in {**SMALL, **extra}.items() if value is not None}
    torch.manual_seed(0)
    return init_stacked_experts(transformers.AutoModelForCausalLM.from_config(config_class(**values)).eval())


def init_stacked_experts(model):
    """``model`` with its stacked experts drawn from N(0, 0.05²): transformers leaves them uninitialised outside
    ``from_pretrained``."""
    for module in model.modules():
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(module, name, None)
            if isinstance(weight, torch.nn.Parameter) and weight.dim() == 3:
                torch.nn.init.normal_(weight, std=0.05)
    return model


def prefill_then_decode(name: str, device: str = "cpu", frontend: str = "auto"):
    """``name``'s model on ``device``: (piecewise logits of a 6-token prefill and 5 decode steps, transformers'
    logits of the whole sequence, the runner)."""
    model = build(name).to(device)
    ids = torch.randint(0, 256, (11,), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        expected = model(input_ids=ids[None], use_cache=False).logits[0]
    token_model = TokenModel(enable(model))
    runner = piecewise.compile(token_model, piecewise.CaptureConfig(max_tokens=16, frontend=frontend))
    cache = token_model.make_kv_cache(max_seq_len=32)
    with torch.no_grad():
        logits = [runner(ids[:6], torch.arange(6, device=device), cache)]
        for position in range(6, 11):
            logits.append(runner(ids[position : position + 1], torch.tensor([position], device=device), cache))
    return torch.cat(logits), expected, runner


@pytest.mark.parametrize("name", NAMES)
def test_prefill_then_decode_equals_transformers(name):
    logits, expected, runner = prefill_then_decode(name)
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    stats = runner.stats
    assert stats["traces"] == 1 and stats["graph_breaks"] == 0 and stats["capture_sizes"][0] == 1
    assert stats["pieces"] == SMALL["num_hidden_layers"] + 1


@pytest.mark.parametrize("name", NAMES)
def test_the_breakable_front_end_equals_transformers_for_one_sequence_and_for_three_through_slots(name):
    logits, expected, runner = prefill_then_decode(name, frontend="breakable")
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    runner.stats.expect(frontend="breakable", traces=0)
    got, expected, runner = decode_through_slots(name, frontend="breakable")
    for logits, reference in zip(got, expected):
        torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)


def decode_through_slots(name: str, device: str = "cpu", frontend: str = "auto"):
    """Three prompts prefilled one by one into their slots, then decoded together (one token of each per call,
    the shorter ones dropping out): ([piecewise logits per sequence], [transformers' logits per sequence], runner)."""
    model = build(name).to(device)
    generator = torch.Generator().manual_seed(2)
    sequences = [torch.randint(0, 256, (n,), generator=generator).to(device) for n in (7, 4, 9)]
    with torch.no_grad():
        expected = [model(input_ids=s[None], use_cache=False).logits[0] for s in sequences]
    token_model = TokenModel(enable(model))
    runner = piecewise.compile(token_model, piecewise.CaptureConfig(max_tokens=16, frontend=frontend))
    cache = token_model.make_kv_cache(max_seq_len=32, sequences=3)
    positions = [3, 2, 5]
    got = [[] for _ in sequences]

    def index(values):
        return torch.tensor(values, device=device)

    with torch.no_grad():
        for slot, (sequence, prompt) in enumerate(zip(sequences, positions)):
            got[slot].append(runner(sequence[:prompt], index(list(range(prompt))), cache, index([slot] * prompt)))
        while live := [slot for slot, s in enumerate(sequences) if positions[slot] < len(s)]:
            ids = torch.stack([sequences[slot][positions[slot]] for slot in live])
            out = runner(ids, index([positions[slot] for slot in live]), cache, index(live))
            for row, slot in enumerate(live):
                got[slot].append(out[row : row + 1])
                positions[slot] += 1
    return [torch.cat(logits) for logits in got], expected, runner


@pytest.mark.parametrize("name", NAMES)
def test_sequences_decoding_together_through_slots_equal_transformers(name):
    got, expected, runner = decode_through_slots(name)
    for logits, reference in zip(got, expected):
        torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)
    assert runner.stats["frontend"] == "dynamo"


@pytest.mark.parametrize("name", NAMES)
def test_nvfp4_weights_under_piecewise_equal_the_same_model_eager(name):
    """``quantize`` (NVFP4 linear layers and stacked experts, the CPU reference) on a bf16 model: piecewise's
    prefill and decode steps give exactly what the quantized model gives eagerly. (Phi-3's and GLM-4's dense
    MLPs, whose layers are named like stacked experts, were mistaken for experts: AttributeError.)"""
    from piecewise.integrations.transformers import quantize

    model = build(name).to(torch.bfloat16)
    token_model = TokenModel(enable(model))
    converted = quantize(model)
    linears = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    absorbed = [n for n, m in model.named_modules() if n.endswith(".kv_b_proj")] if uses_latent_cache(model) else []
    assert converted and linears == [*absorbed, "lm_head"], linears  # all but the head (and MLA's absorbed kv_b_proj)
    ids = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(3))
    runner = piecewise.compile(token_model, piecewise.CaptureConfig(max_tokens=16))
    assert torch.equal(logits_of_steps(runner, token_model, ids), logits_of_steps(token_model, token_model, ids))


@pytest.mark.parametrize("name,config_class,extra", [
    ("Falcon", "FalconConfig", dict(num_key_value_heads=None, head_dim=None)),
    ("Bloom", "BloomConfig", dict(num_key_value_heads=None, head_dim=None, n_head=4)),
])
def test_models_whose_attention_bypasses_the_interface_are_refused(name, config_class, extra):
    """Falcon and Bloom compute attention in their own modules: enable() refuses them (before, Falcon failed
    with a TypeError on the replaced mask, and the cache would never have been used)."""
    ARCHITECTURES[name] = (config_class, extra)
    try:
        model = build(name)
    finally:
        del ARCHITECTURES[name]
    with pytest.raises(ValueError, match=r"Attention computes attention in its own code.*ALL_ATTENTION_FUNCTIONS"):
        enable(model)
    assert model.config._attn_implementation != "piecewise"


ONES = r"builds its attention mask from a padding mask \(1, 6\).*BioGPT; OPT before transformers 5.18"


@pytest.mark.parametrize("name,config_class,extra,message", [
    ("Doge", "DogeConfig", {}, r"DogeAttention passes an attention mask of its own \(\(1, 4, 6, 6\)\)"),
    ("BioGpt", "BioGptConfig", dict(num_key_value_heads=None, head_dim=None), ONES),
    pytest.param("OPT-old", "OPTConfig", OPT["OPT"][1], ONES, marks=pytest.mark.skipif(
        OPT_PASSES_NO_MASK, reason="OPT passes no mask from transformers 5.18: run as OPT in the tests above")),
])
def test_attention_masks_the_op_cannot_apply_are_refused_at_the_call(name, config_class, extra, message):
    """Doge adds a learned mask to the scores; BioGPT (and OPT before transformers 5.18) makes a padding mask of
    ones for its positions and gives it to the mask function. Before, Doge's decode returned wrong logits without
    an error (max error 0.5)."""
    ARCHITECTURES[name] = (config_class, extra)
    try:
        with pytest.raises(ValueError, match=message):
            prefill_then_decode(name)
    finally:
        del ARCHITECTURES[name]


@pytest.mark.parametrize("name", ["OPT", "Qwen2"])
def test_a_padding_mask_is_refused_on_every_transformers_version(name):
    """Left padding given to an enabled model is refused, whatever OPT does with a missing mask: the piecewise
    attention would attend to the padding tokens, which transformers' own attention masks (checked first)."""
    model = build(name)
    ids = torch.randint(2, 256, (1, 6), generator=torch.Generator().manual_seed(4))
    padding = torch.tensor([[0, 0, 1, 1, 1, 1]])
    with torch.no_grad():
        padded = model(input_ids=ids, attention_mask=padding, use_cache=False).logits[0, -1]
        unpadded = model(input_ids=ids, use_cache=False).logits[0, -1]
    assert not torch.allclose(padded, unpadded, atol=1e-3)  # the mask matters to this model
    enable(model)
    with torch.no_grad(), pytest.raises(ValueError, match=r"builds its attention mask from a padding mask \(1, 6\)"):
        model(input_ids=ids, attention_mask=padding, use_cache=False)


def test_a_cache_of_the_wrong_head_count_is_refused_with_the_shapes():
    model = build("Qwen2")
    token_model = TokenModel(enable(model))
    cache = token_model.make_kv_cache(max_seq_len=32)
    wrong = torch.zeros(*cache.shape[:-2], cache.shape[-2] * 2, cache.shape[-1])
    with torch.no_grad(), pytest.raises(ValueError, match=r"has 2 key/value heads of width 16, the KV cache 4 of width 16"):
        token_model(torch.tensor([3, 4]), torch.arange(2), wrong)


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
def test_token_model_arguments_of_another_layout_or_dtype_are_named(frontend):
    """They ended in torch's own errors from inside the attention (index_copy_'s dtypes, an index out of bounds,
    an expand inside transformers' masks); int32 positions (numpy's) failed as indices and are taken."""
    model = build("Qwen2")
    token_model = TokenModel(enable(model))
    runner = piecewise.compile(token_model, piecewise.CaptureConfig(max_tokens=8, frontend=frontend, cache_dir=None))
    cache = token_model.make_kv_cache(max_seq_len=32)
    ids = torch.tensor([3, 4, 5, 6, 7])
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"kv_cache has dtype torch.bfloat16 and the model torch.float32"):
            runner(ids, torch.arange(5), cache.bfloat16())
        with pytest.raises(ValueError, match=r"holds 1 layers and the model has 2"):
            runner(ids, torch.arange(5), cache[:1].clone())
        with pytest.raises(ValueError, match=r"TokenModel takes flat token ids \[T\].*got \(1, 5\)"):
            runner(ids[None], torch.arange(5)[None], cache)
        reference = token_model.make_kv_cache(max_seq_len=32)
        want = token_model(ids, torch.arange(5), reference)
        torch.testing.assert_close(runner(ids, torch.arange(5, dtype=torch.int32), cache), want)
        torch.testing.assert_close(cache, reference)
