"""The breakable front-end on CUDA graphs: graphs really captured and replayed, equal to eager (outputs and KV
caches) for every place a JIT-style call sits and every kind of splitting op; clear errors for what capture
cannot do."""

import os
import sys
import threading

import pytest
import torch
from torch.utils._python_dispatch import _disable_current_modes

import piecewise
from piecewise.models import example
from piecewise.models.llama import RMSNorm

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures"))
import break_models as bm  # noqa: E402

pytestmark = pytest.mark.gpu

MAX_TOKENS = 8


def rel_error(out, ref):
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


@pytest.mark.parametrize("mode", ["grad", "no_grad", "inference_mode"])
@pytest.mark.parametrize("attention", bm.ATTENTION)
@pytest.mark.parametrize("jit_at", bm.PLACES)
def test_breakable_graphs_equal_eager_for_every_place_op_kind_and_size(jit_at, attention, mode):
    model = bm.make(jit_at, attention, device="cuda")
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=MAX_TOKENS, frontend="breakable"))
    grad = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[mode]
    ours, theirs = model.make_cache(), model.make_cache()
    with grad():
        for tokens in range(1, MAX_TOKENS + 2):
            ours.zero_(), theirs.zero_()
            for positions in (torch.arange(tokens), torch.tensor([tokens]), torch.tensor([tokens + 1])):
                positions = positions.cuda()
                ids = torch.randint(0, 64, positions.shape, device="cuda")
                replays = runner.stats["replays"]
                out = runner(ids, positions, ours)
                with torch.no_grad():
                    ref = model(ids, positions, theirs)
                assert rel_error(out, ref) <= 1e-5, (tokens, positions)
                assert rel_error(ours, theirs) <= 1e-5, (tokens, positions)
                if positions.numel() <= MAX_TOKENS:
                    assert runner.stats["replays"] > replays, "a call within the graphs replays them"
    # Host work that runs every call (the subprocess, the lock) is no first-use work: only the first size warms up.
    runner.stats.expect(frontend="breakable", traces=0, cuda_graphs=True, warmed_sizes=[MAX_TOKENS],
                        captured_sizes=piecewise.CaptureConfig(max_tokens=MAX_TOKENS).sizes)
    assert runner.stats["graphs"] >= (model.num_layers + 1) * len(runner.stats["captured_sizes"])


class LockedNorm(RMSNorm):
    """The seed's case: a lock taken in RMSNorm.forward (as a JIT library's first-use check does)."""

    lock = threading.Lock()

    def forward(self, x):
        with self.lock:
            return super().forward(x)


@pytest.mark.parametrize("frontend", ["auto", "breakable"])
def test_the_bundled_llama_with_a_lock_in_its_norm_runs_on_graphs_in_bf16(frontend):
    model, (ids, positions, cache) = example(tokens=5, device="cuda", dtype=torch.bfloat16, num_layers=3)
    for layer in model.layers:
        norm = LockedNorm(model.config.hidden_size).to("cuda", torch.bfloat16)
        norm.load_state_dict(layer.input_norm.state_dict())
        layer.input_norm = norm
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=32, frontend=frontend))
    with torch.no_grad():
        for tokens in (5, 1, 17, 32, 33):
            ids = torch.randint(0, model.config.vocab_size, (tokens,), device="cuda")
            positions = torch.arange(tokens, device="cuda") + 3
            reference = cache.clone()
            out = runner(ids, positions, cache)
            ref = model(ids, positions, reference)
            assert rel_error(out, ref) <= 1e-2 and rel_error(cache, reference) <= 1e-2, tokens
    runner.stats.expect(frontend="breakable", cuda_graphs=True, traces=0)
    assert runner.stats["replays"] > 0


def test_glm_moe_bf16_and_nvfp4_on_breakable_graphs():
    from piecewise.models.glm_moe import example as glm_example
    from piecewise.models.glm_moe import quantize_experts

    for nvfp4 in (False, True):
        model, (ids, positions, cache) = glm_example(tokens=6, device="cuda", dtype=torch.bfloat16)
        if nvfp4:
            quantize_experts(model)
        runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=16, frontend="breakable"))
        with torch.no_grad():
            for tokens in (6, 1, 11, 16):
                ids = torch.randint(0, model.config.vocab_size, (tokens,), device="cuda")
                positions = torch.arange(tokens, device="cuda")
                reference = cache.clone()
                out = runner(ids, positions, cache)
                ref = model(ids, positions, reference)
                assert rel_error(out, ref) <= 1e-2, (nvfp4, tokens)
        runner.stats.expect(frontend="breakable", cuda_graphs=True)
        assert runner.stats["replays"] > 0


