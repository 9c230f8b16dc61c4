"""``piecewise.generate`` on CPU: greedy tokens equal transformers' ``generate`` for dense, sliding-window, MoE,
MLA and DSA models, with prompts of different lengths, more prompts than slots (admitted as slots free), prompts
longer than a prefill call, per-prompt limits and stop tokens; sampling is on the device, reproducible by seed,
and top-k / top-p / temperature keep the tokens they should; streaming yields what ``generate`` returns."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

import piecewise

transformers = pytest.importorskip("transformers")
from piecewise.generation import sample  # noqa: E402
from test_transformers_zoo import init_stacked_experts  # noqa: E402

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
             eos_token_id=255)
MODELS = {
    "Llama": {},
    "Gemma2": dict(sliding_window=4),  # sliding window, logit softcap
    "Qwen3Moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "DeepseekV3": dict(num_key_value_heads=4, head_dim=None, n_routed_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                       qk_nope_head_dim=8, v_head_dim=16, first_k_dense_replace=1, n_group=1, topk_group=1),
    "GlmMoeDsa": dict(num_key_value_heads=4, head_dim=None, n_routed_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                      qk_nope_head_dim=8, v_head_dim=16, first_k_dense_replace=1, n_group=1, topk_group=1,
                      index_n_heads=16, index_head_dim=16, index_topk=4),
}


def build(name: str, seed: int = 0):
    config_class = getattr(transformers, f"{name}Config", None)
    if config_class is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    values = {k: v for k, v in {**SMALL, **MODELS[name]}.items() if v is not None}
    torch.manual_seed(seed)
    return init_stacked_experts(transformers.AutoModelForCausalLM.from_config(config_class(**values)).eval())


def transformers_greedy(model, prompts, limits, eos):
    out = []
    with torch.no_grad():
        for prompt, limit in zip(prompts, limits):
            ids = model.generate(input_ids=prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=limit, do_sample=False, eos_token_id=eos, pad_token_id=0)
            out.append(ids[0, len(prompt):])
    return out


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_tokens_equal_transformers_generate(name):
    """Five prompts of 3..13 tokens through two slots, prefill calls of at most 8 tokens (the 13-token prompt
    over two), one limit per prompt; the stop token is one the model emits early for one prompt (so that a
    sequence ends before its limit and its slot is reused)."""
    model = build(name)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 250, (n,), generator=generator) for n in (5, 13, 3, 9, 7)]
    limits = [6, 4, 7, 5, 6]
    free_run = transformers_greedy(model, prompts, limits, eos=None)
    stop = int(free_run[2][2])  # prompt 2 stops at its third token, or earlier
    expected = transformers_greedy(model, prompts, limits, eos=stop)
    got = piecewise.generate(model, prompts, limits, max_batch=2, prefill_tokens=8, stop_tokens=[stop])
    assert [g.tolist() for g in got] == [e.tolist() for e in expected]
    assert len(got[2]) <= 3 and got[2][-1] == stop


def test_the_models_eos_token_stops_by_default_and_streaming_yields_what_generate_returns():
    model = build("Llama", seed=3)
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, 250, (n,), generator=generator) for n in (4, 6, 8)]
    model.generation_config.eos_token_id = int(transformers_greedy(model, prompts[:1], [3], eos=None)[0][1])
    got = piecewise.generate(model, prompts, 5)
    assert got[0].tolist()[-1] == model.generation_config.eos_token_id and len(got[0]) == 2
    streamed = [[] for _ in prompts]
    for index, token in piecewise.generate_stream(model, prompts, 5):
        streamed[index].append(token)
    assert streamed == [g.tolist() for g in got]


@pytest.mark.parametrize("setting", [("repetition_penalty", 1.3), ("no_repeat_ngram_size", 3),
                                     ("suppress_tokens", [7]), ("do_sample", True),
                                     ("exponential_decay_length_penalty", (2, 1.5)), ("guidance_scale", 1.5),
                                     ("stop_strings", ["end"])])
def test_generation_config_settings_generate_does_not_apply_are_named_in_a_warning(setting):
    """Before, its tokens differed from transformers' generate with that config, silently."""
    model = build("Llama", seed=3)
    prompts = [torch.randint(2, 250, (5,), generator=torch.Generator().manual_seed(4))]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        piecewise.generate(model, prompts, 2)
    assert not any("generation_config also sets" in str(w.message) for w in caught)
    setattr(model.generation_config, *setting)
    with pytest.warns(UserWarning, match=rf"generation_config also sets {setting[0]}=.*which it does not apply"):
        piecewise.generate(model, prompts, 2)


