"""transformers models under piecewise on CPU: tiny random GLM-MoE and Llama configs, no downloads."""

import warnings

import pytest
import torch

import piecewise
from piecewise.errors import ForwardRefused

transformers = pytest.importorskip("transformers")
from piecewise.integrations.transformers import TokenModel, enable  # noqa: E402
from piecewise.models.glm_moe import GlmMoeConfig, route  # noqa: E402


def glm_moe(experts_implementation=None, layers=3, experts=8, dense=1):
    """A 3-layer Glm4MoeForCausalLM (1 dense + 2 MoE layers) with qk-norm, q/k/v bias, partial rotary, and
    router weights and correction bias large enough that routing varies across tokens. (Fewer ``layers``,
    ``dense`` ones and ``experts`` for Dynamo's traces of transformers' eager expert loop: each graph break in it
    traces transformers' wrappers around the layers again.)"""
    torch.manual_seed(0)
    config = transformers.Glm4MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=experts, num_experts_per_tok=2,
        n_group=2, topk_group=1, first_k_dense_replace=dense, n_shared_experts=1, partial_rotary_factor=0.5,
        use_qk_norm=True, attention_bias=True)
    model = transformers.Glm4MoeForCausalLM(config).eval()
    for module in model.modules():
        if type(module).__name__ == "Glm4MoeTopkRouter":
            torch.nn.init.normal_(module.weight, std=0.5)
            module.e_score_correction_bias.normal_()
        if hasattr(module, "gate_up_proj"):
            torch.nn.init.normal_(module.gate_up_proj, std=0.1)
            torch.nn.init.normal_(module.down_proj, std=0.1)
    if experts_implementation:
        model.config._experts_implementation = experts_implementation
    return model


def hf_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids[None], position_ids=torch.arange(len(ids))[None], use_cache=False).logits[0]


def test_glm_moe_under_piecewise_equals_transformers_eager():
    model = glm_moe()
    references = {t: hf_logits(model, torch.randint(0, 256, (t,), generator=torch.Generator().manual_seed(t)))
                  for t in (1, 5, 9, 16, 20)}
    runner = piecewise.compile(TokenModel(enable(model, experts=True)), piecewise.CaptureConfig(max_tokens=16))
    with torch.no_grad():
        for tokens, expected in references.items():
            ids = torch.randint(0, 256, (tokens,), generator=torch.Generator().manual_seed(tokens))
            torch.testing.assert_close(runner(ids, torch.arange(tokens)), expected, rtol=1e-5, atol=1e-5)
    stats = runner.stats
    assert stats["traces"] == 1 and stats["graph_breaks"] == 0
    assert stats["pieces"] == 3 + 2 + 1  # cut at 3 attentions and at the experts of the 2 MoE layers


def test_doctor_names_the_transformers_expert_loop():
    model = glm_moe(experts_implementation="eager", layers=1, experts=4, dense=0)  # one MoE layer
    report = piecewise.doctor(TokenModel(model), torch.randint(0, 256, (9,)), torch.arange(9))
    assert not report.ok
    lines = {(b.kind, b.location.code.strip()) for b in report.blockers}
    assert ("data_dependent_shape", "expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()") in lines
    assert all(b.location.file.endswith("modeling_glm4_moe.py") for b in report.blockers)
    assert all("piecewise.integrations.transformers.enable(model)" in b.fix for b in report.blockers)
    assert report.blockers[0].chain[0].function == "forward"  # TokenModel.forward first
    assert any("split=True" in b.fix for b in report.blockers)
    assert piecewise.doctor(TokenModel(enable(model)), torch.randint(0, 256, (9,)), torch.arange(9)).ok


