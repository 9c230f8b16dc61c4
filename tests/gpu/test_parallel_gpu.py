"""Tensor parallelism on two GPUs: NCCL all-reduces between captured pieces, bf16 and NVFP4 weights."""

import contextlib
import datetime
import faulthandler
import os
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import piecewise
from piecewise.kernels.nvfp4 import quantize_linears
from piecewise.models import example
from piecewise.models.llama import tensor_parallel_llama

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]

CONFIG = dict(num_layers=2, hidden_size=256, num_heads=8, num_kv_heads=4, head_dim=32, intermediate_size=512)


def rel_error(out, ref):
    return float((out.float() - ref.float()).norm() / ref.float().norm())


@contextlib.contextmanager
def _rank(rank: int, init_file: str):
    """This process as rank ``rank`` of a two-rank NCCL group, with hangs turned into failures: collectives time
    out after 90 s, and a rank still running after 240 s prints every thread's stack and exits. A failed rank
    exits at once, since tearing its group down would wait on collectives the other rank never joins (the
    other rank then fails on its timeout)."""
    torch.cuda.set_device(rank)
    faulthandler.dump_traceback_later(240, exit=True)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            device_id=torch.device("cuda", rank), timeout=datetime.timedelta(seconds=90))
    try:
        yield
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    faulthandler.cancel_dump_traceback_later()
    dist.destroy_process_group()  # the runners released their graphs: NCCL waits for graphs holding its collectives


def _spawn(worker, *args) -> None:
    """``worker(rank, init_file, *args)`` on two processes, one per GPU."""
    with tempfile.TemporaryDirectory() as directory:
        mp.spawn(worker, args=(os.path.join(directory, "init"), *args), nprocs=2, join=True)


def _sharded_runs(model, ids, positions, shard):
    """The whole model's logits at 16, 5 and 1 tokens; then ``shard(model)`` and the piecewise runner's (CUDA
    graphs, a zeroed cache each call). Returns (expected, outputs, runner)."""
    with torch.no_grad():
        expected = {t: model(ids[:t], positions[:t], model.make_kv_cache()) for t in (16, 5, 1)}
    shard(model)
    cache = model.make_kv_cache()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=16))
    outputs = {}
    with torch.no_grad():
        for tokens in expected:
            cache.zero_()
            outputs[tokens] = runner(ids[:tokens], positions[:tokens], cache)
    return expected, outputs, runner


def _worker(rank: int, init_file: str, nvfp4: bool, in_graph: bool) -> None:
    with _rank(rank, init_file):
        model, (ids, positions, _) = example(tokens=16, device="cuda", dtype=torch.bfloat16, **CONFIG)
        if nvfp4:
            quantize_linears(model)
        expected, outs, runner = _sharded_runs(model, ids, positions,
                                               lambda m: tensor_parallel_llama(m, capture_all_reduce=in_graph))
        for tokens, out in outs.items():
            assert rel_error(out, expected[tokens]) <= 1e-2, (rank, tokens, rel_error(out, expected[tokens]))
        stats = runner.stats
        pieces = 3 if in_graph else 7  # the NCCL all-reduces inside the graphs, or between them
        assert stats["cuda_graphs"] is True and stats["pieces"] == pieces, stats
        assert stats["graphs"] == pieces * len(stats["captured_sizes"]) and stats["replays"] > 0, stats
        runner.release_graphs()  # before the group goes


@pytest.mark.parametrize("nvfp4,in_graph", [(False, False), (True, False), (False, True)],
                         ids=["bf16", "nvfp4", "bf16-all-reduce-captured"])
def test_two_gpus_equal_the_whole_model(nvfp4, in_graph):
    _spawn(_worker, nvfp4, in_graph)


def per_token_median(out, ref):
    return float(((out.float() - ref.float()).norm(dim=-1) / ref.float().norm(dim=-1)).median())