def test_sampling_is_reproducible_by_seed_and_differs_across_seeds():
    model = build("Llama", seed=5)
    prompts = [torch.arange(2, 8), torch.arange(10, 13)]
    runs = [piecewise.generate(model, prompts, 8, temperature=1.5, seed=seed) for seed in (0, 0, 1)]
    assert [r.tolist() for r in runs[0]] == [r.tolist() for r in runs[1]]
    assert [r.tolist() for r in runs[0]] != [r.tolist() for r in runs[2]]


def test_sample_keeps_the_tokens_top_k_and_top_p_allow_in_proportion():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(20000, 1)
    g = torch.Generator().manual_seed(0)
    assert torch.equal(sample(logits[:3]), torch.zeros(3, dtype=torch.long))  # greedy
    counts = torch.bincount(sample(logits, 1.0, generator=g), minlength=4) / 20000
    torch.testing.assert_close(counts, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.015, rtol=0)
    counts = torch.bincount(sample(logits, 1.0, top_k=2, generator=g), minlength=4) / 20000
    torch.testing.assert_close(counts, torch.tensor([0.625, 0.375, 0, 0]), atol=0.015, rtol=0)
    counts = torch.bincount(sample(logits, 1.0, top_p=0.7, generator=g), minlength=4) / 20000  # 0.5 + 0.3 reach it
    torch.testing.assert_close(counts, torch.tensor([0.625, 0.375, 0, 0]), atol=0.015, rtol=0)
    assert sample(logits[:100], 1.0, top_p=0.4, generator=g).eq(0).all()  # the most likely token alone reaches it
    counts = torch.bincount(sample(logits, 0.5, generator=g), minlength=4) / 20000  # p² renormalised
    want = torch.tensor([0.25, 0.09, 0.0225, 0.0025])
    torch.testing.assert_close(counts, want / want.sum(), atol=0.015, rtol=0)


def test_bad_requests_are_refused_with_what_to_give():
    model = build("Llama")
    with pytest.raises(ValueError, match=r"prompt 1 must be a non-empty 1-D tensor of token ids"):
        piecewise.generate(model, [torch.arange(3), torch.arange(6).view(2, 3)], 4)
    with pytest.raises(ValueError, match=r"max_new_tokens has 3 limits for 2 prompts"):
        piecewise.generate(model, [torch.arange(3), torch.arange(4)], [1, 2, 3])
    assert piecewise.generate(model, [torch.arange(3)], 0)[0].numel() == 0
    vocab = model.get_input_embeddings().num_embeddings
    for request, message in [
        ({"top_p": 0.0, "temperature": 1.0}, r"top_p 0\.0 \(in \(0, 1\]\)"),
        ({"temperature": -0.5}, r"temperature -0\.5 \(0 is greedy"),
        ({"top_k": 0, "temperature": 1.0}, r"top_k 0 \(1 or more\)"),
        ({"max_new_tokens": -1}, r"max_new_tokens must be whole numbers of 0 or more, got -1"),
        ({"prompts": [torch.tensor([1.0, 2.0])]}, r"prompt 0 holds torch.float32 values: token ids are integers"),
        ({"prompts": [torch.tensor([1, vocab])]}, rf"prompt 0 holds token id {vocab}, outside the model's vocabulary"),
    ]:
        call = {"prompts": [torch.arange(3)], "max_new_tokens": 2, **request}
        with pytest.raises(ValueError, match=message):  # not torch's error from deep inside, nor greedy in silence
            piecewise.generate(model, call.pop("prompts"), call.pop("max_new_tokens"), **call)


