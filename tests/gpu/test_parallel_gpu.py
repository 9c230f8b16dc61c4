"""Tensor parallelism on two GPUs: NCCL all-reduces between captured pieces, bf16 and NVFP4 weights."""

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


def _join(rank: int, init_file: str) -> None:
    """Join the two-rank NCCL group, with a hang turned into a failure: collectives time out after 90 s, and
    a rank still running after 240 s prints every thread's stack and exits."""
    torch.cuda.set_device(rank)
    faulthandler.dump_traceback_later(240, exit=True)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            device_id=torch.device("cuda", rank), timeout=datetime.timedelta(seconds=90))


def _leave(failed: bool) -> None:
    """A failed rank exits at once: tearing its group down would wait on collectives the other rank never
    joins (the other rank then fails on its collective timeout)."""
    faulthandler.cancel_dump_traceback_later()
    if failed:
        traceback.print_exc()
        os._exit(1)
    dist.destroy_process_group()


def _worker(rank: int, init_file: str, nvfp4: bool, in_graph: bool) -> None:
    _join(rank, init_file)
    failed = True
    try:
        model, (ids, positions, _) = example(tokens=16, device="cuda", dtype=torch.bfloat16, **CONFIG)
        if nvfp4:
            quantize_linears(model)
        with torch.no_grad():
            expected = {t: model(ids[:t], positions[:t], model.make_kv_cache()) for t in (1, 5, 16)}
        tensor_parallel_llama(model, capture_all_reduce=in_graph)
        cache = model.make_kv_cache()
        runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=16))
        with torch.no_grad():
            for tokens in (16, 5, 1):
                cache.zero_()
                out = runner(ids[:tokens], positions[:tokens], cache)
                assert rel_error(out, expected[tokens]) <= 1e-2, (rank, tokens, rel_error(out, expected[tokens]))
        stats = runner.stats
        pieces = 3 if in_graph else 7  # the NCCL all-reduces inside the graphs, or between them
        assert stats["cuda_graphs"] is True and stats["pieces"] == pieces, stats
        assert stats["graphs"] == pieces * len(stats["captured_sizes"]) and stats["replays"] > 0, stats
        runner.release_graphs()  # before the group goes: NCCL waits for graphs holding its collectives
        failed = False
    finally:
        _leave(failed)


@pytest.mark.parametrize("nvfp4,in_graph", [(False, False), (True, False), (False, True)],
                         ids=["bf16", "nvfp4", "bf16-all-reduce-captured"])
def test_two_gpus_equal_the_whole_model(nvfp4, in_graph):
    with tempfile.TemporaryDirectory() as directory:
        mp.spawn(_worker, args=(os.path.join(directory, "init"), nvfp4, in_graph), nprocs=2, join=True)


def per_token_median(out, ref):
    return float(((out.float() - ref.float()).norm(dim=-1) / ref.float().norm(dim=-1)).median())


def _transformers_worker(rank: int, init_file: str, nvfp4: bool) -> None:
    import transformers

    from piecewise.integrations.transformers import TokenModel, enable, quantize
    from piecewise.integrations.transformers import tensor_parallel as hf_tensor_parallel

    _join(rank, init_file)
    failed = True
    try:
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
        failed = False
    finally:
        _leave(failed)


@pytest.mark.parametrize("nvfp4", [False, True], ids=["fp32", "nvfp4-grouped-experts"])
def test_a_transformers_glm_moe_on_two_gpus_equals_the_whole_model(nvfp4):
    pytest.importorskip("transformers")
    with tempfile.TemporaryDirectory() as directory:
        mp.spawn(_transformers_worker, args=(os.path.join(directory, "init"), nvfp4), nprocs=2, join=True)
