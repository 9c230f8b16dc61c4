"""Never silently wrong, continued: models as vLLM, SGLang and kernel-library users write them. KV caches inside a
list or an object, a module attribute swapped for another object, the token count used as a value, the model's own
tensors returned, a first call of one token. Each is right (equal to eager), or refused naming the cause."""

from __future__ import annotations

import dataclasses
import enum
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import piecewise
from piecewise.errors import ForwardRefused
from piecewise.models.attention import attention
from piecewise.models.llama import LlamaConfig, TinyLlama, rotary_tables

FRONTENDS = ["dynamo", "breakable"]
CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                     intermediate_size=64, max_seq_len=64)


class ListLlama(TinyLlama):
    """vLLM v0: ``forward(input_ids, positions, kv_caches)``, one cache tensor per layer in a list."""

    def forward(self, input_ids, positions, kv_caches):
        x = self.embed(input_ids)
        rotary = rotary_tables(positions, self.config.head_dim, self.config.rope_theta)
        for index, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
            q, k, v = layer.pre_attention(x, rotary)
            x = layer.post_attention(x, attention(q, k, v, positions, cache[None], 0))
        return self.lm_head(self.norm(x))


@dataclasses.dataclass
class ForwardBatch:
    kv_pool: list


class ObjectLlama(ListLlama):
    """SGLang: the caches reach forward inside an object."""

    def forward(self, input_ids, positions, forward_batch):
        return super().forward(input_ids, positions, forward_batch.kv_pool)


def caches():
    return [torch.zeros(2, CONFIG.max_seq_len, CONFIG.num_kv_heads, CONFIG.head_dim) for _ in range(2)]


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("holder", ["list", "object"])
def test_kv_caches_inside_a_list_or_an_object_get_every_write(frontend, holder):
    """A prompt and decode steps: each step attends to the rows the steps before wrote into the caller's caches."""
    torch.manual_seed(0)
    model = (ListLlama if holder == "list" else ObjectLlama)(CONFIG).eval()
    wrap = list if holder == "list" else ForwardBatch
    ours, theirs = caches(), caches()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend=frontend, cache_dir=None))
    steps = [(torch.tensor([11, 22, 33, 44, 55]), torch.arange(5))]
    steps += [(torch.tensor([60 + s]), torch.tensor([5 + s])) for s in range(4)] + [(torch.arange(3), torch.arange(9, 12))]
    with torch.no_grad():
        for ids, positions in steps:
            got = runner(ids, positions, wrap(list(ours)))  # a new holder each call, the same tensors
            torch.testing.assert_close(got, model(ids, positions, wrap(list(theirs))))
            for a, b in zip(ours, theirs):
                torch.testing.assert_close(a, b)


def test_a_written_cache_inside_a_list_that_is_another_tensor_later_is_refused_by_name():
    """The graphs write the first call's tensor: another one later is an error naming the element (Dynamo; breakable
    runs such a call eagerly, with a warning)."""
    torch.manual_seed(0)
    model = ListLlama(CONFIG).eval()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend="dynamo", cache_dir=None))
    with torch.no_grad():
        runner(torch.arange(4), torch.arange(4), caches())
        with pytest.raises(ValueError, match=r"`kv_caches\[0\]` is written in place by the forward.*same tensors"):
            runner(torch.arange(2), torch.arange(2), caches())


class Relu:
    def apply(self, x):
        return torch.relu(x)


class Gelu:
    def apply(self, x):
        return F.gelu(x)


class Mode(enum.Enum):
    PLAIN = 1
    HALVED = 2


class Strategies(nn.Module):
    """vLLM's ``layer.quant_method``: a helper object the forward calls; an enum flag; a parameterless submodule."""

    def __init__(self):
        super().__init__()
        self.lin, self.head = nn.Linear(16, 16), nn.Linear(16, 8)
        self.method, self.mode, self.act = Relu(), Mode.PLAIN, nn.SiLU()

    def forward(self, x):
        h = self.act(self.method.apply(self.lin(x)))
        if self.mode is Mode.HALVED:
            h = h * 0.5
        return self.head(h)


