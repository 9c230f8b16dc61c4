"""Generation for transformers causal LMs under piecewise: a thin continuous-batching loop.

    new_tokens = piecewise.generate(model, prompts, max_new_tokens=64)          # greedy
    new_tokens = piecewise.generate(model, prompts, 64, temperature=0.8, top_p=0.95, seed=0)
    for index, token in piecewise.generate_stream(model, prompts, 64): ...       # tokens as they come

``prompts`` is a list of 1-D token tensors of any lengths. Up to ``max_batch`` sequences run at once, each in a
slot of one multi-sequence KV cache (``TokenModel.make_kv_cache(..., sequences=max_batch)``); the rest wait and
take a slot when one frees. Each step is one call of the compiled model (``piecewise.compile(TokenModel(model))``,
kept on the model for later calls with the same settings): while prompts wait to be prefilled, the step prefills
them together, several sequences' tokens in one call of at most ``prefill_tokens`` (a long prompt over several
calls); otherwise it decodes one token of every running sequence. Sampling runs on the device (greedy, or
temperature / top-k / top-p with a seeded generator); a sequence ends at one of its stop tokens (the model's
``eos_token_id`` by default, kept in the output as transformers' ``generate`` keeps it) or at its token limit.
An engine's scheduler, paged memory and serving are out of scope.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from .capture.segment import runner_call
from .config import CaptureConfig
from .frontends.user_frames import caller_stacklevel

_RUNNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""model → {(config fields): (TokenModel, runner)}: one compile per model and settings."""
_BUSY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""model → [lock, thread generating]: the runner and KV cache kept on a model serve one generation at a time."""
_BUSY_LOCK = threading.Lock()


@contextlib.contextmanager
def _generating(model: nn.Module):
    """Hold ``model``'s generation lock: another thread's generation waits for this one (both would put their
    sequences in the same slots of the one cache); a second one in this thread, while its stream is open, is
    refused (it would wait for itself)."""
    with _BUSY_LOCK:
        entry = _BUSY.setdefault(model, [threading.Lock(), None])
    if entry[1] == threading.get_ident():
        raise RuntimeError("piecewise.generate: a generate_stream of this model is still open in this thread, and "
                           "both would use the one KV cache kept on the model: exhaust or close() the stream first")
    with entry[0]:
        entry[1] = threading.get_ident()
        try:
            yield
        finally:
            entry[1] = None


@dataclass
class _Sequence:
    index: int
    prompt: torch.Tensor
    limit: int
    slot: int = -1
    prefilled: int = 0
    tokens: list[int] = field(default_factory=list)

    @property
    def position(self) -> int:
        """Where the next token fed to the model sits."""
        return self.prefilled if self.prefilled < len(self.prompt) else len(self.prompt) + len(self.tokens) - 1


def _runner(model: nn.Module, config: CaptureConfig, max_seq: int, sequences: int):
    """(TokenModel, runner, cache) for ``model`` and ``config`` with a cache of at least ``max_seq`` positions and
    ``sequences`` slots: the last ones made, or (the runner's graphs read the cache in place) a new runner over a
    new cache twice as long."""
    from . import compile as compile_model
    from .integrations.dsa import ATTENTION
    from .integrations.transformers import TokenModel, enable

    if getattr(model, "_piecewise_call", None) is None or model.config._attn_implementation != ATTENTION:
        enable(model)  # never enabled, disable()d since, or transformers' attention set again (set_attn_implementation)
        _RUNNERS.pop(model, None)  # enable() patches attention modules anew: a runner of before would refuse them
    runners = _RUNNERS.setdefault(model, {})
    key = repr(config)
    made = runners.get(key)
    if made is not None and not _weights_in_place(made[1]):  # `.data =`, .to(): the runner would refuse; a new one
        made = None
    if made is not None:
        have_seq, have_sequences = _cache_size(model, made[2])
        if have_seq >= max_seq and have_sequences >= sequences:
            return made
        max_seq, sequences = max(max_seq, 2 * have_seq), max(sequences, have_sequences)
    token_model = TokenModel(model)
    cache = token_model.make_kv_cache(max_seq_len=max_seq, sequences=sequences,
                                      device=next(model.parameters()).device)
    runners[key] = (token_model, compile_model(token_model, config), cache)
    return runners[key]


def _weights_in_place(runner) -> bool:
    """Whether the model's parameters and buffers are where ``runner`` captured them (values written in place, as
    a weight sync does with ``copy_``, keep them there)."""
    try:
        runner.watch.check()
    except ValueError:
        return False
    return True


def _cache_size(model: nn.Module, cache: torch.Tensor) -> tuple[int, int]:
    """(max_seq_len, sequences) of a multi-sequence cache: [layers, sequences, max_seq, width] (MLA's latent
    rows) or [layers, 2, sequences, max_seq, heads, head_dim]."""
    from .integrations.mla import uses_latent_cache

    return (cache.shape[2], cache.shape[1]) if uses_latent_cache(model) else (cache.shape[3], cache.shape[2])


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [n, vocab] → token ids [n], on the logits' device: greedy at temperature 0, else softmax sampling
    of ``logits / temperature`` over the ``top_k`` most likely tokens and, within those, the smallest set whose
    probability reaches ``top_p``."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    scores = logits.float() / temperature
    if top_k is not None and 0 < top_k < scores.shape[-1]:
        kth = scores.topk(top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        ordered, order = scores.sort(dim=-1, descending=True)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative - ordered.softmax(dim=-1) >= top_p  # tokens after the nucleus is full (the first stays)
        scores = scores.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
    return torch.multinomial(scores.softmax(dim=-1), 1, generator=generator).squeeze(-1)


def _stop_tokens(model: nn.Module, stop_tokens: Sequence[int] | None) -> set[int]:
    if stop_tokens is not None:
        return set(int(t) for t in stop_tokens)
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return set() if eos is None else {int(eos)} if isinstance(eos, int) else set(int(t) for t in eos)


_NEUTRAL = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "suppress_tokens": None, "begin_suppress_tokens":
            None, "bad_words_ids": None, "min_new_tokens": None, "min_length": 0, "num_beams": 1, "do_sample": False,
            "forced_bos_token_id": None, "forced_eos_token_id": None, "sequence_bias": None,
            "exponential_decay_length_penalty": None, "guidance_scale": None, "watermarking_config": None,
            "stop_strings": None, "penalty_alpha": None}
"""transformers' ``GenerationConfig`` fields ``generate`` does not apply, with the values that change nothing."""