def test_the_runtime_names_the_blockers_of_transformers_eager_expert_loop_instead_of_a_dynamo_error():
    """Unmodified (eager experts: which experts got tokens is read on the host), the model cannot run piecewise
    with Dynamo: the first call refuses, naming transformers' line, not with Dynamo's exception. (Traced with
    every guard kept, Dynamo gets past the loop and the refusal is the token rows read back to Python; a trace that
    stops there names the blockers and enable().)"""
    import warnings

    from piecewise.diagnostics import CaptureBlockedError

    runner = piecewise.compile(TokenModel(glm_moe(experts_implementation="eager", layers=1, experts=4, dense=0)),
                               piecewise.CaptureConfig(max_tokens=16, frontend="dynamo"))
    with torch.no_grad(), warnings.catch_warnings(), pytest.raises((CaptureBlockedError, ForwardRefused)) as failure:
        warnings.simplefilter("ignore")
        runner(torch.randint(0, 256, (9,)), torch.arange(9))
    message = str(failure.value)
    assert "modeling_glm4_moe.py" in message
    if isinstance(failure.value, CaptureBlockedError):
        assert "piecewise.integrations.transformers.enable(model)" in message
    else:
        assert failure.value.kind == "token_mixing" and "goes back to Python" in message


def test_glm_moe_router_matches_transformers():
    model = glm_moe()
    router = model.model.layers[1].mlp.gate
    c = model.config
    config = GlmMoeConfig(num_experts=c.n_routed_experts, top_k=c.num_experts_per_tok, n_group=c.n_group,
                          topk_group=c.topk_group, routed_scaling_factor=c.routed_scaling_factor,
                          norm_topk_prob=c.norm_topk_prob)
    x = torch.randn(13, c.hidden_size)
    with torch.no_grad():
        logits, hf_weights, hf_ids = router(x)
        weights, ids = route(logits, router.e_score_correction_bias, config)
    order, hf_order = ids.argsort(dim=1), hf_ids.argsort(dim=1)
    assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order))
    torch.testing.assert_close(weights.gather(1, order), hf_weights.gather(1, hf_order))


def test_a_dense_llama_runs_through_the_same_attention():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=1)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 128, (11,))
    expected = hf_logits(model, ids)
    runner = piecewise.compile(TokenModel(enable(model)), piecewise.CaptureConfig(max_tokens=16))
    with torch.no_grad():
        torch.testing.assert_close(runner(ids, torch.arange(11)), expected, rtol=1e-5, atol=1e-5)
    assert runner.stats["pieces"] == 3


@pytest.mark.parametrize("frontend", ["breakable", "dynamo"])
def test_a_first_call_under_autocast_equals_transformers_own_attention_under_autocast(frontend):
    """Under ``torch.autocast`` rotary leaves queries and keys in float32 and values in bfloat16; the piecewise
    attention takes them in autocast's dtype, as SDPA does (before, its op's fake disagreed with the op and the
    first call was refused, blaming piecewise's own op). A prompt and decode steps through the cache, each equal to
    transformers' SDPA attention over the whole sequence under the same autocast."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config).eval()
    model.set_attn_implementation("sdpa")
    ids = torch.randint(0, 128, (9,))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(input_ids=ids[None], use_cache=False).logits[0]
    token_model = TokenModel(enable(model))
    cache = token_model.make_kv_cache(max_seq_len=16)
    runner = piecewise.compile(token_model, piecewise.CaptureConfig(max_tokens=8, frontend=frontend, cache_dir=None))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = [runner(ids[:6], torch.arange(6), cache)]
        got += [runner(ids[p:p + 1], torch.tensor([p]), cache) for p in range(6, 9)]
    torch.testing.assert_close(torch.cat(got).float(), expected.float(), rtol=3e-2, atol=3e-2)


def test_batches_are_refused_with_the_remedy():
    model = enable(glm_moe())
    with pytest.raises(ValueError, match="one sequence .*TokenModel"):
        model(input_ids=torch.zeros(2, 4, dtype=torch.long), use_cache=False)


def test_transformers_own_cache_is_refused_with_the_remedy_not_read_wrong():
    """The piecewise attention reads TokenModel's cache only: a call with transformers' DynamicCache (its keys
    cover more positions than the queries) is refused, never attended without the causal offset."""
    model = glm_moe()
    ids = torch.randint(0, 128, (1, 9))
    enable(model)
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids[:, :8], past_key_values=cache, use_cache=True)  # the prompt: keys = queries
        with pytest.raises(ValueError, match="9 keys for 1 queries.*transformers' own cache.*TokenModel"):
            model(input_ids=ids[:, 8:], past_key_values=cache, use_cache=True)


def test_prefill_then_decode_with_a_kv_cache_equals_the_whole_sequence():
    """Prompt of 6 tokens, then 5 decode steps of one token, all through piecewise with the cache: each step's
    logits equal transformers' forward over the whole sequence at that position."""
    model = glm_moe()
    ids = torch.randint(0, 256, (11,), generator=torch.Generator().manual_seed(11))
    expected = hf_logits(model, ids)
    token_model = TokenModel(enable(model, experts=True))
    cache = token_model.make_kv_cache(max_seq_len=32)
    assert cache.shape == (3, 2, 32, 2, 16)
    runner = piecewise.compile(token_model, piecewise.CaptureConfig(max_tokens=8))
    with torch.no_grad():
        prompt = runner(ids[:6], torch.arange(6), cache)
        torch.testing.assert_close(prompt, expected[:6], rtol=1e-5, atol=1e-5)
        for position in range(6, 11):
            step = runner(ids[position : position + 1], torch.tensor([position]), cache)
            torch.testing.assert_close(step[0], expected[position], rtol=1e-5, atol=1e-5)
    assert runner.stats["traces"] == 1 and runner.stats["pieces"] == 6