@pytest.mark.parametrize("name", ["Llama", "DeepseekV3"])
def test_later_calls_reuse_the_runner_and_its_cache_until_they_need_a_longer_one(name):
    from piecewise.generation import _RUNNERS

    model = build(name, seed=6)
    prompts = [torch.arange(2, 9), torch.arange(20, 24)]
    longer = [torch.arange(2, 40)]
    expected = transformers_greedy(model, longer, [5], eos=255)[0].tolist()  # before enable() swaps the attention
    first = piecewise.generate(model, prompts, 4)
    (runner_key, made), = _RUNNERS[model].items()
    assert [g.tolist() for g in piecewise.generate(model, prompts[::-1], 3)] == [first[1].tolist()[:3],
                                                                                first[0].tolist()[:3]]
    assert _RUNNERS[model][runner_key] is made  # same runner, same cache
    got = piecewise.generate(model, longer, 5)
    assert _RUNNERS[model][runner_key] is not made  # a longer cache: a new runner over it
    assert got[0].tolist() == expected


def test_generate_stream_refuses_a_bad_request_when_called_not_when_first_read():
    model = build("Llama")
    with pytest.raises(ValueError, match=r"max_new_tokens has 1 limits for 2 prompts"):
        piecewise.generate_stream(model, [torch.arange(3), torch.arange(4)], [2])


@pytest.mark.parametrize("swap", ["copy_", ".data ="])
def test_weights_changed_between_calls_are_used(swap):
    """A weight sync between generations (RL rollouts): written in place, the same runner reads the new values;
    replaced (``.data =``), generate compiles a new runner instead of the kept one refusing. Greedy tokens equal
    transformers' with the new weights either way."""
    model, twin = build("Llama", seed=7), build("Llama", seed=7)
    prompts = [torch.arange(2, 9), torch.arange(20, 24)]
    new = torch.randn_like(model.model.embed_tokens.weight, generator=torch.Generator().manual_seed(8)) * 0.5
    with torch.no_grad():
        twin.model.embed_tokens.weight.copy_(new)
    expected = transformers_greedy(twin, prompts, [5, 5], eos=255)
    piecewise.generate(model, prompts, 5)
    with torch.no_grad():
        if swap == "copy_":
            model.model.embed_tokens.weight.copy_(new)
        else:
            model.model.embed_tokens.weight.data = new.clone()
    got = piecewise.generate(model, prompts, 5)
    assert [g.tolist() for g in got] == [e.tolist() for e in expected]


def test_long_prefills_take_the_output_head_on_their_last_rows_only_and_equal_transformers():
    """Prompts past the top of the graphs prefill without them, with the output head on each prompt's last row
    (``TokenModel(logits_rows=...)``): the tokens still equal transformers' generate."""
    from piecewise.integrations.transformers import TokenModel

    model = build("Llama")
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, 250, (n,), generator=generator) for n in (13, 9, 11)]
    expected = transformers_greedy(model, prompts, [5, 5, 5], eos=None)
    calls = []
    original = TokenModel.forward

    @functools.wraps(original)  # the runner reads the forward's signature
    def spy(self, *args, logits_rows=None, **kwargs):
        if logits_rows is not None:  # only outside the runner: Dynamo never traces this line
            calls.append(logits_rows.tolist())
        return original(self, *args, logits_rows=logits_rows, **kwargs)

    TokenModel.forward = spy
    try:  # every prefill call (33 tokens) is longer than the top of the graphs (4)
        got = piecewise.generate(model, prompts, 5, config=piecewise.CaptureConfig(max_tokens=4), stop_tokens=())
    finally:
        TokenModel.forward = original
    assert [g.tolist() for g in got] == [e.tolist() for e in expected]
    assert [12, 21, 32] in calls  # one prefill call of the three prompts: each prompt's last row


def test_disable_gives_transformers_its_own_attention_back_after_generate():
    """``piecewise.generate`` enables the model; ``disable`` makes its own ``generate`` work again (before it,
    transformers' cache is refused with a message naming disable), and generate enables it once more."""
    from piecewise.integrations.transformers import TokenModel, disable

    model = build("Llama")
    prompt = torch.randint(2, 250, (7,), generator=torch.Generator().manual_seed(3))
    expected = transformers_greedy(model, [prompt], [4], eos=None)[0]
    assert piecewise.generate(model, [prompt], 4, stop_tokens=())[0].tolist() == expected.tolist()
    with pytest.raises(ValueError, match=r"piecewise\.integrations\.transformers\.disable\(model\)"):
        transformers_greedy(model, [prompt], [4], eos=None)
    disable(model)
    assert transformers_greedy(model, [prompt], [4], eos=None)[0].tolist() == expected.tolist()
    with pytest.raises(ValueError, match=r"call piecewise\.integrations\.transformers\.enable\(model\)"):
        TokenModel(model)(prompt, torch.arange(7), TokenModel(model).make_kv_cache(max_seq_len=16))
    assert piecewise.generate(model, [prompt], 4, stop_tokens=())[0].tolist() == expected.tolist()