def _warn_of_unapplied(model: nn.Module) -> None:
    """One warning naming the model's ``generation_config`` settings that change transformers' tokens and that
    ``generate`` does not apply (a repetition penalty; ``do_sample`` with its temperature, which a caller passes)."""
    config = getattr(model, "generation_config", None)
    if config is None:
        return
    set_ = {name: value for name, neutral in _NEUTRAL.items()
            if (value := getattr(config, name, None)) is not None and value != neutral}
    if not set_:
        return
    shown = ", ".join(f"{name}={value!r}" for name, value in set_.items())
    sampling = " (sampling: pass temperature, top_k and top_p to generate)" if set_.get("do_sample") else ""
    warnings.warn(
        f"piecewise.generate applies the temperature, top_k, top_p, seed and stop_tokens it is given and the model's "
        f"eos_token_id; model.generation_config also sets {shown}, which it does not apply{sampling}: its tokens "
        f"differ from transformers' generate with that config. Use transformers' generate for them, or clear them "
        f"(model.generation_config.{next(iter(set_))} = {_NEUTRAL[next(iter(set_))]!r}) to silence this.",
        stacklevel=caller_stacklevel())


def generate_stream(model: nn.Module, prompts: Sequence[torch.Tensor], max_new_tokens: int | Sequence[int], *,
                    temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                    seed: int | None = None, stop_tokens: Sequence[int] | None = None, max_batch: int = 32,
                    prefill_tokens: int = 8192, config: CaptureConfig | None = None) -> Iterator[tuple[int, int]]:
    """As ``generate``, yielding ``(prompt index, token id)`` as each token is sampled."""
    _warn_of_unapplied(model)
    limits = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(limits) != len(prompts):
        raise ValueError(f"max_new_tokens has {len(limits)} limits for {len(prompts)} prompts: give one, or one each")
    if any(not isinstance(limit, int) or limit < 0 for limit in limits):
        raise ValueError(f"max_new_tokens must be whole numbers of 0 or more, got {max_new_tokens!r}")
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocab = getattr(embeddings, "num_embeddings", None)
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, torch.Tensor) or prompt.dim() != 1 or prompt.numel() == 0:
            raise ValueError(f"prompt {i} must be a non-empty 1-D tensor of token ids, got "
                             f"{getattr(prompt, 'shape', type(prompt).__name__)}")
        if prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool:
            raise ValueError(f"prompt {i} holds {prompt.dtype} values: token ids are integers (torch.long)")
        low, high = (int(prompt.min()), int(prompt.max())) if vocab is not None else (0, 0)
        if low < 0 or (vocab is not None and high >= vocab):
            raise ValueError(f"prompt {i} holds token id {low if low < 0 else high}, outside the model's vocabulary "
                             f"of {vocab} (ids 0 to {vocab - 1})")
    if temperature < 0 or (top_p is not None and not 0 < top_p <= 1) or (top_k is not None and top_k < 1):
        raise ValueError(f"sampling settings out of range: temperature {temperature} (0 is greedy, more samples), "
                         f"top_p {top_p} (in (0, 1]), top_k {top_k} (1 or more); None leaves top_p / top_k out")
    if max_batch < 1 or prefill_tokens < 1:
        raise ValueError(f"max_batch and prefill_tokens must be positive, got {max_batch} and {prefill_tokens}")
    return _stream(model, prompts, limits, temperature, top_k, top_p, seed, stop_tokens, max_batch, prefill_tokens,
                   config) if prompts else iter(())