def test_nvfp4_weights_compute_with_their_dequantized_values():
    """``quantize`` converts the linear layers and the stacked experts; the result equals transformers' eager
    forward of the same model holding the NVFP4 values dequantized."""
    from piecewise.integrations.transformers import quantize
    from piecewise.kernels.nvfp4 import NVFP4Linear, dequantize

    quantized, reference = enable(glm_moe()), glm_moe()
    assert quantized.config._experts_implementation == "grouped_mm"  # enable kept transformers' experts
    converted = quantize(quantized)
    assert quantized.config._experts_implementation == "piecewise"  # the only ones that run NVFP4 experts
    assert "model.layers.1.mlp.experts" in converted and "model.layers.0.self_attn.q_proj" in converted
    assert "lm_head" not in converted
    modules = dict(reference.named_modules())
    with torch.no_grad():
        for name, module in quantized.named_modules():
            if isinstance(module, NVFP4Linear):
                modules[name].weight.copy_(module.dequantized_weight(torch.float32))
            elif hasattr(module, "nvfp4"):
                for stacked in ("gate_up", "down"):
                    q = module.nvfp4
                    values = [dequantize(p, s, 1 / d, dtype=torch.float32) for p, s, d in zip(
                        getattr(q, stacked), getattr(q, f"{stacked}_scale"), getattr(q, f"{stacked}_scale_2"))]
                    getattr(modules[name], f"{stacked}_proj").copy_(torch.stack(values))
    ids = torch.randint(0, 256, (9,))
    runner = piecewise.compile(TokenModel(quantized), piecewise.CaptureConfig(max_tokens=16))
    with torch.no_grad():
        torch.testing.assert_close(runner(ids, torch.arange(9)), hf_logits(reference, ids), rtol=1e-4, atol=1e-4)


def test_enable_keeps_grouped_mm_experts_and_replaces_the_eager_loop():
    """By default, transformers' grouped_mm experts stay (captured with the pieces); its eager loop, which
    branches on which experts got tokens, becomes piecewise's experts op."""
    assert enable(glm_moe()).config._experts_implementation == "grouped_mm"
    assert enable(glm_moe(experts_implementation="eager")).config._experts_implementation == "piecewise"
    assert enable(glm_moe(experts_implementation="eager"), experts=False).config._experts_implementation == "eager"


