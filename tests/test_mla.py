"""MLA models over the latent cache (``integrations.mla``), on CPU: every transformers MLA architecture piecewise
gives the latent path equals transformers' forward — a prefill, decode steps, and sequences through slots in one
call — with a cache of ``kv_lora_rank + qk_rope_head_dim`` values per token and layer; an architecture outside
``LATENT_CLASSES`` keeps the per-head cache and is right too; a change of ``kv_b_proj``'s weights after the first
call is seen. (GLM-5 and DeepSeek-V3.2, whose DSA indexer picks the keys, are in test_dsa.py; DeepSeek-V3 also in
test_transformers_zoo.py.)"""

from __future__ import annotations

import pytest
import torch

import piecewise

transformers = pytest.importorskip("transformers")
from piecewise.integrations import mla  # noqa: E402
from piecewise.integrations.transformers import TokenModel, enable  # noqa: E402
from test_transformers_zoo import init_stacked_experts  # noqa: E402

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
             qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
             first_k_dense_replace=1, n_shared_experts=1, max_position_embeddings=256)
LATENT = ["DeepseekV3", "Glm4MoeLite", "Mistral4", "Youtu", "MiniCPM3"]
PER_HEAD = ["DeepseekV2"]  # rotary through complex numbers (freqs_cis): not a class latent_forward reproduces


def build(name: str, seed: int = 0, **changes):
    config_class = getattr(transformers, f"{name}Config", None)
    if config_class is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    known = config_class().to_dict()
    values = {k: v for k, v in {**SMALL, **changes}.items() if k in known}
    torch.manual_seed(seed)
    return init_stacked_experts(getattr(transformers, f"{name}ForCausalLM")(config_class(**values)).eval())


def run_steps(runner, sequences: list[torch.Tensor], cache: torch.Tensor, prompt: int) -> list[torch.Tensor]:
    """Each sequence's first ``prompt`` tokens prefilled into its slot (all in one call), then every sequence
    decoding one token per call together: each sequence's logits, in order."""
    device = sequences[0].device
    slots = torch.cat([torch.full((prompt,), s, device=device) for s in range(len(sequences))])
    first = runner(torch.cat([s[:prompt] for s in sequences]), torch.arange(prompt, device=device).repeat(
        len(sequences)), cache, slots)
    got = [[first[s * prompt : (s + 1) * prompt]] for s in range(len(sequences))]
    for position in range(prompt, len(sequences[0])):
        out = runner(torch.stack([s[position] for s in sequences]), torch.full((len(sequences),), position,
                     device=device), cache, torch.arange(len(sequences), device=device))
        for s in range(len(sequences)):
            got[s].append(out[s : s + 1])
    return [torch.cat(g) for g in got]


