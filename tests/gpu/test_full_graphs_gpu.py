"""Full graphs on CUDA: one graph of the whole forward (attention inside) per size, replayed for decode batches
1..max+1 and prefills between them, bf16 outputs and KV caches equal to eager; the pad rows write nothing."""

import traceback
import warnings

import pytest
import torch

import piecewise
from piecewise.errors import ForwardRefused
from piecewise.models import example
from piecewise.models.decode import DecodeLlama
from piecewise.models.llama import LlamaConfig

pytestmark = pytest.mark.gpu

CONFIG = LlamaConfig(vocab_size=256, hidden_size=256, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=64,
                     intermediate_size=512, max_seq_len=128)


def rel_error(out, ref):
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
@pytest.mark.parametrize("frontend", ["breakable", "dynamo"])
def test_decode_batches_replay_full_graphs_and_prefills_between_them_run_piecewise(frontend, compiler):
    torch.manual_seed(0)
    model = DecodeLlama(CONFIG).to("cuda", torch.bfloat16).eval()
    cache = torch.randn(CONFIG.num_layers, 2, 16, CONFIG.num_kv_heads, CONFIG.max_seq_len, CONFIG.head_dim,
                        device="cuda", dtype=torch.bfloat16)
    reference = cache.clone()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=16, max_decode_batch=16,
                                                              frontend=frontend, compiler=compiler))
    with torch.no_grad():
        for batch in (5, *range(1, 17)):
            ids = torch.randint(0, 256, (batch,), device="cuda")
            positions = torch.randint(0, CONFIG.max_seq_len, (batch,), device="cuda")
            replays = runner.stats["full_replays"]
            out = runner(ids, positions, cache)
            ref = model(ids, positions, reference)
            assert rel_error(out, ref) <= 1e-2 and rel_error(cache, reference) <= 1e-2, batch
            assert runner.stats["full_replays"] == replays + 1, "a decode batch replays one full graph"
    # every call up to 16 tokens replays a full graph: no piecewise graph is captured (breakable compares the full
    # graphs' runs across sizes instead)
    runner.stats.expect(graph_mode="full_and_piecewise", cuda_graphs=True, full_sizes=[1, 2, 4, 8, 16],
                        full_only_sizes=[1, 2, 4, 8, 16], captured_sizes=[])
    assert runner.stats["full_graphs"] == 5


@pytest.mark.parametrize("frontend", ["breakable", "dynamo"])
def test_llama_mixed_prefill_and_decode_on_both_graph_families_equals_eager(frontend):
    model, (ids, positions, cache) = example(tokens=5, device="cuda", dtype=torch.bfloat16, num_layers=3)
    cache.normal_()
    reference = cache.clone()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=64, max_decode_batch=8, frontend=frontend))
    start = 0
    with torch.no_grad():
        for tokens in (5, 1, 1, 3, 30, 1, 8, 9, 64, 65, 2):
            ids = torch.randint(0, model.config.vocab_size, (tokens,), device="cuda")
            positions = (torch.arange(start, start + tokens, device="cuda")) % model.config.max_seq_len
            start += tokens
            out = runner(ids, positions, cache)
            ref = model(ids, positions, reference)
            assert rel_error(out, ref) <= 1e-2 and rel_error(cache, reference) <= 1e-2, tokens
    stats = runner.stats
    assert stats["full_replays"] > 0 and stats["replays"] > 0 and stats["full_graphs"] == 4
    sizes = piecewise.CaptureConfig(max_tokens=64).sizes
    # breakable keeps the piecewise graphs of 8: its run is what 16's is compared with (a path that depends on the
    # token count between them)
    full_only = [1, 2, 4, 8] if frontend == "dynamo" else [1, 2, 4]
    stats.expect(full_only_sizes=full_only, captured_sizes=[size for size in sizes if size not in full_only])
    report = runner.verify(ids, positions, cache)
    assert report.ok and [result.size for result in report.results] == sizes  # the full-only sizes too


@piecewise.opaque_op("full_graph_gpu_tests::not_whole_for_three", split=True,
                     capturable=lambda ctx: ctx.num_tokens != 3)
def not_whole_for_three(x: torch.Tensor) -> torch.Tensor:
    return x * 2


class NotWholeForThree(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x):
        return self.down(not_whole_for_three(self.up(x)))


