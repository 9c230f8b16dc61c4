"""Tensor parallelism on CPU: two gloo ranks, sharded layers, the all-reduce as a splitting op.

The ranks are fresh interpreters (``spawn``, never ``fork``), which meet through a file in a directory of
their own (``init_method="file://..."``: no ports to collide), with a timeout on the rendezvous and the
collectives and a deadline on the whole run, after which the ranks are killed and the test fails. The tests of one
worker function share one spawn (``shared_ranks``): each test's case runs in turn, in a process group of its own,
and the test fails with its own case's traceback. Each rank
destroys its process group and then checks that gloo's threads are gone: a group kept alive past
``destroy_process_group`` left them running while the interpreter shut down, and one of them releasing its last
work then (it takes the GIL) aborted the rank now and then (SIGABRT, "terminate called without an active
exception")."""

import contextlib
import gc
import os
import tempfile
import time
import traceback
import weakref
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import piecewise
from piecewise.kernels.nvfp4 import NVFP4Linear, quantize_linears
from piecewise.models import example
from piecewise.models.llama import tensor_parallel_llama
from piecewise.opaque import opaque_op_info, splitting_op_names
from piecewise.parallel import Column, RowParallel, shard_layer, shard_modules

CONFIG = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96)
RANKS_SECONDS = 300
"""Deadline for all ranks of one spawn (imports, compiling on a loaded 2-core machine included)..."""
CASE_SECONDS = 60
"""... and for each further case a shared spawn runs (one takes about 10 s there)."""
COLLECTIVE_SECONDS = 120
"""Timeout of the rendezvous and of each collective: a rank whose peer died or hangs fails instead of waiting."""


def rel_error(out, ref):
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def gloo_threads() -> list[str]:
    """Names of this process's threads that gloo started (its TCP loop, the process group's work loops)."""
    tasks = "/proc/self/task"
    names = []
    for task in os.listdir(tasks) if os.path.isdir(tasks) else ():
        with contextlib.suppress(OSError):  # a thread that just ended
            with open(os.path.join(tasks, task, "comm")) as comm:
                names.append(comm.read().strip())
    return [name for name in names if "gloo" in name]