def test_transformers_glm_moe_on_breakable_graphs_equals_transformers():
    pytest.importorskip("transformers")
    sys.path.insert(0, os.path.dirname(__file__))
    from test_transformers_gpu import glm_moe

    from piecewise.integrations.transformers import TokenModel, enable

    model = glm_moe()  # float32: routing is discontinuous, so compare where roundings agree
    inputs = {t: torch.randint(0, 512, (t,), device="cuda") for t in (1, 7, 32)}
    with torch.no_grad():
        expected = {t: model(input_ids=ids[None], use_cache=False).logits[0] for t, ids in inputs.items()}
    runner = piecewise.compile(TokenModel(enable(model)), piecewise.CaptureConfig(max_tokens=32, frontend="breakable"))
    with torch.no_grad():
        for tokens, ids in inputs.items():
            out = runner(ids, torch.arange(tokens, device="cuda"))
            assert rel_error(out, expected[tokens]) <= 1e-4, tokens
    runner.stats.expect(frontend="breakable", cuda_graphs=True, traces=0)
    assert runner.stats["replays"] > 0


class ValueBranch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.linear(x)
        if h.sum() > 0:  # a branch on a tensor's value
            h = h * 2
        return h


def test_a_branch_on_a_tensor_value_is_a_clear_error_naming_the_line():
    runner = piecewise.compile(ValueBranch().cuda(), piecewise.CaptureConfig(max_tokens=4, frontend="breakable"))
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"(?s)capture_illegal.*test_breakable_gpu.py:\d+ "
                                                            r"\(`if h.sum\(\) > 0:.*waits for the device"):
        runner(torch.randn(3, 8, device="cuda"))
    torch.cuda.synchronize()  # the CUDA context survived, random draws on the device too
    assert torch.ones(2, device="cuda").sum().item() == 2 and torch.randn(2, device="cuda").isfinite().all()


@piecewise.opaque_op("breakable_gpu::scale", split=True)
def scale(x: torch.Tensor) -> torch.Tensor:
    return x * 3


class ForkedStream(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.side = None

    def forward(self, x):
        self.side = self.side or torch.cuda.Stream()
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            h = self.linear(x)  # never joined back before the splitting op
        return scale(h)


class GenericStreamFork(ForkedStream):
    """A fork through torch's device-generic stream API (``torch.Stream``, ``torch.Event``), which piecewise does not
    see: the capture cannot end at the splitting op."""

    def forward(self, x):
        self.side = self.side or torch.Stream(device="cuda")
        event = torch.Event(device="cuda")
        event.record(torch.cuda.current_stream())
        self.side.wait_event(event)
        with self.side:  # torch.Stream as the current stream
            h = self.linear(x)
        return scale(h)


def test_a_side_stream_left_open_at_a_splitting_op_is_joined_there_and_one_piecewise_cannot_see_is_a_clear_error():
    model = ForkedStream().cuda()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=4, frontend="breakable"))
    with torch.no_grad():
        for tokens in (3, 1, 4, 2):
            x = torch.randn(tokens, 8, device="cuda")
            # the model's own forward races (the op reads h before the side stream may have written it): the
            # reference is what it means, the linear layer then the op
            assert rel_error(runner(x), scale(model.linear(x))) <= 1e-6
    assert runner.stats["replays"] > 0
    if not hasattr(torch, "Event") or not hasattr(torch.Stream, "__enter__"):
        return
    runner = piecewise.compile(GenericStreamFork().cuda(), piecewise.CaptureConfig(max_tokens=4, frontend="breakable"))
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"(?s)capture_illegal.*(cannot be closed|could not "
                                                            r"record).*(join it|join side streams)"):
        runner(torch.randn(3, 8, device="cuda"))
    torch.cuda.synchronize()
    assert torch.randn(2, device="cuda").isfinite().all(), "random draws on the device work after the failure"