@pytest.mark.parametrize("change", ["method object", "enum", "patched forward", "parameterless submodule"])
def test_a_module_attribute_swapped_for_another_object_is_traced_again_not_ignored(change):
    """A replaced submodule is refused (its parameters could have changed too); other objects retrace."""
    torch.manual_seed(0)
    model = Strategies().eval()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend="dynamo", cache_dir=None))
    x = torch.randn(5, 8 * 2)
    with torch.no_grad():
        runner(x)
        if change == "method object":
            model.method = Gelu()
        elif change == "enum":
            model.mode = Mode.HALVED
        elif change == "patched forward":
            model.head.forward = lambda h: -F.linear(h, model.head.weight, model.head.bias)
        else:
            model.act = nn.GELU()
            with pytest.raises(ValueError, match="submodule `act` was replaced by a new object"):
                runner(x)
            return
        with pytest.warns(UserWarning, match="traced again"):
            got = runner(x)
        torch.testing.assert_close(got, model(x))


class CountAsValue(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind, self.lin = kind, nn.Linear(8, 8)

    def forward(self, x):
        count = x.shape[0]
        if self.kind == "mean by the count":
            return self.lin(x) / count
        if self.kind == "distance to the last token":
            return self.lin(x) * (count - 1 - torch.arange(count, dtype=x.dtype))[:, None]
        if self.kind == "count as a feature":
            return self.lin(x + torch.full((count, 1), count, dtype=x.dtype))
        return self.lin(x), count


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("kind", ["mean by the count", "distance to the last token", "count as a feature",
                                  "count returned"])
def test_the_token_count_taken_for_a_value_is_refused(frontend, kind):
    """Padded, such code sees the padded count; the count check compares the call's rows run as they are with them
    padded."""
    runner = piecewise.compile(CountAsValue(kind).eval(), piecewise.CaptureConfig(max_tokens=8, frontend=frontend,
                                                                                  cache_dir=None))
    with torch.no_grad(), pytest.raises(ForwardRefused, match=r"takes the token count for a value.*between the call "
                                                              r"run as it is and padding to \d+ tokens") as info:
        runner(torch.randn(5, 8))
    assert info.value.kind == "token_mixing"


class Noisy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) + 0.01 * torch.randn_like(x)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_forward_that_draws_random_numbers_is_not_taken_for_one_that_uses_the_count(frontend):
    runner = piecewise.compile(Noisy().eval(), piecewise.CaptureConfig(max_tokens=8, frontend=frontend,
                                                                       cache_dir=None))
    with torch.no_grad():
        assert runner(torch.randn(5, 8)).shape == (5, 8)


class ReturnsOwnTensors(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("class_bias", torch.randn(8))

    def forward(self, x):
        return {"hidden": self.lin(x), "class_bias": self.class_bias, "lin_bias": self.lin.bias}


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_the_models_own_tensors_returned_are_never_cut_to_the_token_count(frontend):
    """A buffer of 8 entries returned at 5 tokens padded to 8: whole, not cut to 5."""
    model = ReturnsOwnTensors().eval()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend=frontend, cache_dir=None))
    with torch.no_grad():
        for tokens in (3, 5, 8):
            got, want = runner(torch.randn(tokens, 8)), model(torch.randn(tokens, 8))
            assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in want.items()}, tokens
            torch.testing.assert_close(got["class_bias"], model.class_bias)


class Sampler(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(64, 8), nn.Linear(8, 16)

    def forward(self, ids, temperature, logit_bias):
        return (self.head(self.embed(ids)) + logit_bias) / temperature


@pytest.mark.parametrize("frontend", ["auto", "breakable"])
def test_a_one_token_first_call_that_takes_other_arguments_for_token_arguments_says_how_to_name_them(frontend):
    """At one token every [1]-shaped argument looks like a token argument (a temperature [1], a bias [1, V]). The
    refusal says so and names ``dynamic=``; the next call decides the token arguments afresh."""
    model = Sampler().eval()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend=frontend, cache_dir=None))
    temperature, bias = torch.tensor([0.7]), torch.zeros(1, 16)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ForwardRefused, match=r"a one-token call\): .*'temperature' \(1,\).*dynamic=\{'ids': 0"):
            runner(torch.arange(1), temperature, bias)
        ids = torch.arange(4)
        torch.testing.assert_close(runner(ids, temperature, bias), model(ids, temperature, bias))
    assert runner.token_arguments == {"ids": 0}


class Table(nn.Module):
    def forward(self, x, table):
        return x * 2, table + 1


