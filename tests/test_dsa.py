"""GLM-5 (``glm_moe_dsa``) and DeepSeek-V3.2 (``deepseek_v32``): DeepSeek sparse attention under piecewise equals
transformers' eager forward — prefill then decode steps, three sequences through slots, no cache — and the
indexer picks the same keys as transformers' at every step. Top-k (4) is smaller than the context (11), so the
selection matters. The indexer has 16 heads: with few heads relu makes many index scores exactly 0, and top-k
over ties is not even stable in transformers itself (its cached decode then differs from its whole-sequence
forward)."""

from __future__ import annotations

import pytest
import torch

import piecewise

transformers = pytest.importorskip("transformers")
from piecewise.integrations.transformers import TokenModel, enable  # noqa: E402
from test_transformers_zoo import logits_of_steps  # noqa: E402

ARCHITECTURES = {"GlmMoeDsa": "GlmMoeDsaConfig", "DeepseekV32": "DeepseekV32Config"}
SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
             qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
             first_k_dense_replace=1, n_shared_experts=1, index_n_heads=16, index_head_dim=16, index_topk=4)


def build(name: str, seed: int = 0):
    if not hasattr(transformers, ARCHITECTURES[name]):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    config_class = getattr(transformers, ARCHITECTURES[name])
    torch.manual_seed(seed)
    config = config_class(**SMALL)
    model = getattr(transformers, f"{name}ForCausalLM")(config).eval()
    return model


def indexers(model):
    return [layer.self_attn.indexer for layer in model.model.layers if layer.self_attn.indexer is not None]