@contextlib.contextmanager
def gloo_rank(rank: int, init_file: str, world: int = 2):
    """This process as ``rank`` of a gloo world: the group is destroyed on the way out, and then none of gloo's
    threads may be left (they are joined when the group is freed)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback: no dependence on the host name resolving
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=COLLECTIVE_SECONDS))
    try:
        yield
    finally:
        dist.destroy_process_group()
    # The threads end as the group is freed, which a loaded machine may finish a moment later (a reference cycle
    # waits for the collector): wait for them a while; a group something keeps alive never lets them end.
    deadline = time.monotonic() + 10
    while (left := gloo_threads()) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert not left, f"rank {rank}: gloo threads {left} still run after destroy_process_group: the group was kept alive"


def run_ranks(worker, *args, world: int = 2, seconds: float = RANKS_SECONDS) -> None:
    """``worker(rank, init_file, *args)`` in ``world`` spawned processes. A rank's exception fails the test with
    its traceback (the other ranks are stopped); ranks still running after ``seconds`` are killed and fail it."""
    with tempfile.TemporaryDirectory() as directory:
        context = mp.start_processes(worker, args=(os.path.join(directory, "init"), *args), nprocs=world,
                                     join=False, start_method="spawn")
        deadline = time.monotonic() + seconds
        try:
            while not context.join(timeout=max(0.0, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    running = [p.pid for p in context.processes if p.is_alive()]
                    pytest.fail(f"{worker.__name__}: ranks {running} still running after {seconds:.0f} s: killed")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                process.join()


def _cases_worker(rank: int, init_file: str, cases: list[tuple], outcomes: str) -> None:
    """Each ``(name, worker, args)`` of ``cases`` in turn, as ``worker(rank, its own init file, *args)``: in a process
    group of its own. It leaves ``<name>.<rank>.ok`` in ``outcomes`` when it returns, its traceback in
    ``<name>.<rank>`` when it raises (and the next case runs)."""
    for index, (name, worker, args) in enumerate(cases):
        try:
            worker(rank, f"{init_file}-{index}", *args)
        except Exception:
            with open(os.path.join(outcomes, f"{name}.{rank}"), "w") as failure:
                failure.write(traceback.format_exc())
        else:
            open(os.path.join(outcomes, f"{name}.{rank}.ok"), "w").close()


def shared_ranks(request, directory, cases: dict) -> str:
    """One spawn of the ranks for the tests of this module that this session runs and ``cases`` names (test
    function → its parameters → ``(worker, args)``), each test's case in collection order (a spawn's start and
    imports are several seconds of a 2-core machine). For a module-scoped fixture; returns the outcomes' directory,
    which ``expect_case`` reads."""
    items = [item for item in request.session.items if item.module is request.module and item.originalname in cases]
    run_ranks(_cases_worker, [(item.name, *cases[item.originalname](**item.callspec.params)) for item in items],
              str(directory), seconds=RANKS_SECONDS + CASE_SECONDS * max(0, len(items) - 1))
    return str(directory)


def expect_case(outcomes: str, request, world: int = 2) -> None:
    """This test's case returned on every rank; else the test fails with the ranks' tracebacks."""
    name = request.node.name
    failed = [f"rank {rank}:\n" + open(os.path.join(outcomes, f"{name}.{rank}")).read() for rank in range(world)
              if os.path.exists(os.path.join(outcomes, f"{name}.{rank}"))]
    if failed:
        pytest.fail("\n".join(failed), pytrace=False)
    missing = [rank for rank in range(world) if not os.path.exists(os.path.join(outcomes, f"{name}.{rank}.ok"))]
    assert not missing, f"{name}: ranks {missing} did not run this case"


def _worker(rank: int, init_file: str, nvfp4: bool, in_graph: bool, frontend: str = "auto") -> None:
    with gloo_rank(rank, init_file):
        model, (ids, positions, _) = example(tokens=7, **CONFIG)  # same seed, so the same weights on every rank
        if nvfp4:
            quantize_linears(model)
        with torch.no_grad():
            expected = {t: model(ids[:t], positions[:t], model.make_kv_cache()) for t in (7, 3)}
        sharded = tensor_parallel_llama(model, capture_all_reduce=in_graph)
        assert sharded == [f"layers.{i}.{name}" for name in ("qkv", "o_proj", "gate_up", "down") for i in range(2)]
        assert model.config.num_heads == 2 and model.config.num_kv_heads == 1 and model.config.intermediate_size == 48
        assert isinstance(model.layers[0].o_proj, RowParallel)
        assert isinstance(model.layers[0].qkv, NVFP4Linear if nvfp4 else torch.nn.Linear)
        assert model.layers[0].qkv.out_features == 2 * 16 + 2 * 16  # 2 of 4 q heads, 1 of 2 kv heads
        cache = model.make_kv_cache()
        assert cache.shape[3] == 1  # this rank's KV heads
        with torch.no_grad():
            eager = model(ids, positions, cache)
        assert rel_error(eager, expected[7]) <= 1e-5, rel_error(eager, expected[7])
        runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend=frontend,
                                                                  graph_mode="piecewise"))
        op = "piecewise_ops::all_reduce_in_graph" if in_graph else "piecewise_ops::all_reduce"
        calls = opaque_op_info(op).eager_calls
        with torch.no_grad():
            for tokens in (7, 3):
                cache.zero_()  # the same tensor every call: captured graphs read it in place
                out = runner(ids[:tokens], positions[:tokens], cache)
                assert rel_error(out, expected[tokens]) <= 1e-5, (tokens, rel_error(out, expected[tokens]))
        stats = runner.stats
        assert stats["traces"] == (0 if frontend == "breakable" else 1) and stats["frontend"] != "auto"
        # cut at every attention, and at both all-reduces of each layer unless they stay inside the pieces
        splits = 1 if in_graph else 3
        assert stats["pieces"] == splits * 2 + 1 and stats["splitting_op_calls"] == splits * 2
        assert opaque_op_info(op).eager_calls - calls >= 2 * 2 * 2


@pytest.fixture(scope="module")
def ranks(request, tmp_path_factory):
    return shared_ranks(request, tmp_path_factory.mktemp("ranks"), {
        "test_two_ranks_equal_the_whole_model_eager_and_piecewise":
            lambda nvfp4, in_graph: (_worker, (nvfp4, in_graph)),
        "test_two_ranks_with_the_breakable_front_end_equal_the_whole_model":
            lambda in_graph: (_worker, (False, in_graph, "breakable"))})


@pytest.mark.parametrize("nvfp4,in_graph", [(False, False), (True, False), (False, True)],
                         ids=["fp32", "nvfp4", "fp32-all-reduce-in-pieces"])
def test_two_ranks_equal_the_whole_model_eager_and_piecewise(nvfp4, in_graph, ranks, request):
    """Each rank's output (eager, then piecewise at 7 and 3 tokens) equals the unsharded model's."""
    expect_case(ranks, request)


@pytest.mark.parametrize("in_graph", [False, True], ids=["all-reduce-split", "all-reduce-in-segments"])
def test_two_ranks_with_the_breakable_front_end_equal_the_whole_model(in_graph, ranks, request):
    """The breakable front-end: the all-reduce as a splitting op between segments, or run inside them."""
    expect_case(ranks, request)


def test_all_reduce_is_a_splitting_op_unless_captured():
    assert "piecewise_ops::all_reduce" in splitting_op_names()
    assert "piecewise_ops::all_reduce_in_graph" not in splitting_op_names()


def test_column_and_row_shards_of_a_linear_rebuild_it():
    """Shards of one layer, without a process group: column shards stack to the layer's output, row shards
    sum to it (the all-reduce's job, done by hand here)."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(32, 12)
    x = torch.randn(5, 32)
    columns = [shard_layer(layer, Column(sections=(8, 4)), rank, 2, "unused") for rank in range(2)]
    parts = [c(x) for c in columns]  # each: 4 rows of section 0, then 2 of section 1
    rebuilt = torch.cat([parts[0][:, :4], parts[1][:, :4], parts[0][:, 4:], parts[1][:, 4:]], dim=1)
    torch.testing.assert_close(rebuilt, layer(x))
    rows = [shard_layer(layer, "row", rank, 2, "unused") for rank in range(2)]
    assert rows[0].layer.in_features == 16 and rows[0].bias is not None
    total = sum(r.layer(x[:, 16 * i : 16 * (i + 1)]) for i, r in enumerate(rows)) + rows[0].bias
    torch.testing.assert_close(total, layer(x))


def test_nvfp4_shards_keep_the_layers_bytes():
    torch.manual_seed(0)
    layer = NVFP4Linear.from_linear(torch.nn.Linear(64, 8, bias=False))
    x = torch.randn(3, 64)
    row = shard_layer(layer, "row", 1, 2, "unused")
    assert torch.equal(row.layer.weight, layer.weight[:, 16:])
    assert torch.equal(row.layer.weight_scale.view(torch.uint8), layer.weight_scale.view(torch.uint8)[:, 2:])
    column = shard_layer(layer, "column", 1, 2, "unused")
    torch.testing.assert_close(column(x), layer(x)[:, 4:])
    with pytest.raises(ValueError, match="whole number of 16-input scale blocks"):
        shard_layer(layer, "row", 0, 8, "unused")  # 8 inputs per rank


def test_plans_that_cannot_apply_are_errors():
    model, _ = example(**CONFIG)
    with pytest.raises(ValueError, match=r"\['layers\.\*\.q_proj'\] match no module"):
        shard_modules(model, {"layers.*.q_proj": "column"}, 0, 2, "unused")
    with pytest.raises(ValueError, match="section 1 of out_features is 31, which 3 ranks cannot share"):
        shard_modules(model, {"layers.0.qkv": Column(sections=(66, 31, 31))}, 0, 3, "unused")
    with pytest.raises(ValueError, match="add up to 96, not out_features=128"):
        shard_modules(model, {"layers.0.qkv": Column(sections=(64, 32))}, 0, 2, "unused")
    with pytest.raises(ValueError, match="layers.0.input_norm is a RMSNorm"):
        shard_modules(model, {"layers.0.input_norm": "row"}, 0, 2, "unused")
    with pytest.raises(ValueError, match="shard style"):
        shard_modules(model, {"layers.0.qkv": "diagonal"}, 0, 2, "unused")


class _Group:
    group_name = "7"


def test_piecewise_keeps_no_process_group_alive():
    """The all-reduce ops find their group by name, through a weak reference: a group destroyed and dropped is
    freed (with its backend's threads), and an op still naming it says so."""
    from piecewise.parallel import _group, group_name

    group = _Group()
    name = group_name(group)
    assert _group(name) is group
    alive = weakref.ref(group)
    del group
    gc.collect()
    assert alive() is None
    with pytest.raises(RuntimeError, match=r"process group '7_\d+' no longer exists \(destroyed"):
        _group(name)


def test_tensor_parallel_needs_an_initialised_process_group():
    from piecewise.parallel import tensor_parallel

    model, _ = example(**CONFIG)
    with pytest.raises(RuntimeError, match="init_process_group"):
        tensor_parallel(model, {"layers.*.down": "row"})


def _fake_search(times: dict[str, float]) -> None:
    """The search on a CPU rank: no graphs, so the faked ``times`` (ms per compiler) exercise the choice, and
    Inductor's pieces are the FX graphs as they are (nothing to compile)."""
    from piecewise.capture import compilers
    from piecewise.runtime import search

    search.MEASURE_WITHOUT_CUDA = True
    compilers.InductorCompiler.compile = lambda self, graph, example_inputs: graph.forward
    search._timed = lambda trial, arguments, **_: {1: times[trial.config.compiler]}


def _sharded_example():
    """(the example model sharded over the ranks, ids, positions, the unsharded model's output)."""
    model, (ids, positions, _) = example(tokens=5, **CONFIG)
    with torch.no_grad():
        expected = model(ids, positions, model.make_kv_cache())
    tensor_parallel_llama(model)
    return model, ids, positions, expected


def _search_worker(rank: int, init_file: str) -> None:
    """The default compiler="auto" with its timing faked per rank: rank 0 finds eager faster, rank 1 Inductor;
    then a budget only rank 0 has spent. Every rank must take the same, or their first calls' collectives part."""
    _fake_search([{"eager": 1.0, "inductor": 2.0}, {"eager": 2.0, "inductor": 0.5}][rank])
    with gloo_rank(rank, init_file):
        model, ids, positions, expected = _sharded_example()
        choices = []
        for budget in (120.0, 1e-3 if rank == 0 else 120.0):
            runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, compile_budget_s=budget,
                                                                      cache_dir=None))
            with torch.no_grad():
                out = runner(ids, positions, model.make_kv_cache())
            assert rel_error(out, expected) <= 1e-5
            choices.append([c["compiler"] for c in runner.stats["candidates"]] + [runner.config.compiler])
        assert choices == [["eager", "inductor", "eager"], ["eager", "eager"]], choices  # slowest rank's times