def _transformers_worker(rank: int, init_file: str, nvfp4: bool) -> None:
    import transformers

    from piecewise.integrations.transformers import TokenModel, enable, quantize
    from piecewise.integrations.transformers import tensor_parallel as hf_tensor_parallel

    with _rank(rank, init_file):
        torch.manual_seed(0)
        config = transformers.Glm4MoeConfig(
            vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, n_routed_experts=16, num_experts_per_tok=4,
            n_group=4, topk_group=2, first_k_dense_replace=1, attention_bias=True, use_qk_norm=True)
        dtype = torch.bfloat16 if nvfp4 else torch.float32  # NVFP4 needs 16-bit activations
        model = transformers.Glm4MoeForCausalLM(config).to(device="cuda", dtype=dtype).eval()
        model.config._experts_implementation = "eager"
        for module in model.modules():
            if type(module).__name__ == "Glm4MoeTopkRouter":  # spread the scores: no near ties to flip
                torch.nn.init.normal_(module.weight, std=0.5)
        ids = torch.randint(0, 512, (12,), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        token_model = TokenModel(enable(model))
        if nvfp4:
            quantize(model, grouped_experts=True)
        with torch.no_grad():
            expected = token_model(ids, torch.arange(12, device="cuda"))
        hf_tensor_parallel(model, capture_all_reduce=True)
        cache = token_model.make_kv_cache(max_seq_len=32)
        runner = piecewise.compile(token_model, piecewise.CaptureConfig(max_tokens=16))
        with torch.no_grad():
            logits = [runner(ids[:8], torch.arange(8, device="cuda"), cache)]
            for position in range(8, 12):
                logits.append(runner(ids[position : position + 1], torch.tensor([position], device="cuda"), cache))
        logits = torch.cat(logits)
        if nvfp4:  # bf16: the sharded sums round differently, and a near tie may swap a token's experts
            assert per_token_median(logits, expected) <= 2e-2, rank
        else:
            assert rel_error(logits, expected) <= 1e-4, rank
        assert runner.stats["replays"] > 0
        runner.release_graphs()


@pytest.mark.parametrize("nvfp4", [False, True], ids=["fp32", "nvfp4-grouped-experts"])
def test_a_transformers_glm_moe_on_two_gpus_equals_the_whole_model(nvfp4):
    pytest.importorskip("transformers")
    _spawn(_transformers_worker, nvfp4)


def _glm_moe_worker(rank: int, init_file: str, nvfp4: bool) -> None:
    from piecewise.models.glm_moe import GlmMoE, example, quantize_experts, tensor_parallel_glm_moe

    with _rank(rank, init_file):
        model, (ids, positions, _) = example(tokens=16, device="cuda", dtype=torch.bfloat16 if nvfp4 else torch.float32,
                                             num_layers=3, hidden_size=256, moe_intermediate_size=64)
        for module in model.modules():
            if isinstance(module, GlmMoE):  # spread the router scores: no near tie for a rounding to flip
                torch.nn.init.normal_(module.router.weight, std=0.5)
        if nvfp4:
            quantize_experts(model)
            quantize_linears(model, skip=("lm_head", "router"))
        expected, outs, runner = _sharded_runs(model, ids, positions,
                                               lambda m: tensor_parallel_glm_moe(m, capture_all_reduce=True))
        for tokens, out in outs.items():
            assert per_token_median(out, expected[tokens]) <= (2e-2 if nvfp4 else 1e-4), (rank, tokens)
        assert runner.stats["cuda_graphs"] is True and runner.stats["replays"] > 0
        runner.release_graphs()


@pytest.mark.parametrize("nvfp4", [False, True], ids=["fp32", "nvfp4-grouped"])
def test_the_glm_moe_example_on_two_gpus_equals_the_whole_model(nvfp4):
    """The example GLM-MoE sharded (routed and shared experts by their intermediate dimension), all-reduces
    captured in the graphs."""
    _spawn(_glm_moe_worker, nvfp4)
