"""Other CUDA-graph users in the same process: torch.compile(mode="reduce-overhead") models, a user's own
torch.cuda.graph, anyone clearing cuBLAS workspaces. Captured piecewise graphs keep replaying correctly.

Each case runs in its own process: the failure this guards against (an illegal memory access) ends the CUDA
context, and with it every later test of a shared process."""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import piecewise
    from piecewise.models import example

    frontend, disturbance, pin = sys.argv[1], sys.argv[2], sys.argv[3] == "pin"
    if not pin:  # the runtime before its fix: the capture stream's cuBLAS workspace made wherever it falls
        import piecewise.capture.session as session
        session.own_blas_workspaces = lambda pool: None
    torch.manual_seed(0)
    model, (ids, positions, cache) = example(tokens=5, device="cuda", dtype=torch.bfloat16, num_layers=2)
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=16, frontend=frontend))

    def disturb():
        if disturbance == "reduce_overhead_other":
            other = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
            compiled = torch.compile(other.cuda(), mode="reduce-overhead")
            x = torch.randn(8, 256, device="cuda")
            for _ in range(3):
                compiled(x)
        elif disturbance == "reduce_overhead_same":
            compiled = torch.compile(model, mode="reduce-overhead")
            for _ in range(3):
                compiled(ids, positions, cache.clone())
            torch._dynamo.reset()
        elif disturbance == "clear_workspaces":
            torch._C._cuda_clearCublasWorkspaces()
            torch.cuda.empty_cache()
        elif disturbance == "user_graph":
            x = torch.randn(64, 64, device="cuda")
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y = x @ x
            graph.replay()
            del graph, y
            torch.cuda.empty_cache()
        torch.cuda.synchronize()

    with torch.no_grad():
        runner(ids, positions, cache)
        disturb()
        for tokens in (5, 1, 16, 17, 3):
            ids = torch.randint(0, model.config.vocab_size, (tokens,), device="cuda")
            positions = torch.arange(tokens, device="cuda") + 7
            reference = cache.clone()
            ref = model(ids, positions, reference)
            out = runner(ids, positions, cache)
            torch.cuda.synchronize()
            err = float((out.float() - ref.float()).norm() / ref.float().norm())
            cache_err = float((cache.float() - reference.float()).norm() / reference.float().norm())
            assert err <= 1e-2 and cache_err <= 1e-2, (tokens, err, cache_err)
            disturb()
    assert runner.stats["cuda_graphs"] and runner.stats["replays"] > 0, runner.stats
    print("OK", runner.stats["frontend"], runner.stats["replays"])
""")


def run_case(frontend, disturbance, pin="pin"):
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", SCRIPT, frontend, disturbance, pin], env=env, capture_output=True,
                          text=True, timeout=240)


@pytest.mark.parametrize("disturbance", ["reduce_overhead_other", "reduce_overhead_same", "clear_workspaces",
                                         "user_graph"])
@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
def test_graphs_replay_correctly_after_other_cuda_graph_users_in_the_process(frontend, disturbance):
    done = run_case(frontend, disturbance)
    assert done.returncode == 0 and "OK" in done.stdout, done.stdout[-3000:] + done.stderr[-6000:]