def test_transformers_grouped_mm_experts_stay_inside_the_pieces():
    """With experts=False the model keeps transformers' grouped_mm experts (static shapes): only attention cuts."""
    model = glm_moe(experts_implementation="grouped_mm")
    ids = torch.randint(0, 256, (9,))
    expected = hf_logits(model, ids)
    runner = piecewise.compile(TokenModel(enable(model, experts=False)), piecewise.CaptureConfig(max_tokens=16))
    with torch.no_grad():
        torch.testing.assert_close(runner(ids, torch.arange(9)), expected, rtol=1e-5, atol=1e-5)
    assert model.config._experts_implementation == "grouped_mm"
    assert runner.stats["pieces"] == 3 + 1 and runner.stats["graph_breaks"] == 0


def windowed_models():
    """Mistral with a 4-token sliding window on every layer; Gemma 2 with alternating sliding (window 3) and full
    layers and attention-logit softcapping (small, so that it bends the scores)."""
    torch.manual_seed(0)
    mistral = transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=4)).eval()
    gemma = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=3, attn_logit_softcapping=0.5,
        final_logit_softcapping=None)).eval()
    assert gemma.config.layer_types == ["sliding_attention", "full_attention"]
    # Windows the model never passes to the attention, only to its mask (which piecewise does not build): Qwen2-MoE
    # sets one on its sliding layers' modules, PhiMoE keeps it in the config for every layer.
    moe = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, num_experts_per_tok=2)
    qwen2_moe = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        **moe, num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=32, use_sliding_window=True,
        sliding_window=3, max_window_layers=1)).eval()
    assert sorted(qwen2_moe.config.layer_types) == ["full_attention", "sliding_attention"]  # one of each
    phimoe = transformers.PhimoeForCausalLM(transformers.PhimoeConfig(**moe, num_local_experts=4,
                                                                      sliding_window=4)).eval()
    return {"mistral-window": mistral, "gemma2-window-softcap": gemma, "qwen2-moe-window": qwen2_moe,
            "phimoe-window": phimoe}


@pytest.mark.parametrize("name", ["mistral-window", "gemma2-window-softcap", "qwen2-moe-window", "phimoe-window"])
def test_sliding_windows_and_softcapping_equal_transformers(name):
    """Without a cache, with one sequence's cache (prefill then decode steps), and with slots: logits equal
    transformers' eager forward over the whole sequence, past the window."""
    model = windowed_models()[name]
    ids = torch.randint(0, 64, (10,), generator=torch.Generator().manual_seed(4))
    expected = hf_logits(model, ids)
    plain = hf_logits(transformers.AutoModelForCausalLM.from_config(model.config).eval(), ids)  # a different model
    token_model = TokenModel(enable(model))
    runner = piecewise.compile(token_model, piecewise.CaptureConfig(max_tokens=16))
    with torch.no_grad():
        torch.testing.assert_close(runner(ids, torch.arange(10)), expected, rtol=1e-5, atol=1e-5)
        cache = token_model.make_kv_cache(max_seq_len=16)
        torch.testing.assert_close(runner(ids[:5], torch.arange(5), cache), expected[:5], rtol=1e-5, atol=1e-5)
        for position in range(5, 10):
            step = runner(ids[position : position + 1], torch.tensor([position]), cache)
            torch.testing.assert_close(step[0], expected[position], rtol=1e-5, atol=1e-5)
        slots_cache = token_model.make_kv_cache(max_seq_len=16, sequences=2)
        out = TokenModel(model)(ids, torch.arange(10), slots_cache, torch.ones(10, dtype=torch.long))
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(plain, expected)  # sanity: the check is not trivially satisfied


def test_windows_matter_to_these_models():
    """Without its window (or softcap) each model computes other logits: the test above checks them."""
    for name, model in windowed_models().items():
        ids = torch.randint(0, 64, (10,), generator=torch.Generator().manual_seed(4))
        expected = hf_logits(model, ids)
        model.config.sliding_window = 10_000
        if name.startswith("gemma"):
            model.config.attn_logit_softcapping = None
            for layer in model.model.layers:
                layer.self_attn.attn_logit_softcapping = None
        for layer in model.model.layers:
            if getattr(layer.self_attn, "sliding_window", None):
                layer.self_attn.sliding_window = 10_000
        assert not torch.allclose(hf_logits(model, ids), expected, rtol=1e-3, atol=1e-3), name