@pytest.mark.parametrize("name", ["Llama", "DeepseekV3"])
def test_attention_set_back_with_transformers_own_api_is_refused_with_a_cache_and_enabled_again_by_generate(name):
    """``set_attn_implementation("sdpa")`` after ``enable`` (not ``disable``): transformers' attention never reads
    piecewise's KV cache, so ``TokenModel`` refuses one, naming enable; ``generate`` enables the model again, with
    a new runner (enable patches MLA's attention modules anew, which a breakable runner of before would refuse)."""
    from piecewise.integrations.transformers import TokenModel

    model = build(name)
    prompt = torch.randint(2, 250, (7,), generator=torch.Generator().manual_seed(4))
    expected = transformers_greedy(model, [prompt], [4], eos=None)[0]
    config = piecewise.CaptureConfig(max_tokens=8, frontend="breakable")
    assert piecewise.generate(model, [prompt], 4, stop_tokens=(), config=config)[0].tolist() == expected.tolist()
    model.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match=r"transformers' 'sdpa' now .*enable\(model\) again"):
        TokenModel(model)(prompt, torch.arange(7), TokenModel(model).make_kv_cache(max_seq_len=16))
    assert piecewise.generate(model, [prompt], 4, stop_tokens=(), config=config)[0].tolist() == expected.tolist()


def test_generations_of_one_model_in_two_threads_take_turns_and_a_nested_one_is_refused():
    """The runner and KV cache kept on a model serve one generation at a time: two threads' generations each
    get transformers' tokens (before, both put their sequences in slots 0, 1, ... of the one cache); a
    generation started while this thread's stream of the same model is open is refused, not deadlocked."""
    import threading

    model = build("Llama", seed=2)
    generator = torch.Generator().manual_seed(2)
    batches = [[torch.randint(2, 250, (n,), generator=generator) for n in lengths] for lengths in ((5, 9), (7, 3))]
    expected = [transformers_greedy(model, prompts, [6, 6], eos=None) for prompts in batches]
    config = piecewise.CaptureConfig(max_tokens=8)
    piecewise.generate(model, batches[0], 6, stop_tokens=(), config=config)  # the runner and its cache, made once
    got = [None, None]

    def generate(index):
        got[index] = piecewise.generate(model, batches[index], 6, stop_tokens=(), config=config)

    threads = [threading.Thread(target=generate, args=(index,)) for index in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for tokens, want in zip(got, expected):
        assert [t.tolist() for t in tokens] == [w.tolist() for w in want]
    stream = piecewise.generate_stream(model, batches[0], 6, stop_tokens=(), config=config)
    next(stream)
    with pytest.raises(RuntimeError, match=r"still open in this thread.*close\(\) the stream first"):
        piecewise.generate(model, batches[1], 6, stop_tokens=(), config=config)
    stream.close()
    assert [t.tolist() for t in piecewise.generate(model, batches[1], 6, stop_tokens=(), config=config)] == \
        [w.tolist() for w in expected[1]]


def test_prefill_calls_past_the_graphs_top_that_finish_no_prompt_give_transformers_tokens():
    """Prefill calls longer than the graphs' top run the model directly with the output head on the rows that
    finish a prompt: a call that finishes none (a long prompt's first chunks) has no such row."""
    model = build("Llama", seed=6)
    generator = torch.Generator().manual_seed(6)
    prompts = [torch.randint(2, 250, (n,), generator=generator) for n in (30, 5)]
    expected = transformers_greedy(model, prompts, [4, 4], eos=None)
    got = piecewise.generate(model, prompts, 4, prefill_tokens=12, stop_tokens=(),
                             config=piecewise.CaptureConfig(max_tokens=8))
    assert [g.tolist() for g in got] == [e.tolist() for e in expected]