def test_token_arguments_that_disagree_later_say_how_they_were_taken():
    """A table whose length was the first call's token count was taken for a token argument."""
    runner = piecewise.compile(Table(), piecewise.CaptureConfig(max_tokens=16, cache_dir=None))
    table = torch.arange(8.0)
    with torch.no_grad():
        runner(torch.randn(8, 4), table)
        with pytest.raises(ValueError, match=r"disagree.*took the token arguments by themselves.*'table' \(8,\)"
                                             r".*dynamic=\{'x': 0"):
            runner(torch.randn(3, 4), table)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_kv_caches_that_are_views_of_one_tensor_get_every_write(frontend):
    """One allocation, a view per layer (``big.unbind(0)``), as engines set caches up."""
    torch.manual_seed(0)
    model = ListLlama(CONFIG).eval()
    shape = (2, 2, CONFIG.max_seq_len, CONFIG.num_kv_heads, CONFIG.head_dim)
    ours, theirs = torch.zeros(shape), torch.zeros(shape)
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend=frontend, cache_dir=None))
    with torch.no_grad():
        for ids, positions in [(torch.arange(5), torch.arange(5)), *((torch.tensor([7 + s]), torch.tensor([5 + s]))
                                                                    for s in range(3)), (torch.arange(3), torch.arange(8, 11))]:
            got = runner(ids, positions, list(ours.unbind(0)))
            torch.testing.assert_close(got, model(ids, positions, list(theirs.unbind(0))))
            torch.testing.assert_close(ours, theirs)


class StateWrite(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind, self.lin = kind, nn.Linear(8, 8)
        self.register_buffer("buf", torch.zeros(64, 8))
        self.register_buffer("length", torch.zeros((), dtype=torch.long))

    def forward(self, x, positions):
        h = self.lin(x)
        if self.kind == "length from the last position":  # gpt-fast-style sequence length
            self.buf.index_copy_(0, positions, h)
            self.length.copy_(positions[-1] + 1)
            return h + (self.buf * (torch.arange(64) < self.length).float()[:, None]).sum(0)
        out = h + self.buf.sum(0)  # read before the write: only the state sees the rows mixed
        self.buf.index_copy_(0, positions, h.flip(0) if self.kind == "rows flipped" else h - h.mean(0))
        return out


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("kind", ["length from the last position", "rows flipped", "rows centred"])
def test_token_rows_mixed_into_state_the_forward_writes_are_refused(frontend, kind):
    """Padding reaching a write (and not the outputs of the call) would corrupt the state on every padded call:
    the padding check compares the state the two padded runs write, and pads with the last rows first (a first
    row at position 0 looks like zero padding)."""
    runner = piecewise.compile(StateWrite(kind).eval(), piecewise.CaptureConfig(max_tokens=8, frontend=frontend,
                                                                                cache_dir=None))
    with torch.no_grad(), pytest.raises(ForwardRefused, match=r"mixes tokens into state it writes.*buffer `(buf|length)`"):
        runner(torch.randn(5, 8), torch.arange(5))


class HeldCaches(nn.Module):
    """Caches in a dict and a tuple, written in plain code (cut out of the pieces)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 16)

    def forward(self, x, positions, caches, pair):
        k, v = self.lin(x).chunk(2, -1)
        caches["k"].index_copy_(0, positions, k)
        pair[0].index_copy_(0, positions, v)
        return (x @ caches["k"].T).softmax(-1) @ pair[0]


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_caches_in_a_dict_or_a_tuple_written_in_plain_code_are_served(frontend):
    torch.manual_seed(0)
    model = HeldCaches().eval()
    ours, theirs = (torch.zeros(32, 8), torch.zeros(32, 8)), (torch.zeros(32, 8), torch.zeros(32, 8))
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend=frontend, cache_dir=None))
    start = 0
    with torch.no_grad():
        for count in (5, 1, 3, 8, 2):
            x, positions = torch.randn(count, 8), torch.arange(start, start + count)
            got = runner(x, positions, {"k": ours[0]}, (ours[1],))
            torch.testing.assert_close(got, model(x, positions, {"k": theirs[0]}, (theirs[1],)))
            torch.testing.assert_close(ours, theirs)
            start += count


def test_a_forward_that_names_no_argument_says_what_to_compile():
    with pytest.raises(ValueError, match=r"forward of DataParallel names no argument.*model\.module, a Linear"):
        piecewise.compile(nn.DataParallel(nn.Linear(4, 4)))


CALLS = {"count": 0}


@piecewise.opaque_op("trust_ports::drifting", split=True)
def drifting(x: torch.Tensor) -> torch.Tensor:
    """Another result on every run, rehearsal or not (a race between streams does that on a GPU)."""
    CALLS["count"] += 1
    return x + CALLS["count"]


class Drifting(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return drifting(self.lin(x))


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_forward_that_differs_from_itself_is_not_refused_for_the_paddings_doing(frontend, caplog):
    """The padding check repeats its zero-padded run before refusing: where that differs too, the difference is
    not the padding's, and the check is left out with a log line."""
    import logging

    runner = piecewise.compile(Drifting().eval(), piecewise.CaptureConfig(max_tokens=8, frontend=frontend,
                                                                          cache_dir=None))
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="piecewise.runtime.checks"):
        assert runner(torch.randn(5, 8)).shape == (5, 8)
    assert "gives other results on a repeat of the same padded run" in caplog.text


