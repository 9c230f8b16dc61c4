import faulthandler
import os

import pytest
import torch

# The persistent cache stays off unless a test gives a directory: an entry another test (or an earlier run) wrote
# would change what a first call does (auto takes the recorded front-end directly, without its warning).
os.environ.setdefault("PIECEWISE_CACHE_DIR", "off")
# On CUDA the default compiler="auto" compiles an Inductor candidate at every first call: the GPU tests give their
# compiler where it matters and run eager pieces otherwise (tests/gpu/test_search_gpu.py runs the default). On a
# CPU "auto" takes eager pieces without compiling, so the CPU tests run the default as a user gets it.
if torch.cuda.is_available():
    os.environ.setdefault("PIECEWISE_COMPILER", "eager")



def _share_the_cores() -> None:
    """pytest-xdist's workers each take their share of the cores for torch's threads (one each on 2 cores with 2
    workers), and so do the processes a test starts (a parallel test's ranks, a CLI run), through OMP_NUM_THREADS.
    With torch's default, a thread per core in every worker, the workers' threads outnumber the cores and wait on
    each other. A thread count given in OMP_NUM_THREADS is kept."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2 or "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = max(1, cores // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


_share_the_cores()

GPU_TEST_SECONDS = int(os.environ.get("PIECEWISE_GPU_TEST_SECONDS", "300"))
"""A GPU test still running after this long prints every thread's stack and ends the run (a hang, e.g. a
collective that never completes, would otherwise use up a whole device session)."""


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="K/N",
                     help="run every N-th collected test starting at the K-th (0-based): N processes share a machine")


def _shard(value: str) -> tuple[int, int]:
    try:
        index, count = (int(part) for part in value.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--shard takes K/N with integers, 0 <= K < N (e.g. 0/4), got {value!r}") from None
    if count < 1 or not 0 <= index < count:
        raise pytest.UsageError(f"--shard {value}: K must be in 0..N-1 and N at least 1")
    return index, count


@pytest.hookimpl(trylast=True)  # after -m / -k deselection, so shards split the tests that run
def pytest_collection_modifyitems(config, items):
    shard = config.getoption("--shard")
    if shard is not None:
        index, count = _shard(shard)
        config.hook.pytest_deselected(items=[item for position, item in enumerate(items) if position % count != index])
        items[:] = items[index::count]
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _gpu_hang_guard(request):
    if "gpu" not in request.keywords or not torch.cuda.is_available():
        yield
        return
    faulthandler.dump_traceback_later(GPU_TEST_SECONDS, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