def test_attention_the_piecewise_op_would_get_wrong_is_refused():
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1))
    llama.config.layer_types = ["chunked_attention"]
    with pytest.raises(ValueError, match=r"layer_types \['chunked_attention'\] \(full and sliding-window"):
        enable(llama)
    llama.config.layer_types = ["full_attention"]
    enable(llama)
    from piecewise.integrations.transformers import attention_forward

    q = torch.randn(1, 2, 3, 16)
    kv = torch.randn(1, 1, 3, 16)
    with pytest.raises(ValueError, match=r"attention sinks \(s_aux\)"):
        attention_forward(llama.model.layers[0].self_attn, q, kv, kv, None, s_aux=torch.zeros(2))
    ids = torch.randint(0, 64, (6,))
    with torch.no_grad(), pytest.raises(ValueError, match=r"padding mask \(1, 6\).*through .*TokenModel"):
        llama(input_ids=ids[None], attention_mask=torch.ones(1, 6, dtype=torch.long), use_cache=False)


def test_experts_of_another_activation_are_refused():
    model = enable(glm_moe(), experts=True)
    model.config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="activation 'gelu'.*experts=False"):
        with torch.no_grad():
            TokenModel(model)(torch.randint(0, 256, (4,)), torch.arange(4))


def test_grouped_nvfp4_experts_leave_only_attention_as_cuts():
    from piecewise.integrations.transformers import quantize

    model = enable(glm_moe())
    quantize(model, grouped_experts=True)
    ids = torch.randint(0, 256, (9,))
    with torch.no_grad():
        expected = TokenModel(model)(ids, torch.arange(9))
    runner = piecewise.compile(TokenModel(model), piecewise.CaptureConfig(max_tokens=16))
    with torch.no_grad():
        torch.testing.assert_close(runner(ids, torch.arange(9)), expected, rtol=1e-5, atol=1e-5)
    assert runner.stats["pieces"] == 3 + 1


def test_several_sequences_prefill_and_decode_together_through_slots():
    """Three prompts of different lengths prefilled one by one, then three decode steps with all three
    sequences in each call (a flattened batch): every token's logits equal its own sequence's whole forward."""
    model = glm_moe()
    generator = torch.Generator().manual_seed(3)
    sequences = [torch.randint(0, 256, (length + 3,), generator=generator) for length in (5, 2, 7)]
    expected = [hf_logits(model, ids) for ids in sequences]
    token_model = TokenModel(enable(model))
    cache = token_model.make_kv_cache(max_seq_len=16, sequences=3)
    assert cache.shape == (3, 2, 3, 16, 2, 16)
    runner = piecewise.compile(token_model, piecewise.CaptureConfig(max_tokens=8))
    with torch.no_grad():
        for slot, ids in enumerate(sequences):
            length = len(ids) - 3
            out = runner(ids[:length], torch.arange(length), cache, torch.full((length,), slot))
            torch.testing.assert_close(out, expected[slot][:length], rtol=1e-5, atol=1e-5)
        for step in range(3):
            positions = torch.tensor([len(ids) - 3 + step for ids in sequences])
            tokens = torch.stack([ids[p] for ids, p in zip(sequences, positions)])
            out = runner(tokens, positions, cache, torch.arange(3))
            for slot in range(3):
                torch.testing.assert_close(out[slot], expected[slot][positions[slot]], rtol=1e-5, atol=1e-5)
    assert runner.stats["traces"] == 1
    with pytest.raises(ValueError, match="multi-sequence kv_cache"):
        token_model(tokens, positions, token_model.make_kv_cache(16), torch.arange(3))