@pytest.mark.parametrize("name", LATENT + PER_HEAD)
def test_mla_architectures_equal_transformers_through_slots_with_the_cache_they_need(name):
    model = build(name)
    generator = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, 256, (9,), generator=generator) for _ in range(3)]
    with torch.no_grad():
        expected = [model(input_ids=s[None], use_cache=False).logits[0] for s in sequences]
    token_model = TokenModel(enable(model))
    c = model.config
    assert mla.uses_latent_cache(model) == (name in LATENT)
    cache = token_model.make_kv_cache(max_seq_len=16, sequences=3)
    if name in LATENT:  # one row of latent and rotated key per token and layer
        assert cache.shape == (c.num_hidden_layers, 3, 16, c.kv_lora_rank + c.qk_rope_head_dim)
        assert token_model.kv_bytes_per_token() == c.num_hidden_layers * (c.kv_lora_rank + c.qk_rope_head_dim) * 4
    else:
        assert cache.shape[:3] == (c.num_hidden_layers, 2, 3)
    runner = piecewise.compile(token_model, piecewise.CaptureConfig(max_tokens=16))
    with torch.no_grad():
        got = run_steps(runner, sequences, cache, prompt=5)
    for logits, want in zip(got, expected):
        torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    if name in LATENT:
        assert runner.stats["frontend"] == "dynamo" and runner.stats["graph_breaks"] == 0
        assert runner.stats["splitting_op_calls"] == c.num_hidden_layers  # one mla_attention per layer
        with torch.no_grad():  # without a cache: transformers' own MLA forward with piecewise's attention
            whole = piecewise.compile(token_model, piecewise.CaptureConfig(max_tokens=16))(sequences[0],
                                                                                           torch.arange(9))
        torch.testing.assert_close(whole, expected[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
def test_the_latent_cache_holds_the_normalised_latent_and_rotated_key_of_each_real_token(frontend):
    """The cache rows a prefill and a decode step write are transformers' own ``kv_a_layernorm(c)`` and rotated
    ``k_pe`` (read from transformers' DynamicCache, which holds exactly these in 5.18 and later, or computed from
    the module), at the tokens' positions; nothing else changes."""
    model = build("DeepseekV3", seed=3)
    ids = torch.randint(0, 256, (7,), generator=torch.Generator().manual_seed(4))
    captured = {}

    def latent_hook(module, args, out, layer):  # kv_a_layernorm's output: the normalised latent
        captured.setdefault(layer, []).append(out.detach().reshape(-1, out.shape[-1]))

    attention = [layer.self_attn for layer in model.model.layers]
    hooks = [a.kv_a_layernorm.register_forward_hook(lambda m, a_, o, i=i: latent_hook(m, a_, o, i))
             for i, a in enumerate(attention)]
    with torch.no_grad():
        model(input_ids=ids[None], use_cache=False)
    for hook in hooks:
        hook.remove()
    token_model = TokenModel(enable(model))
    cache = token_model.make_kv_cache(max_seq_len=12).normal_()
    before = cache.clone()
    runner = piecewise.compile(token_model, piecewise.CaptureConfig(max_tokens=8, frontend=frontend))
    with torch.no_grad():
        runner(ids[:6], torch.arange(6), cache)
        runner(ids[6:], torch.tensor([6]), cache)
    r = model.config.kv_lora_rank
    for layer in range(model.config.num_hidden_layers):
        torch.testing.assert_close(cache[layer, :7, :r], captured[layer][0], rtol=1e-5, atol=1e-5)
    assert torch.equal(cache[:, 7:], before[:, 7:]), "rows past the tokens changed"


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
def test_kv_b_proj_weights_changed_after_the_first_call_are_used(frontend):
    """W_UK and W_UV are views of ``kv_b_proj``'s weight read in the pieces: ``copy_`` and ``.data =`` after the
    first call both reach the replays."""
    model = build("Glm4MoeLite", seed=5)
    token_model = TokenModel(enable(model))
    runner = piecewise.compile(token_model, piecewise.CaptureConfig(max_tokens=8, frontend=frontend))
    ids = torch.randint(0, 256, (6,), generator=torch.Generator().manual_seed(6))
    cache = token_model.make_kv_cache(max_seq_len=8)
    with torch.no_grad():
        runner(ids, torch.arange(6), cache)
        kv_b = model.model.layers[0].self_attn.kv_b_proj
        kv_b.weight.mul_(1.5)
        model.model.layers[1].self_attn.kv_b_proj.weight.data = torch.randn_like(kv_b.weight) * 0.1
        got = runner(ids, torch.arange(6), cache)
        expected = model(input_ids=ids[None], use_cache=False).logits[0]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_a_cache_of_the_other_layout_is_refused_with_the_fix():
    model = build("DeepseekV3")
    token_model = TokenModel(enable(model))
    per_head = torch.zeros(2, 2, 16, 4, 24)
    with pytest.raises(ValueError, match=r"kv_cache \(2, 2, 16, 4, 24\) is not what this model takes: a latent cache"):
        token_model(torch.tensor([1, 2]), torch.arange(2), per_head)
    with pytest.raises(ValueError, match=r"slots need a multi-sequence kv_cache .*make_kv_cache\(max_seq_len, sequences"):
        token_model(torch.tensor([1, 2]), torch.arange(2), token_model.make_kv_cache(16), torch.tensor([0, 0]))
    enable(model, latent_cache=False)  # the per-head cache, as before: the latent one is refused now
    with pytest.raises(ValueError, match=r"kv_cache \(2, 16, 24\) is not what this model takes: a cache \[layers, 2"):
        token_model(torch.tensor([1, 2]), torch.arange(2), torch.zeros(2, 16, 24))


@pytest.mark.parametrize("name", ["DeepseekV3", "MiniCPM3"])
def test_long_dense_calls_up_project_the_latent_rows_and_equal_transformers(name, monkeypatch):
    """With ``UP_PROJECT_TOKENS`` at 3, prefills of three sequences in one call (from position 0: causal SDPA) and
    an extend of four tokens after them (a mask by position) take the up-projected path; decode steps the latent
    one. Every call equals transformers."""
    monkeypatch.setattr(mla, "UP_PROJECT_TOKENS", 3)
    taken = []
    up_projected = mla.up_projected_attention
    monkeypatch.setattr(mla, "up_projected_attention", lambda *a: taken.append(a[0].shape[0]) or up_projected(*a))
    model = build(name, seed=7)
    generator = torch.Generator().manual_seed(8)
    sequences = [torch.randint(0, 256, (11,), generator=generator) for _ in range(3)]
    with torch.no_grad():
        expected = [model(input_ids=s[None], use_cache=False).logits[0] for s in sequences]
        token_model = TokenModel(enable(model))
        cache = token_model.make_kv_cache(max_seq_len=16, sequences=3)
        got = run_steps(token_model, sequences, cache, prompt=5)  # 15-token prefill, then 3-token decode steps
        extend = token_model(sequences[0][5:9], torch.arange(5, 9), cache, torch.zeros(4, dtype=torch.long))
    for logits, want in zip(got, expected):
        torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(extend, expected[0][5:9], rtol=1e-4, atol=1e-4)
    assert taken == [15] * model.config.num_hidden_layers + [4] * model.config.num_hidden_layers


def test_plan_lengths_are_few_per_octave_and_at_least_the_length():
    lengths = [mla.plan_length(n) for n in range(1, 20000)]
    assert all(p >= n for n, p in zip(range(1, 20000), lengths))
    assert all(p - n <= max(63, n // 16) for n, p in zip(range(1, 20000), lengths))
    assert len({p for p in lengths if 1024 < p <= 2048}) == 16 and len({p for p in lengths if 4096 < p <= 8192}) == 16


@pytest.mark.parametrize("chunk", [4096, 7])
def test_up_projected_prefill_padded_to_plan_lengths_equals_it_unpadded(chunk, monkeypatch):
    """Where SDPA would build a cuDNN plan per shape, the up-projected prefill pads its keys (zero latent rows) and
    queries to ``plan_length``: the whole sequence from position 0 (causal), a continuation over earlier rows and
    queries in chunks (masked: ``QUERY_CHUNK`` at 7), three sequences in one call; the real rows are as unpadded."""
    torch.manual_seed(0)
    heads, nope, rope, latent, width = 4, 16, 8, 32, 16
    cache = torch.randn(3, 160, latent + rope)
    w_uk, w_uv = torch.randn(heads, nope, latent) / 6, torch.randn(heads, width, latent) / 6
    # sequence 1 ends at 127, whose key length (128) is a plan length already: its 28 queries are padded still
    slots = torch.cat([torch.zeros(70, dtype=torch.long), torch.ones(28, dtype=torch.long), torch.full((9,), 2)])
    positions = torch.cat([torch.arange(70), torch.arange(100, 128), torch.tensor([3, 40, 41, 42, 60, 61, 62, 63, 64])])
    q_nope, q_rope = torch.randn(len(slots), heads, nope), torch.randn(len(slots), heads, rope)
    monkeypatch.setattr(mla, "QUERY_CHUNK", chunk)
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(mla.F, "scaled_dot_product_attention", lambda q, k, v, **kw: seen.append(
        (q.shape[2], k.shape[2])) or sdpa(q, k, v, **kw))

    def run(pads):
        monkeypatch.setattr(mla, "pads_for_plans", lambda tensor: pads)
        seen.clear()
        return mla.up_projected_attention(q_nope, q_rope, cache, slots, positions, 0.3, w_uk, w_uv), list(seen)

    (plain, shapes), (padded, padded_shapes) = run(False), run(True)
    torch.testing.assert_close(padded, plain, rtol=1e-5, atol=1e-5)
    assert len(padded_shapes) == len(shapes) == (3 if chunk == 4096 else 10 + 4 + 2)
    assert all(k == mla.plan_length(n) and q == (k if q0 == n else mla.plan_length(q0))
               for (q, k), (q0, n) in zip(padded_shapes, shapes)), (padded_shapes, shapes)
    assert any(k > n for (_, k), (_, n) in zip(padded_shapes, shapes)), "nothing was padded: nothing was tested"


def test_a_long_dsa_call_whose_queries_pick_every_earlier_key_takes_the_dense_path(monkeypatch):
    """GLM-5 with 4 picks and ``UP_PROJECT_TOKENS`` at 2: a 4-token prefill (no query has more than 4 earlier keys:
    each picks them all) is dense attention and up-projects; an 11-token prefill attends over the picks in the
    latent space. Both equal transformers."""
    import test_dsa

    monkeypatch.setattr(mla, "UP_PROJECT_TOKENS", 2)
    taken = []
    up_projected = mla.up_projected_attention
    monkeypatch.setattr(mla, "up_projected_attention", lambda *a: taken.append(a[0].shape[0]) or up_projected(*a))
    model = test_dsa.build("GlmMoeDsa", seed=9)
    ids = torch.randint(0, 256, (11,), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        expected = model(input_ids=ids[None], use_cache=False).logits[0]
        token_model = TokenModel(enable(model))
        for length in (4, 11):
            got = token_model(ids[:length], torch.arange(length), token_model.make_kv_cache(max_seq_len=16))
            torch.testing.assert_close(got, expected[:length], rtol=1e-4, atol=1e-4)
    assert taken == [4] * model.config.num_hidden_layers


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "picks"])
@pytest.mark.parametrize("tokens", [3, 5])
def test_the_ops_fake_matches_what_it_returns_shapes_and_strides(tokens, sparse, monkeypatch):
    """``torch.library.opcheck`` of ``mla_attention`` (latent and, with ``UP_PROJECT_TOKENS`` at 4, up-projected):
    Inductor compares a custom op's output with its fake's, strides included (a transposed output made the full
    graph of an inductor runner fail)."""
    monkeypatch.setattr(mla, "UP_PROJECT_TOKENS", 4)
    g = torch.Generator().manual_seed(11)
    heads, nope, rope, latent, v = 4, 8, 4, 16, 12
    args = (torch.randn(tokens, heads, nope, generator=g), torch.randn(tokens, heads, rope, generator=g),
            torch.randn(tokens, latent, generator=g), torch.randn(tokens, rope, generator=g), torch.arange(tokens),
            None, torch.zeros(2, 8, latent + rope), 1, 0.3,
            torch.randint(0, 8, (tokens, 4), generator=g) if sparse else None,
            torch.randn(heads * (nope + v), latent, generator=g))
    torch.library.opcheck(mla.mla_attention, args, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("name", ["DeepseekV3", "GlmMoeDsa", "Qwen3"])
def test_a_cache_too_short_for_the_positions_is_named_with_max_seq_len(name):
    """Through ``TokenModel``: the latent cache, the indexer's key cache and the per-head cache (slots)."""
    import test_dsa

    if name == "Qwen3":
        config = transformers.Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16)
        model = transformers.Qwen3ForCausalLM(config).eval()
    else:
        model = test_dsa.build(name) if name == "GlmMoeDsa" else build(name)
    token_model = TokenModel(enable(model))
    cache = token_model.make_kv_cache(max_seq_len=8, sequences=2)
    with torch.no_grad(), pytest.raises(ValueError, match=r"position 9 is past the KV cache, whose max_seq_len is 8 "
                                                          r".*make_kv_cache\(max_seq_len=10\)"):
        token_model(torch.tensor([1, 2, 3]), torch.tensor([7, 8, 9]), cache, torch.tensor([0, 0, 1]))


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
@pytest.mark.parametrize("name", ["DeepseekV3", "GlmMoeDsa"])
def test_verify_passes_at_every_size_over_the_latent_cache(name, frontend):
    """``runner.verify()`` (each captured size, one token below it, the smallest count padded to it; outputs and
    the cache against eager) on a runner of one sequence's latent cache, the indexer's key cache beside it."""
    import test_dsa

    model = test_dsa.build(name) if name == "GlmMoeDsa" else build(name)
    token_model = TokenModel(enable(model))
    cache = token_model.make_kv_cache(max_seq_len=24)
    runner = piecewise.compile(token_model, piecewise.CaptureConfig(max_tokens=8, frontend=frontend))

    def make_inputs(tokens):  # a call of ``tokens`` after a 6-token prompt's positions
        return (torch.randint(0, 256, (tokens,)), torch.arange(6, 6 + tokens), cache)

    with torch.no_grad():
        runner(torch.randint(0, 256, (6,)), torch.arange(6), cache)
        report = runner.verify(*make_inputs(3), make_inputs=make_inputs)
    assert report.ok, report
    assert runner.stats["frontend"] == frontend


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
def test_enable_called_again_after_the_first_call_changes_nothing(frontend):
    """``TokenModel`` tells a user to call ``enable(model)`` again after ``set_attn_implementation``; that gave each
    MLA module a new bound forward, which breakable took for a method patched after the first call and refused."""
    model = build("DeepseekV3", seed=3)
    ids = torch.randint(0, 256, (7,), generator=torch.Generator().manual_seed(4))
    token_model = TokenModel(enable(model))
    cache, reference = token_model.make_kv_cache(max_seq_len=12), token_model.make_kv_cache(max_seq_len=12)
    runner = piecewise.compile(token_model, piecewise.CaptureConfig(max_tokens=8, frontend=frontend))
    with torch.no_grad():
        torch.testing.assert_close(runner(ids[:6], torch.arange(6), cache), token_model(ids[:6], torch.arange(6),
                                                                                      reference))
        forwards = [layer.self_attn.forward for layer in model.model.layers]
        enable(model)
        assert [layer.self_attn.forward for layer in model.model.layers] == forwards
        eager_calls = runner.stats["eager_calls"]
        torch.testing.assert_close(runner(ids[6:], torch.tensor([6]), cache),
                                   token_model(ids[6:], torch.tensor([6]), reference))
        assert runner.stats["eager_calls"] == eager_calls
