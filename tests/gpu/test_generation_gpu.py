"""``piecewise.generate`` on CUDA: greedy tokens equal transformers' ``generate`` (float32) when the prefill
calls are longer than the graphs' top and run batched (``slot_attention_batched``, the call's layout read once
per call): prompts of different lengths in one call, prompts of equal length (the batch a view of the rows), a
prompt split over calls (a later chunk: the masked path)."""

from __future__ import annotations

import pytest
import torch

import piecewise

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")
from test_generation import build  # noqa: E402


@pytest.mark.parametrize(("lengths", "prefill_tokens"), [((300, 650, 20, 400), 8192), ((280,) * 3, 8192),
                                                          ((1300, 120), 700)])
def test_long_batched_prefills_give_transformers_greedy_tokens(lengths, prefill_tokens, monkeypatch):
    from piecewise.kernels import attention

    calls = []
    batched = attention.slot_attention_batched
    monkeypatch.setattr(attention, "slot_attention_batched", lambda *a, **k: calls.append(1) or batched(*a, **k))
    model = build("Llama").cuda()
    generator = torch.Generator().manual_seed(len(lengths))
    prompts = [torch.randint(2, 250, (n,), generator=generator).cuda() for n in lengths]
    with torch.no_grad():
        expected = [model.generate(input_ids=p[None], attention_mask=torch.ones_like(p[None]), max_new_tokens=5,
                                   do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):] for p in prompts]
    got = piecewise.generate(model, prompts, 5, prefill_tokens=prefill_tokens, stop_tokens=())
    assert calls, "the long prefill did not run the batched attention"
    assert [g.tolist() for g in got] == [e.tolist() for e in expected]
