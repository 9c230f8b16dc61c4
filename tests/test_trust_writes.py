"""Never silently wrong, with writes into static tensors sized or placed by the token count: ``buf[:T] = x`` keeps
the rows past the call's as eager does (both front-ends); a write whose place moves with the count
(``mem[-T:] = x``) or that keeps the count (``buf.fill_(x.shape[0])``, a count over a mask) is refused at the first
call, naming the state, rather than served at the padded count's place."""

from __future__ import annotations

import warnings

import pytest
import torch

import piecewise
from piecewise.errors import ForwardRefused
from piecewise.models.llama import LlamaConfig, TinyLlama, rotary_tables

FRONTENDS = ["dynamo", "breakable"]
CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                     intermediate_size=64, max_seq_len=64)


class Writes(TinyLlama):
    """Hidden states written into the caller's ``aux`` [64, hidden] the way ``how`` says, then read back."""

    how = "head"

    def forward(self, input_ids, positions, kv_cache, aux):
        x = self.embed(input_ids)
        rotary = rotary_tables(positions, self.config.head_dim, self.config.rope_theta)
        for layer in self.layers:
            x = layer(x, positions, kv_cache, rotary)
        tokens = x.shape[0]
        if self.how == "head":  # an EAGLE-style buffer of the step's hidden states
            aux[:tokens] = x
        elif self.how == "narrow":
            aux.narrow(0, 0, tokens).copy_(x)
        elif self.how == "tail":  # the newest rows at the end of a ring
            aux[-tokens:] = x
        elif self.how == "count":
            aux[0].fill_(tokens)
        elif self.how == "masked count":
            aux[0].copy_((input_ids >= 0).sum().float().expand(aux.shape[1]))
        return self.lm_head(self.norm(x + aux[:1]))


def run(frontend: str, how: str, counts=(5, 3, 1, 6, 2)):
    torch.manual_seed(0)
    Writes.how = how
    model = Writes(CONFIG).eval()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=16, frontend=frontend, cache_dir=None))
    ours, theirs = model.make_kv_cache(), model.make_kv_cache()
    aux, aux_eager = torch.full((64, 32), 7.0), torch.full((64, 32), 7.0)
    start, generator = 0, torch.Generator().manual_seed(1)
    with torch.no_grad(), warnings.catch_warnings():
        for call, count in enumerate(counts):
            warnings.simplefilter("error" if call else "ignore")  # later calls: no fallback, no warning
            ids, positions = torch.randint(0, 64, (count,), generator=generator), torch.arange(start, start + count)
            start += count
            got = runner(ids, positions, ours, aux)
            want = model(ids, positions, theirs, aux_eager)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(aux, aux_eager, rtol=1e-5, atol=1e-5, msg=lambda m: f"{count} tokens: {m}")
    return runner


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("how", ["head", "narrow"])
def test_a_write_of_the_call_s_rows_at_the_head_leaves_the_rows_past_them_as_they_were(frontend, how):
    runner = run(frontend, how)
    assert runner.stats["frontend"] == frontend


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("how", ["tail", "count", "masked count"])
def test_a_write_placed_or_sized_by_the_padded_count_is_refused_or_right(frontend, how):
    """Refused at the first call, naming the tensor or the line; where a front-end serves it (Dynamo's trace keeps
    ``x.shape[0]`` symbolic: the real count), the state equals eager's after every call."""
    try:
        run(frontend, how)
    except ForwardRefused as refusal:
        message = str(refusal)
        assert "token count" in message and ("argument 'aux'" in message or "output 0" in message
                                             or "Writes.forward" in message or "test_trust_writes.py" in message), message
        assert refusal.kind == "token_mixing"
    else:
        assert frontend == "dynamo" and how != "masked count", "served, and equal to eager: right"