def test_continuous_batching_example_generates_what_greedy_decoding_of_each_prompt_does():
    """examples/continuous_batching.py: 7 requests through 3 slots (slots reused as requests finish, prompts of
    different lengths prefilled between decode steps) give each prompt's own greedy continuation."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from continuous_batching import generate, tiny_glm_moe

    reference = tiny_glm_moe(None)
    model = tiny_glm_moe(None)
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (length,), generator=generator) for length in (5, 17, 2, 9, 1, 12, 6)]
    token_model = TokenModel(enable(model))
    runner = piecewise.compile(token_model, piecewise.CaptureConfig(max_tokens=8))
    with torch.no_grad():
        outputs = generate(runner, token_model, prompts, new_tokens=5, slots=3, max_seq_len=24)
        for prompt, tokens in zip(prompts, outputs):
            sequence = prompt.tolist()
            for _ in range(5):
                sequence.append(int(hf_logits(reference, torch.tensor(sequence))[-1].argmax()))
            assert tokens == sequence[len(prompt):]
    assert runner.stats["traces"] == 1 and runner.stats["fallback_calls"] == 3  # prompts of 17, 9, 12 > max_tokens


def test_doctor_on_a_batch_first_call_says_how_to_call_the_model_never_capture_safe():
    model = glm_moe()
    embeds = torch.randn(1, 12, model.config.hidden_size)  # [1, T, H]: dimension 0 would be taken as the tokens
    report = piecewise.doctor(model, inputs_embeds=embeds)
    assert not report.ok and [b.kind for b in report.blockers] == ["batch_first"]
    assert "(1, 12, 64)" in report.blockers[0].message and "dynamic=" in report.blockers[0].fix
    assert "capture-safe" not in str(report)
    one_token = piecewise.doctor(torch.nn.Linear(8, 8), torch.randn(1, 8))  # a [T=1, hidden] call is tokens-first
    assert one_token.ok


def test_a_plain_transformers_model_called_batch_first_equals_eager_and_its_cache_object_is_refused():
    """``piecewise.compile(model)(input_ids [1, T])``: the ids are taken batch-first. transformers' DynamicCache in
    the output holds padded tensors in graph memory: refused at the first call, naming use_cache=False, which then
    serves the logits right at every length."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 128, (1, 11))
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=16, cache_dir=None))
    with torch.no_grad(), pytest.raises(ForwardRefused, match=r"DynamicCache.*padded rows.*use_cache=False") as info:
        runner(ids[:, :7])
    assert info.value.kind == "output_object"
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=16, cache_dir=None))
    with torch.no_grad():
        for length in (7, 11, 3, 1):
            torch.testing.assert_close(runner(ids[:, :length], use_cache=False).logits,
                                       model(ids[:, :length], use_cache=False).logits, rtol=1e-5, atol=1e-5)
    assert runner.token_arguments == {"input_ids": 1} and runner.stats["padded_calls"] >= 2