def _stream(model, prompts, limits, temperature, top_k, top_p, seed, stop_tokens, max_batch, prefill_tokens,
            config) -> Iterator[tuple[int, int]]:
    with _generating(model):
        yield from _generation(model, prompts, limits, temperature, top_k, top_p, seed, stop_tokens, max_batch,
                               prefill_tokens, config)


def _generation(model, prompts, limits, temperature, top_k, top_p, seed, stop_tokens, max_batch, prefill_tokens,
                config) -> Iterator[tuple[int, int]]:
    device = next(model.parameters()).device
    slots_count = min(max_batch, len(prompts))
    config = config or CaptureConfig(max_tokens=max(max_batch, 512))  # longer prefill calls run without graphs
    max_seq = max(len(p) + limit for p, limit in zip(prompts, limits))
    token_model, runner, cache = _runner(model, config, max_seq, slots_count)
    top = config.sizes[-1]  # the largest captured token count
    stops = _stop_tokens(model, stop_tokens)
    generator = None
    if temperature > 0:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed if seed is not None else torch.seed())
    waiting = deque(_Sequence(i, p.to(device, torch.long), limit) for i, (p, limit) in enumerate(zip(prompts, limits))
                    if limit > 0)
    free = list(range(slots_count - 1, -1, -1))
    running: list[_Sequence] = []
    with torch.inference_mode():
        while waiting or running:
            while waiting and free:
                sequence = waiting.popleft()
                sequence.slot = free.pop()
                running.append(sequence)
            ids, positions, slots, rows = _next_call(running, prefill_tokens)
            ids, positions, slots = torch.cat(ids), torch.cat(positions), torch.cat(slots)
            last = [row for row, _ in rows]
            if ids.shape[0] > top:  # a long prefill runs without graphs anyway: the output head on its last rows only
                rows_kept = torch.tensor(last, dtype=torch.long, device=device)  # long even when empty
                with runner_call(), runner.watch:  # as the runner's own call: what the forward assigns is its own
                    logits = token_model(ids, positions, cache, slots, logits_rows=rows_kept)
            else:
                logits = runner(ids, positions, cache, slots)[last]
            tokens = sample(logits, temperature, top_k, top_p, generator).tolist()
            for (_, sequence), token in zip(rows, tokens):
                sequence.tokens.append(token)
                yield sequence.index, token
                if token in stops or len(sequence.tokens) >= sequence.limit:
                    running.remove(sequence)
                    free.append(sequence.slot)