def _failing_trial_worker(rank: int, init_file: str, cache_dir: str) -> None:
    """The compiler recorded in a shared cache (eager) fails on rank 1 only, after its collectives: both ranks go
    back to the search together and take the one candidate that works on both."""
    from piecewise.runtime import first_call

    _fake_search({"eager": 1.0, "inductor": 2.0})
    prepare, failing = first_call.prepare, [False]

    def prepare_failing_on_rank_1(core, arguments):
        prepare(core, arguments)
        if failing[0] and rank == 1 and core.config.compiler == "eager":
            raise RuntimeError("the eager candidate fails on rank 1 only")

    first_call.prepare = prepare_failing_on_rank_1
    with gloo_rank(rank, init_file):
        model, ids, positions, expected = _sharded_example()
        taken = []
        for fail in (False, True):
            failing[0] = fail
            runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, cache_dir=cache_dir))
            with torch.no_grad():
                assert rel_error(runner(ids, positions, model.make_kv_cache()), expected) <= 1e-5
            taken.append(runner.config.compiler)
        assert taken == ["eager", "inductor"], taken


def _agreement_worker(rank: int, init_file: str, cache_dir: str) -> None:
    _search_worker(rank, init_file)
    _failing_trial_worker(rank, init_file + "-again", cache_dir)


def test_ranks_agree_on_the_compiler_search(tmp_path):
    """Each rank's times differ; the ranks compare the slowest rank's times, so all take one compiler, and a
    compile budget spent on one rank stops the search on all; a candidate failing on one rank is failed on all."""
    run_ranks(_agreement_worker, str(tmp_path / "cache"))