@pytest.mark.parametrize("frontend", ["breakable", "dynamo"])
def test_a_size_whose_every_call_a_full_graph_serves_gets_no_piecewise_graphs(frontend):
    """Size 4 pads calls of 3 and 4 tokens; the op runs whole for 4 but not for 3, so size 4 keeps its piecewise
    graphs; sizes 1, 2 and 8 replay only their full graphs, and Dynamo captures no piecewise graphs for them.
    Breakable keeps those of 2, whose run its check of the forward's path compares with 4's piecewise run."""
    torch.manual_seed(0)
    model = NotWholeForThree().cuda()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend=frontend))
    with torch.no_grad():
        for tokens in (8, 1, 2, 3, 4, 5, 6, 7, 8):
            x = torch.randn(tokens, 16, device="cuda")
            full, replays = runner.stats["full_replays"], runner.stats["replays"]
            torch.testing.assert_close(runner(x), model(x))
            assert (runner.stats["full_replays"] == full + 1) == (tokens != 3), tokens
            assert runner.stats["replays"] > replays, tokens
    full_only = [1, 2, 8] if frontend == "dynamo" else [1, 8]
    runner.stats.expect(graph_mode="full_and_piecewise", full_sizes=[1, 2, 4, 8], full_only_sizes=full_only,
                        captured_sizes=[size for size in (1, 2, 4, 8) if size not in full_only])


@piecewise.opaque_op("full_graph_gpu_tests::whole_scale", split=True, capturable=True)
def whole_scale(x: torch.Tensor) -> torch.Tensor:
    return x * 2


class BranchesOnTheCount(NotWholeForThree):
    """Takes another path above 5 tokens: a call of 5 padded to 8 would take the path of 8."""

    def forward(self, x):
        h = whole_scale(self.up(x))
        if x.shape[0] > 5:
            h = h.relu()
        return self.down(h)


@pytest.mark.parametrize("max_decode_batch", [8, 4])
def test_breakable_compares_full_graph_runs_across_sizes_and_refuses_a_branch_on_the_count(max_decode_batch):
    """Breakable captures no piecewise graphs for the sizes its full graphs serve alone, so its check of the
    forward's path across sizes compares the full graphs' runs (8: every size is full-only), and, at the edge, the
    piecewise runs of the largest full size and the next (4: 4 keeps its piecewise graphs for that)."""
    torch.manual_seed(0)
    model = BranchesOnTheCount().cuda()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, max_decode_batch=max_decode_batch,
                                                              frontend="breakable"))
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught, \
            pytest.raises(ForwardRefused, match="another path at 4 tokens than at 8") as info:
        warnings.simplefilter("always")
        runner(torch.randn(8, 16, device="cuda"))
    assert info.value.kind == "token_branch"
    # refused where the full graphs' runs are compared (8: no piecewise run exists), not after turning them off
    assert not [str(w.message) for w in caught if "full graphs are off" in str(w.message)]
    assert "full_graphs.py" in "".join(traceback.format_tb(info.tb)) or max_decode_batch == 4


@piecewise.opaque_op("full_graphs_gpu::syncing_scale", split=True, capturable=True)
def syncing_scale(x: torch.Tensor) -> torch.Tensor:
    """Claims it can run inside a full graph, but waits for the device (illegal while capturing)."""
    torch.cuda.synchronize()
    return x * 2


class SyncsInsideTheFullGraph(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.linear(syncing_scale(self.linear(x)))


@pytest.mark.parametrize("frontend", ["breakable", "dynamo"])
def test_a_full_graph_capture_that_fails_to_end_turns_full_graphs_off_and_the_pieces_capture_in_a_fresh_pool(
        frontend):
    """The sync invalidates the full graph's capture, which torch leaves recording to the pool: the pool is
    retired, full graphs are turned off with one warning, and every piecewise size captures in a fresh pool (the
    splitting op runs eagerly between the pieces), equal to eager."""
    torch.manual_seed(0)
    model = SyncsInsideTheFullGraph().cuda().eval()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend=frontend,
                                                              graph_mode="full_and_piecewise"))
    with torch.no_grad():
        with pytest.warns(UserWarning, match=r"full graphs are off.*cannot be captured whole"):
            out = runner(torch.randn(3, 16, device="cuda"))
        for tokens in range(1, 10):
            x = torch.randn(tokens, 16, device="cuda")
            assert rel_error(runner(x), model(x)) <= 1e-5, tokens
    sizes = piecewise.CaptureConfig(max_tokens=8).sizes
    # After the retired pool every size warms up (breakable too): no size risks a third pool.
    runner.stats.expect(graph_mode="piecewise", cuda_graphs=True, full_graphs=0, captured_sizes=sizes,
                        warmed_sizes=sizes)
    assert out.shape == (3, 16) and runner.stats["replays"] > 0
    assert len(runner.state.retired_pools) == 1
    assert torch.randn(2, device="cuda").isfinite().all(), "random draws on the device work after the failure"


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
@pytest.mark.parametrize("frontend", ["breakable", "dynamo"])
def test_a_gpt_fast_model_replays_exact_full_graphs_for_counts_on_the_ladder(frontend, compiler):
    """Cache writes in buffers (``self.k[:, :, pos] = k``) and no splitting op: each full graph holds the writes
    and replays only for a call of its size; the first call (3 tokens) leaves the sizes above it captured with its
    rows repeated, which write the same cache rows again. Outputs and caches equal eager; the other counts replay
    piecewise graphs."""
    from fixtures.state_models import BatchFirstCache

    torch.manual_seed(0)
    model = BatchFirstCache(max_seq=64).cuda().eval()
    ids = torch.randint(0, 100, (1, 40), device="cuda")
    counts = (3, 1, 1, 4, 5, 2, 8, 7, 1)

    def generate(call):
        for layer in model.layers:
            layer.k.zero_()
            layer.v.zero_()
        outputs, start, full = [], 0, []
        with torch.no_grad():
            for count in counts:
                replays = getattr(call, "stats", {}).get("full_replays", 0)
                outputs.append(call(ids[:, start:start + count], torch.arange(start, start + count, device="cuda")))
                full.append(getattr(call, "stats", {}).get("full_replays", 0) - replays)
                start += count
        return outputs, [t.clone() for layer in model.layers for t in (layer.k, layer.v)], full

    expected, expected_cache, _ = generate(model)
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend=frontend, compiler=compiler,
                                                              cache_dir=None))
    got, cache, full = generate(runner)
    for g, e in zip(got, expected):
        assert rel_error(g, e) <= 1e-4
    for a, b in zip(cache, expected_cache):
        assert rel_error(a, b) <= 1e-4
    assert full == [0, 1, 1, 1, 0, 1, 1, 0, 1], full
    runner.stats.expect(graph_mode="full_and_piecewise", cuda_graphs=True, full_sizes=[1, 2, 4, 8], full_graphs=4)
    assert runner.stats["replays"] > sum(full)  # the padded counts replayed piecewise graphs