class PrefillOrDecode(nn.Module):
    """gpt-fast's shape (ids [1, S]): a prefill attends among the call's own tokens, a decode step over the cache.
    Dynamo's trace of a prompt holds for more than one token, so it pads one-token steps to 2 (the prefill path);
    at the prompt's first position both paths see one key alike, at its last they do not."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.wqkv = nn.Linear(8, 24, bias=False)
        self.register_buffer("k_cache", torch.zeros(1, 16, 8))
        self.register_buffer("v_cache", torch.zeros(1, 16, 8))
        self.register_buffer("causal", torch.tril(torch.ones(16, 16, dtype=torch.bool)))

    def forward(self, idx, input_pos):
        q, k, v = self.wqkv(self.embed(idx)).split(8, -1)
        self.k_cache[:, input_pos] = k
        self.v_cache[:, input_pos] = v
        if idx.shape[1] > 1:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=self.causal[input_pos])
        return y + q


@pytest.mark.parametrize("frontend", ["dynamo", "auto"])
def test_a_prefill_and_a_decode_path_chosen_by_the_count_is_refused_by_dynamo_and_served_right_by_auto(frontend):
    torch.manual_seed(0)
    model = PrefillOrDecode().eval()
    reference = PrefillOrDecode().eval()
    reference.load_state_dict(model.state_dict())
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend=frontend, cache_dir=None))
    prompt = torch.randint(0, 32, (1, 7))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # auto: Dynamo refuses the branch and says so
        if frontend == "dynamo":
            with pytest.raises(ForwardRefused, match=r"row 6 of the first call.*if idx\.shape\[1\] > 1") as refused:
                runner(prompt, torch.arange(7))
            assert refused.value.kind == "token_branch"
            return
        torch.testing.assert_close(runner(prompt, torch.arange(7)), reference(prompt, torch.arange(7)))
        token = prompt[:, -1:]
        for position in range(7, 11):
            got, want = runner(token, torch.tensor([position])), reference(token, torch.tensor([position]))
            torch.testing.assert_close(got, want)
            token = want[..., :1].argmax(-1) % 32
    torch.testing.assert_close(model.k_cache, reference.k_cache)
    assert runner.stats["frontend"] == "breakable"


@piecewise.opaque_op("trust_ports::heads_first_attention", fake=lambda q, k, v: torch.empty_like(q), split=True)
def heads_first_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class HeadsFirst(nn.Module):
    """gpt-fast's attention layout made a splitting op as it stands: q, k, v [B, H, S, D], the tokens in dim 2."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.wqkv = nn.Linear(8, 24, bias=False)

    def forward(self, idx):
        q, k, v = (t.view(1, -1, 2, 4).transpose(1, 2) for t in self.wqkv(self.embed(idx)).split(8, -1))
        return heads_first_attention(q, k, v).transpose(1, 2).reshape(1, -1, 8)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_splitting_op_returning_the_tokens_in_another_dimension_is_refused_with_the_transpose(frontend):
    """Dynamo's trace gives the op's output with the token count in dimension 2: named with the fix (before, a raw
    reshape error from inside a piece); breakable's survey names it alike."""
    runner = piecewise.compile(HeadsFirst().eval(), piecewise.CaptureConfig(max_tokens=8, frontend=frontend,
                                                                            cache_dir=None))
    with torch.no_grad(), pytest.raises(ForwardRefused, match=r"heads_first_attention.*with the tokens in dimension 2, "
                                                               r"not 0.*\.transpose\(0, 2\)") as refused:
        runner(torch.randint(0, 32, (1, 7)))
    assert refused.value.kind == "token_layout"