def _next_call(running: list[_Sequence], budget: int):
    """The next call's (ids, positions, slots, [(logits row, sequence) of the rows to sample]): prompt tokens of
    the sequences still prefilling, up to ``budget`` of them, or else one token of every running sequence."""
    ids, positions, slots, rows, used = [], [], [], [], 0
    prefilling = [s for s in running if s.prefilled < len(s.prompt)]
    for sequence in prefilling:
        if used == budget:
            break
        take = min(budget - used, len(sequence.prompt) - sequence.prefilled)
        start = sequence.prefilled
        ids.append(sequence.prompt[start : start + take])
        positions.append(torch.arange(start, start + take, device=sequence.prompt.device))
        slots.append(torch.full((take,), sequence.slot, device=sequence.prompt.device))
        used += take
        sequence.prefilled += take
        if sequence.prefilled == len(sequence.prompt):  # its last prompt token's logits give its first new token
            rows.append((used - 1, sequence))
    if prefilling:
        return ids, positions, slots, rows
    device = running[0].prompt.device
    columns = torch.tensor([[s.tokens[-1], s.position, s.slot] for s in running]).to(device)  # one host copy
    return [columns[:, 0]], [columns[:, 1]], [columns[:, 2]], list(enumerate(running))


def generate(model: nn.Module, prompts: Sequence[torch.Tensor], max_new_tokens: int | Sequence[int], *,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
             stop_tokens: Sequence[int] | None = None, max_batch: int = 32, prefill_tokens: int = 8192,
             config: CaptureConfig | None = None,
             on_token: Callable[[int, int], None] | None = None) -> list[torch.Tensor]:
    """The new tokens of each prompt (1-D tensors on the CPU, in the prompts' order) generated by ``model`` (a
    transformers causal LM; ``integrations.transformers.enable`` is applied if it was not). ``max_new_tokens``:
    one limit, or one per prompt. Greedy at ``temperature`` 0 (the default); otherwise sampled with ``top_k`` /
    ``top_p``, reproducibly for a given ``seed``. ``stop_tokens`` (default: the model's ``eos_token_id``) end a
    sequence and are kept. ``max_batch`` sequences share the KV cache's slots; ``prefill_tokens`` bounds a
    prefill call. ``config`` is the runner's (default ``CaptureConfig(max_tokens=max(max_batch, 512))``: graphs
    for decode steps and short prefills, a longer prefill call runs without them; on CUDA its first call measures
    eager and Inductor pieces, as every default config does). ``on_token(index,
    token)`` is called as each token comes (see also ``generate_stream``)."""
    out: list[list[int]] = [[] for _ in prompts]
    for index, token in generate_stream(model, prompts, max_new_tokens, temperature=temperature, top_k=top_k,
                                        top_p=top_p, seed=seed, stop_tokens=stop_tokens, max_batch=max_batch,
                                        prefill_tokens=prefill_tokens, config=config):
        out[index].append(token)
        if on_token is not None:
            on_token(index, token)
    return [torch.tensor(tokens, dtype=torch.long) for tokens in out]