class ReadsPositions(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x, positions):
        end = int(positions.max()) + 1  # per-call metadata read into Python outside a splitting op
        return self.linear(x) * end


def test_per_call_metadata_read_into_python_outside_a_splitting_op_is_named_with_its_line():
    runner = piecewise.compile(ReadsPositions().cuda(), piecewise.CaptureConfig(max_tokens=4, frontend="breakable"))
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"(?s)capture_illegal.*test_breakable_gpu.py:\d+ "
                                                            r"\(`end = int\(positions.max\(\)\) \+ 1"):
        runner(torch.randn(3, 8, device="cuda"), torch.arange(3, device="cuda"))


class Switch(torch.nn.Module):
    """A Python-side decision: ``self.double`` is read while the forward runs, so capture freezes its value."""

    def __init__(self):
        super().__init__()
        self.inner = bm.make(None, "no_cache", device="cuda")
        self.double = False

    def forward(self, input_ids, positions, cache):
        logits = self.inner(input_ids, positions, cache)
        return logits * 2 if self.double else logits


@pytest.mark.parametrize("frontend", ["breakable", "dynamo"])
def test_verify_on_cuda_graphs_passes_a_correct_model_and_catches_a_decision_frozen_at_capture(frontend):
    model = Switch()
    cache = model.inner.make_cache()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend=frontend))
    with torch.no_grad():
        runner(torch.randint(0, 64, (5,), device="cuda"), torch.arange(5, device="cuda"), cache)
    before = cache.clone()
    report = runner.verify()
    assert report.ok and report.cuda_graphs, str(report)
    assert torch.equal(cache, before)
    model.double = True  # the graphs keep the old branch; eager takes the new one
    if frontend == "breakable":  # the forward read the attribute at capture: its next replay refuses, naming it
        with pytest.raises(ValueError, match=r"`double` was assigned after the first call, and the forward reads it"):
            runner.verify()
    else:  # Dynamo guards on the attribute: the changed forward is traced again and runs without graphs
        assert runner.verify().ok


def test_a_cache_write_in_plain_code_is_cut_out_of_every_captured_size():
    """Sizes up to the first call's token count are captured with no pad rows; their graphs then serve calls
    with fewer tokens, whose pad rows must not write the cache."""
    model = bm.make(None, "reads_cache", device="cuda")
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend="breakable"))
    ours, theirs = model.make_cache(), model.make_cache()
    with torch.no_grad():
        for positions in (torch.arange(8), torch.arange(8, 11), torch.tensor([11])):
            positions = positions.cuda()
            ids = torch.randint(0, 64, positions.shape, device="cuda")
            assert rel_error(runner(ids, positions, ours), model(ids, positions, theirs)) <= 1e-5
            assert rel_error(ours, theirs) <= 1e-5


def test_a_splitting_op_output_without_token_rows_is_replayed_into_a_fixed_buffer():
    sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
    from test_breakable import Quantized

    model = Quantized().cuda()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend="breakable"))
    with torch.no_grad():
        for tokens in (5, 8, 5, 3, 1):
            x = torch.randn(tokens, 8, device="cuda")
            assert rel_error(runner(x), model(x)) <= 1e-5, tokens
    assert runner.stats["replays"] > 0


class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x, bias=None, scale: float = 1.0):
        h = scale_op(self.linear(x)) * scale
        return h + bias if bias is not None else h


@piecewise.opaque_op("breakable_gpu::scale_op", split=True)
def scale_op(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_a_call_with_other_arguments_than_the_capture_runs_without_graphs_with_one_warning():
    model = Scaled().cuda()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend="breakable"), dynamic={"x": 0})
    x, bias = torch.randn(5, 8, device="cuda"), torch.randn(8, device="cuda")
    with torch.no_grad():
        runner(x)
        with pytest.warns(UserWarning, match=r"argument 'scale' is given now and was not at the first call"):
            assert rel_error(runner(x, scale=3.0), model(x, scale=3.0)) <= 1e-6
        assert rel_error(runner(x, bias), model(x, bias)) <= 1e-6
        assert rel_error(runner(x), model(x)) <= 1e-6