@pytest.mark.parametrize("kind", ["StaticCache", "DynamicCache"])
def test_transformers_own_cache_is_refused_naming_piecewises_cache_and_left_as_it_was(kind):
    """transformers' recommended fast path called through piecewise (a StaticCache, cache_position; or a
    DynamicCache): the forward updates the cache object from its own value and reads every cache row, so the first
    call is refused, and the refusal says how piecewise serves a KV cache. The caller's cache is put back as it was:
    the first call's runs had left a DynamicCache three prefills long and a StaticCache full of inference tensors
    that the next eager call could not write."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config).eval()
    make = (lambda: transformers.StaticCache(config=config, max_cache_len=32)) if kind == "StaticCache" else \
        (lambda: transformers.DynamicCache(config=config))
    cache, fresh = make(), make()
    ids = torch.randint(0, 128, (1, 7))
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=16, cache_dir=None))
    with torch.no_grad():
        refusal = rf"past_key_values={kind} is transformers' own KV cache.*piecewise.generate"
        with warnings.catch_warnings(record=True) as caught, pytest.raises(ForwardRefused, match=refusal) as info:
            warnings.simplefilter("always")
            runner(ids, past_key_values=cache, cache_position=torch.arange(7), use_cache=True)
        # refused before any run: no retrace per run of a growing DynamicCache, each with its warning
        assert info.value.kind == "transformers_cache" and not [w for w in caught if "traced again" in str(w.message)]
        assert cache.get_seq_length() == 0
        logits = [model(ids, past_key_values=c, cache_position=torch.arange(7)).logits for c in (cache, fresh)]
        steps = [model(torch.tensor([[5]]), past_key_values=c, cache_position=torch.tensor([7])).logits
                 for c in (cache, fresh)]
    torch.testing.assert_close(logits[0], logits[1])
    torch.testing.assert_close(steps[0], steps[1])


def test_a_cache_subclass_is_refused_and_a_cache_given_after_the_first_call_runs_the_models_own_forward():
    """Any transformers cache class (here a user's subclass of DynamicCache) is refused at a first call; once a
    first call without one has run, a call given one differs from it in an argument: the model's own forward serves
    it, with a warning, and the cache is filled as an eager call fills it."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config).eval()

    class MyCache(transformers.DynamicCache):
        pass

    ids = torch.randint(0, 128, (1, 7))
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=16, cache_dir=None))
    with torch.no_grad():
        with pytest.raises(ForwardRefused, match="past_key_values=MyCache is transformers' own KV cache") as info:
            runner(ids, past_key_values=MyCache(config=config), use_cache=True)
        assert info.value.kind == "transformers_cache"
        torch.testing.assert_close(runner(ids, use_cache=False).logits, model(ids, use_cache=False).logits)
        mine, eager = MyCache(config=config), MyCache(config=config)
        with pytest.warns(UserWarning, match="past_key_values"):
            out = runner(ids, past_key_values=mine, use_cache=True).logits
        torch.testing.assert_close(out, model(ids, past_key_values=eager, use_cache=True).logits)
    assert mine.get_seq_length() == eager.get_seq_length() == 7 and runner.stats["eager_calls"] == 1


def test_transformers_own_output_capturing_hooks_are_not_named():
    """transformers adds hooks to collect hidden states on the first call that asks for them; they only feed the
    output, which piecewise cuts and copies: no hook warning."""
    import warnings

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 128, (1, 7))
    with torch.no_grad():
        model(ids, output_hidden_states=True)
        runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=16, cache_dir=None))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = runner(ids, use_cache=False)
    assert not [w for w in caught if "forward hooks" in str(w.message)]
    torch.testing.assert_close(out.logits, model(ids, use_cache=False).logits, rtol=1e-5, atol=1e-5)


def test_a_config_flag_flipped_after_the_first_call_that_dynamo_cannot_retrace_runs_the_models_own_forward():
    """``config.output_hidden_states = True`` after the first call: Dynamo's retrace meets transformers' output
    capture (a lock it cannot enter). Before, Dynamo's raw ``Unsupported`` on every later call."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).eval()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend="dynamo"))
    with torch.no_grad():
        runner(torch.randint(0, 64, (1, 5)), use_cache=False)
        model.config.output_hidden_states = True
        ids = torch.randint(0, 64, (1, 3))
        with pytest.warns(UserWarning, match="traced again after the first call"):
            got = runner(ids, use_cache=False)
        want = model(ids, use_cache=False)
    assert len(got.hidden_states) == len(want.hidden_states) == 3
    torch.testing.assert_close(got.logits, want.logits)


def test_an_attention_mask_first_given_at_a_one_token_call_follows_the_ids_batch_first_layout():
    """Before, the [1, 1] mask was taken as tokens-first for good: the next [1, 4] call was refused with a wrong
    dynamic= to pass."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).eval()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the mask's first appearance: the model's own forward, warned
        runner(torch.randint(0, 64, (1, 5)), use_cache=False)
        for tokens in (1, 4, 3):
            ids = torch.randint(0, 64, (1, tokens))
            got = runner(ids, attention_mask=torch.ones_like(ids), use_cache=False)
            want = model(ids, attention_mask=torch.ones_like(ids), use_cache=False)
            torch.testing.assert_close(got.logits, want.logits)