def selections(model, run) -> list[list[set]]:
    """Per indexer, the keys each query row picked during ``run()`` among those at or before its position (the
    other picks point at keys the attention masks out). Rows are numbered by position."""
    picked = [[] for _ in indexers(model)]

    def hook(index, module, args, kwargs, out):
        positions = (kwargs.get("position_ids") if "position_ids" in kwargs else args[4])[0].tolist()
        picked[index].extend({key for key in row.tolist() if key <= position}
                             for row, position in zip(out[0], positions))

    hooks = [indexer.register_forward_hook(lambda m, a, kw, out, i=i: hook(i, m, a, kw, out), with_kwargs=True)
             for i, indexer in enumerate(indexers(model))]
    try:
        with torch.no_grad():
            run()
    finally:
        for hook in hooks:
            hook.remove()
    return picked


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_prefill_then_decode_equals_transformers_and_the_indexer_picks_the_same_keys(name, frontend):
    model = build(name)
    ids = torch.randint(0, 256, (11,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(input_ids=ids[None], use_cache=False).logits[0]
    theirs = selections(model, lambda: model(input_ids=ids[None], use_cache=False))
    token_model = TokenModel(enable(model))
    cache = token_model.make_kv_cache(max_seq_len=32)
    runner = piecewise.compile(token_model, piecewise.CaptureConfig(max_tokens=16, frontend=frontend))
    logits = []

    def run():
        logits.append(runner(ids[:6], torch.arange(6), cache))
        for position in range(6, 11):
            logits.append(runner(ids[position : position + 1], torch.tensor([position]), cache))

    run()
    torch.testing.assert_close(torch.cat(logits), expected, rtol=1e-5, atol=1e-5)
    assert runner.stats["frontend"] == frontend
    cache.zero_()  # the same steps through the enabled model, unpadded: the indexer picks transformers' keys

    def steps():
        token_model(ids[:6], torch.arange(6), cache)
        for position in range(6, 11):
            token_model(ids[position : position + 1], torch.tensor([position]), cache)

    assert selections(model, steps) == theirs, "the indexer's top-k differs from transformers'"


@pytest.mark.parametrize("chunk", [None, 2], ids=["whole", "chunks-of-2"])
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_three_sequences_through_slots_and_no_cache_equal_transformers(name, chunk, monkeypatch):
    """``chunk``: both DSA ops split their tokens into runs of 2 (what bounds a long prefill's memory)."""
    from piecewise.integrations import dsa

    if chunk:
        by_budget = dsa._chunks
        runs = []
        monkeypatch.setattr(dsa, "_chunks", lambda tokens, per_token: runs.append(
            by_budget(tokens, per_token, chunk * per_token)) or runs[-1])
    model = build(name, seed=2)
    generator = torch.Generator().manual_seed(3)
    sequences = [torch.randint(0, 256, (n,), generator=generator) for n in (7, 5, 9)]
    with torch.no_grad():
        expected = [model(input_ids=s[None], use_cache=False).logits[0] for s in sequences]
    token_model = TokenModel(enable(model))
    cache = token_model.make_kv_cache(max_seq_len=32, sequences=3)
    runner = piecewise.compile(token_model, piecewise.CaptureConfig(max_tokens=16))
    got = [[] for _ in sequences]
    positions = [4, 3, 5]
    with torch.no_grad():
        for slot, (sequence, prompt) in enumerate(zip(sequences, positions)):
            got[slot].append(runner(sequence[:prompt], torch.arange(prompt), cache, torch.full((prompt,), slot)))
        while live := [slot for slot, s in enumerate(sequences) if positions[slot] < len(s)]:
            ids = torch.stack([sequences[slot][positions[slot]] for slot in live])
            out = runner(ids, torch.tensor([positions[slot] for slot in live]), cache, torch.tensor(live))
            for row, slot in enumerate(live):
                got[slot].append(out[row : row + 1])
                positions[slot] += 1
        no_cache = piecewise.compile(token_model, piecewise.CaptureConfig(max_tokens=16))
        whole = no_cache(sequences[2], torch.arange(9))
    for logits, reference in zip(got, expected):
        torch.testing.assert_close(torch.cat(logits), reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(whole, expected[2], rtol=1e-5, atol=1e-5)
    assert not chunk or max(len(r) for r in runs) >= 5  # the 9-token call (padded or not) ran in 5 runs or more


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_an_enabled_model_called_as_transformers_runs_it_keeps_transformers_selection(name):
    """After ``enable``, called the transformers way (batch-first, use_cache left on): one sequence of 3 tokens
    (fewer than the 4 picks) and of 11 equals transformers under piecewise's attention; with the model's own
    attention put back, a batch of several sequences and decode with transformers' own cache do too (the indexer
    then runs the model's code)."""
    model = build(name)
    ids = torch.randint(0, 256, (3, 11), generator=torch.Generator().manual_seed(5))
    own = model.config._attn_implementation
    with torch.no_grad():
        expected = model(input_ids=ids, use_cache=False).logits
        single = [model(input_ids=ids[:1, :n]).logits for n in (3, 11)]
        cache = transformers.DynamicCache(config=model.config)
        model(input_ids=ids[:, :10], past_key_values=cache, use_cache=True)
        expected_step = model(input_ids=ids[:, 10:], past_key_values=cache, use_cache=True).logits
        enable(model)
        for n, want in zip((3, 11), single):  # piecewise's attention, a DynamicCache made by transformers
            torch.testing.assert_close(model(input_ids=ids[:1, :n]).logits, want, rtol=1e-5, atol=1e-5)
        model.config._attn_implementation = own
        torch.testing.assert_close(model(input_ids=ids, use_cache=False).logits, expected, rtol=0, atol=0)
        for n, want in zip((3, 11), single):
            torch.testing.assert_close(model(input_ids=ids[:1, :n]).logits, want, rtol=0, atol=0)
        cache = transformers.DynamicCache(config=model.config)
        model(input_ids=ids[:, :10], past_key_values=cache, use_cache=True)
        step = model(input_ids=ids[:, 10:], past_key_values=cache, use_cache=True).logits
    torch.testing.assert_close(step, expected_step, rtol=0, atol=0)


@pytest.mark.parametrize("frontend", ["auto", "breakable"])
def test_full_graph_calls_write_both_caches_at_the_real_rows_only(frontend):
    """Decode of 3 sequences padded to a 4-token full graph, beside a fourth sequence, on caches full of noise:
    the KV cache and the indexer key caches change exactly at the real tokens' (slot, position) entries, to what
    the eager calls write (a pad row writing at its own slot and position would show)."""
    model = build("GlmMoeDsa", seed=4)
    token_model = TokenModel(enable(model))
    generator = torch.Generator().manual_seed(6)
    prompts = torch.randint(0, 256, (4, 6), generator=generator)
    steps = torch.randint(0, 256, (3, 3), generator=generator)
    runner = piecewise.compile(token_model, piecewise.CaptureConfig(max_tokens=8, frontend=frontend))
    written = torch.zeros(4, 16, dtype=torch.bool)
    written[:, :6] = True
    written[:3, 6:9] = True
    caches = {}
    for key, call in (("eager", token_model), ("piecewise", runner)):
        torch.manual_seed(7)
        cache = token_model.make_kv_cache(max_seq_len=16, sequences=4).normal_()
        index = [b for n, b in token_model.named_buffers() if n.endswith("index_cache")]
        for buffer in index:
            buffer.normal_()
        before = [cache.clone()] + [buffer.clone() for buffer in index]
        with torch.no_grad():
            for slot in range(4):
                call(prompts[slot], torch.arange(6), cache, torch.full((6,), slot))
            for step in range(3):  # sequences 0-2 decode; 3 stays
                call(steps[:, step], torch.full((3,), 6 + step), cache, torch.arange(3))
        after = [cache.clone()] + [buffer.clone() for buffer in index]
        changed = [(a != b).flatten(3 if i == 0 else 2).any(-1) for i, (a, b) in enumerate(zip(after, before))]
        assert (changed[0] == written).all(), f"{key}: the latent cache changed where no real token is"
        for rows in changed[1:]:
            assert (rows == written).all(), f"{key}: an indexer key cache changed where no real token is"
        caches[key] = after
    assert runner.stats["full_calls"] == 7 and 4 in runner.stats["full_sizes"]
    assert len(caches["eager"]) == 4  # the KV cache and three indexers
    for got, want in zip(caches["piecewise"], caches["eager"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["grad", "no_grad", "inference_mode"])
@pytest.mark.parametrize("frontend", ["auto", "breakable"])
def test_every_call_size_up_to_max_tokens_plus_one_equals_eager_with_both_caches(frontend, mode):
    """Calls of 1..9 tokens (max_tokens 8: full graphs, piecewise sizes, one call above them), each its own
    sequences' next tokens through slots, from the same caches as an eager call: outputs, the KV cache and the
    indexer key caches equal the eager call's, under each grad mode."""
    model = build("GlmMoeDsa", seed=8)
    token_model = TokenModel(enable(model))
    cache = token_model.make_kv_cache(max_seq_len=24, sequences=9)
    index = [b for n, b in token_model.named_buffers() if n.endswith("index_cache")]
    generator = torch.Generator().manual_seed(9)
    with torch.no_grad():  # a prompt of 5 tokens in every slot
        for slot in range(9):
            token_model(torch.randint(0, 256, (5,), generator=generator), torch.arange(5), cache,
                        torch.full((5,), slot))
    runner = piecewise.compile(token_model, piecewise.CaptureConfig(max_tokens=8, max_decode_batch=4,
                                                                    frontend=frontend))
    grad = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[mode]
    for tokens in (5, *range(1, 10)):
        ids = torch.randint(0, 256, (tokens,), generator=generator)
        slots = torch.randperm(9, generator=generator)[:tokens]
        positions = torch.randint(5, 24, (tokens,), generator=generator)
        state = [cache.clone()] + [buffer.clone() for buffer in index]
        with torch.no_grad():
            expected = token_model(ids, positions, cache, slots)
        after = [cache.clone()] + [buffer.clone() for buffer in index]
        for live, saved in zip([cache, *index], state):
            live.copy_(saved)
        with grad():
            out = runner(ids, positions, cache, slots)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5, msg=f"{tokens} tokens")
        for live, want in zip([cache, *index], after):
            torch.testing.assert_close(live, want, rtol=1e-5, atol=1e-5, msg=f"{tokens} tokens: a cache")
    stats = runner.stats
    assert stats["full_calls"] > 0 and stats["padded_calls"] > 0 and stats["fallback_calls"] > 0, dict(stats)


def test_a_cache_made_after_the_first_call_names_the_fix():
    model = build("GlmMoeDsa")
    token_model = TokenModel(enable(model))
    with torch.no_grad(), pytest.raises(ValueError, match="indexer key cache is missing.*make_kv_cache"):
        token_model(torch.randint(0, 256, (3,)), torch.arange(3), torch.zeros(3, 32, 24))  # the latent cache alone


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_nvfp4_weights_under_piecewise_equal_the_same_model_eager(name):
    """``quantize``: NVFP4 linear layers (the indexer's too) and grouped experts; piecewise's prefill and decode
    give exactly what the quantized model gives eagerly (the CPU reference)."""
    from piecewise.integrations.transformers import quantize

    model = build(name).to(torch.bfloat16)
    token_model = TokenModel(enable(model))
    converted = quantize(model)
    absorbed = [n for n, m in model.named_modules() if n.endswith(".kv_b_proj")]  # latent cache: read as weights
    assert [n for n, m in model.named_modules() if type(m) is torch.nn.Linear] == [*absorbed, "lm_head"]
    assert any("indexer" in n for n in converted) and len(absorbed) == SMALL["num_hidden_layers"]
    seen = []  # the indexer's head weights take the hidden states as they are (its NVFP4 weight is packed codes)
    hooks = [indexer.weights_proj.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
             for indexer in indexers(model)]
    ids = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(3))
    runner = piecewise.compile(token_model, piecewise.CaptureConfig(max_tokens=16))
    eager = logits_of_steps(token_model, token_model, ids)
    for hook in hooks:  # eager only: a hook appending to a list is a guard Dynamo retraces on
        hook.remove()
    assert torch.equal(logits_of_steps(runner, token_model, ids), eager)
    assert runner.stats["full_calls"] == 5, "DSA is capturable: every call of up to 16 tokens is a full-graph call"
    assert runner.stats["frontend"] == "dynamo" and runner.stats["full_sizes"] == [1, 2, 4, 8, 16]
    assert seen and set(seen) == {torch.bfloat16}, set(seen)


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_a_quantized_model_saved_in_modelopts_format_and_loaded_from_the_meta_device_gives_the_same_logits(
        name, tmp_path):
    """GLM-5's and DeepSeek-V3.2's layer names (the indexer's linear layers, the routed and shared experts) through
    ``save_modelopt_nvfp4`` and ``load_modelopt_nvfp4``."""
    from piecewise.integrations.modelopt import load_modelopt_nvfp4, save_modelopt_nvfp4
    from piecewise.integrations.transformers import quantize

    model = build(name)
    quantize(enable(model))
    save_modelopt_nvfp4(model, tmp_path)
    with torch.device("meta"):
        loaded = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp_path)).eval()
    converted = load_modelopt_nvfp4(loaded, tmp_path)
    assert any("indexer" in n for n in converted) and any("experts" in n for n in converted)
    ids = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(6))
    token, loaded_token = TokenModel(model), TokenModel(enable(loaded))
    with torch.no_grad():
        assert torch.equal(loaded_token(ids, torch.arange(9)), token(ids, torch.arange(9)))