class TunedOnFirstUse(torch.nn.Module):
    """A kernel library's layer: at its first call for each token count it tunes (a device synchronisation,
    ``sync``) and uploads a table for that count (a host-to-device copy), both illegal while a CUDA graph captures.
    The sync invalidates the capture; the upload alone is refused by torch before it reaches the stream."""

    def __init__(self, inner: torch.nn.Module, sync: bool):
        super().__init__()
        self.inner, self.sync = inner, sync
        self.tables: dict[int, torch.Tensor] = {}
        self.first_use_in_capture: list[int] = []

    def forward(self, x):
        tokens = x.shape[0]
        if tokens not in self.tables:
            if torch.cuda.is_current_stream_capturing():  # a piecewise segment's capture or a full graph's
                self.first_use_in_capture.append(tokens)
            if self.sync:
                torch.cuda.synchronize()
            with _disable_current_modes():  # the library's own code, as a C++ extension's: no op the forward sees
                self.tables[tokens] = torch.ones(x.shape[-1], dtype=x.dtype).to(x.device)  # a host table uploaded
        return self.inner(x) * self.tables[tokens]


@pytest.mark.parametrize("work", ["sync", "upload"])
@pytest.mark.parametrize("graph_mode", ["piecewise", "full_and_piecewise"])
def test_first_use_host_work_at_each_size_fails_its_capture_then_runs_in_a_warm_up_and_every_size_is_captured(
        graph_mode, work):
    """Breakable warms up only the first size; first-use host work at a later size (a tuning sync, an upload)
    fails that size's capture, and the size runs padded, then captures. A sync leaves the pool unusable: the
    retry and every later size warm up in a fresh pool. An upload refused before it reached the stream leaves
    the pool usable: only the sizes that failed warm up. Full graphs follow the same rule (captured first, they
    meet the first uses); in full graphs and piecewise ones, every size gets its graphs, equal to eager."""
    from piecewise.models.llama import LlamaConfig, TinyLlama

    config = LlamaConfig(vocab_size=64, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                         intermediate_size=128, max_seq_len=32)
    torch.manual_seed(0)
    model = TinyLlama(config).to("cuda").eval()
    model.norm = TunedOnFirstUse(model.norm, sync=work == "sync")
    cache = model.make_kv_cache()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=MAX_TOKENS, frontend="breakable",
                                                              graph_mode=graph_mode))
    reference = cache.clone()
    with torch.no_grad():
        for tokens in (MAX_TOKENS, 1, 3, 5, 7):
            ids = torch.randint(0, 64, (tokens,), device="cuda")
            positions = torch.arange(tokens, device="cuda") + tokens
            replays = runner.stats["replays"]
            out = runner(ids, positions, cache)
            ref = model(ids, positions, reference)
            assert rel_error(out, ref) <= 1e-5 and rel_error(cache, reference) <= 1e-5, tokens
            assert runner.stats["replays"] > replays, tokens
    sizes = piecewise.CaptureConfig(max_tokens=MAX_TOKENS).sizes
    # Sizes met first in their capture (not in the first call, the padding check or a full graph's warm-up)
    # failed it once.
    failed = model.norm.first_use_in_capture
    assert failed or graph_mode != "piecewise", "no size met its first use in its capture: nothing was tested"
    retired = bool(failed) and work == "sync"
    warmed = sorted({MAX_TOKENS, *failed, *(size for size in sizes if retired and size <= failed[0])})
    if graph_mode == "full_and_piecewise":  # the full graphs met every first use and serve every size alone
        runner.stats.expect(full_warmed_sizes=warmed, warmed_sizes=[], captured_sizes=[], full_only_sizes=sizes)
    else:
        runner.stats.expect(warmed_sizes=warmed, full_warmed_sizes=[], captured_sizes=sizes)
    runner.stats.expect(frontend="breakable", graph_mode=graph_mode,
                        full_graphs=len(sizes) if graph_mode == "full_and_piecewise" else 0)
    assert len(runner.state.retired_pools) == int(retired)
    assert runner.stats["pool_bytes"] > 0
    assert torch.randn(2, device="cuda").isfinite().all(), "random draws on the device work after the failures"
