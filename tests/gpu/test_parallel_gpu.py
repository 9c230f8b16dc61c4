"""Tensor parallelism on two GPUs: NCCL all-reduces between captured pieces, bf16 and NVFP4 weights."""

import os
import tempfile

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


def _worker(rank: int, init_file: str, nvfp4: bool, in_graph: bool) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            device_id=torch.device("cuda", rank))
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
        assert stats["cuda_graphs"] is True and stats["pieces"] == pieces
        assert stats["graphs"] == pieces * len(stats["captured_sizes"]) and stats["replays"] > 0
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("nvfp4,in_graph", [(False, False), (True, False), (False, True)],
                         ids=["bf16", "nvfp4", "bf16-all-reduce-captured"])
def test_two_gpus_equal_the_whole_model(nvfp4, in_graph):
    with tempfile.TemporaryDirectory() as directory:
        mp.spawn(_worker, args=(os.path.join(directory, "init"), nvfp4, in_graph), nprocs=2, join=True)