class _BatchOfOne(DecodeLlama):
    """Logits returned as [1, T, V] (transformers' layout), [T, V] beside them in a tuple."""

    def forward(self, input_ids, positions, kv_cache):
        logits = super().forward(input_ids, positions, kv_cache)
        return logits[None], logits


@pytest.mark.parametrize("frontend", ["breakable", "dynamo"])
def test_outputs_whose_token_dimension_is_not_the_first_are_cut_after_a_full_replay(frontend):
    """A full graph's replay runs no front-end: each output is cut along the token dimension recorded at its
    capture ([1, T, V] to [1, 3, V] from a 4-token graph), and the padding check keeps full graphs for it."""
    torch.manual_seed(0)
    model = _BatchOfOne(CONFIG).to("cuda", torch.bfloat16).eval()
    cache = torch.zeros(CONFIG.num_layers, 2, 16, CONFIG.num_kv_heads, CONFIG.max_seq_len, CONFIG.head_dim,
                        device="cuda", dtype=torch.bfloat16)
    reference = cache.clone()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=16, max_decode_batch=16,
                                                              frontend=frontend))
    with torch.no_grad():
        for batch in (5, 3, 7, 1):
            ids = torch.randint(0, 256, (batch,), device="cuda")
            positions = torch.randint(0, CONFIG.max_seq_len, (batch,), device="cuda")
            replays = runner.stats["full_replays"]
            batched, flat = runner(ids, positions, cache)
            want_batched, want_flat = model(ids, positions, reference)
            assert batched.shape == (1, batch, CONFIG.vocab_size) and flat.shape == (batch, CONFIG.vocab_size)
            assert rel_error(batched, want_batched) <= 1e-2 and rel_error(flat, want_flat) <= 1e-2, batch
            if batch != 5:
                assert runner.stats["full_replays"] == replays + 1, dict(runner.stats)


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_a_flag_flipped_after_the_first_call_is_seen_before_a_full_graph_replays(compiler):
    """A full graph's replay runs no Dynamo code: the guards of the first call's trace are checked before it, and a
    call whose model state fails them (a flag an engine sets for sampling steps) runs the model's own forward, with
    one warning, instead of replaying the old path."""
    import warnings

    from piecewise.models.llama import TinyLlama

    class Flagged(TinyLlama):
        last_only = False

        def forward(self, input_ids, positions, kv_cache):
            logits = super().forward(input_ids, positions, kv_cache)
            return logits[-1:] if self.last_only else logits

    config = LlamaConfig(vocab_size=64, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                         intermediate_size=128, max_seq_len=64)
    torch.manual_seed(0)
    model = Flagged(config).cuda().eval()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=16, frontend="dynamo", compiler=compiler))
    cache, reference = model.make_kv_cache(), model.make_kv_cache()
    ids, start = torch.randint(0, 64, (64,), device="cuda"), 0
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for index, tokens in enumerate([5, 1, 3, 1, 5, 2]):
            if index == 3:
                model.last_only = True
            positions = torch.arange(start, start + tokens, device="cuda")
            out = runner(ids[start:start + tokens], positions, cache)
            want = model(ids[start:start + tokens], positions, reference)
            assert out.shape == want.shape and rel_error(out, want) <= 2e-3, (index, tokens)
            start += tokens
    assert runner.stats["full_graphs"] > 0 and runner.stats["full_replays"] > 0
    assert runner.stats["eager_calls"] >= 2
    assert sum("model's own forward" in str(w.message) for w in caught) == 1
