"""Where the first call's capture time goes, per front-end, on the L16 decode model (51 sizes, vLLM ladder to
512): seconds in the padded warm-up runs and in the capture runs, in ``CUDAGraph`` begin / end / replay, in the
breakable front-end's splitting-op calls, and how many ops its dispatch mode saw. Both front-ends run in this one
process, breakable first (so Dynamo finds cuDNN's plans for every size already built: see
``sdpa_first_call.py``); each front-end's outputs are checked against eager after its capture.

    PYTHONPATH=src python benchmarks/capture_phases.py [grad|no_grad|inference] [--cudnn-off] [--skip-warm-up]

``--skip-warm-up`` is an experiment, not an option of piecewise: sizes after the first are captured without the
padded run before them (the outputs are still checked against eager).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import sys
import time

import torch

import piecewise
from piecewise.capture.state import Phase
from piecewise.frontends import breakable
from piecewise.models.decode import L16, DecodeLlama
from piecewise.runtime import model as runtime_model

SECONDS: collections.defaultdict = collections.defaultdict(float)
COUNTS: collections.Counter = collections.Counter()


def timed(key: str, fn):
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SECONDS[key] += time.perf_counter() - started
            COUNTS[key] += 1
    return wrapper


def instrument(skip_warm_up: bool) -> None:
    run_call = runtime_model.PiecewiseModel.run_call

    def timed_run_call(self, call, arguments, rehearsal=False):
        capturing = self.state.pool is not None
        if skip_warm_up and call.phase is Phase.PADDED and capturing and self.stats.captured_sizes:
            return None
        started = time.perf_counter()
        try:
            return run_call(self, call, arguments, rehearsal)
        finally:
            if capturing:
                torch.cuda.current_stream().synchronize()
            SECONDS["run_call " + call.phase.name] += time.perf_counter() - started
            COUNTS["run_call " + call.phase.name] += 1

    runtime_model.PiecewiseModel.run_call = timed_run_call
    graph = torch.cuda.CUDAGraph
    for name in ("capture_begin", "capture_end", "replay"):
        setattr(graph, name, timed("CUDAGraph." + name, getattr(graph, name)))
    breakable._Interceptor._split = timed("breakable splitting-op calls", breakable._Interceptor._split)
    dispatch = breakable._Interceptor.__torch_dispatch__

    def counted(self, func, types, args=(), kwargs=None):
        COUNTS["breakable ops seen, " + ("capturing" if self.recording is not None else "padded")] += 1
        return dispatch(self, func, types, args, kwargs)

    breakable._Interceptor.__torch_dispatch__ = counted


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("grad_mode", nargs="?", default="inference", choices=("grad", "no_grad", "inference"))
    parser.add_argument("--cudnn-off", action="store_true")
    parser.add_argument("--skip-warm-up", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("capture_phases.py needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.cudnn_off:
        torch.backends.cuda.enable_cudnn_sdp(False)
    instrument(args.skip_warm_up)
    mode = {"grad": contextlib.nullcontext, "no_grad": torch.no_grad, "inference": torch.inference_mode}[args.grad_mode]
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, {args}")
    torch.manual_seed(0)
    model = DecodeLlama(L16).to(device="cuda", dtype=torch.bfloat16).eval()
    cache = model.make_kv_cache(128)
    ids = torch.randint(0, L16.vocab_size, (128,), device="cuda")
    positions = torch.full((128,), L16.max_seq_len - 1, device="cuda")
    for frontend in ("breakable", "dynamo"):
        SECONDS.clear()
        COUNTS.clear()
        with mode():
            runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=512, frontend=frontend))
            started = time.perf_counter()
            runner.capture(ids, positions, cache)
            first = time.perf_counter() - started
            worst = 0.0
            for tokens in (1, 3, 8, 17, 100, 128):
                reference = model(ids[:tokens], positions[:tokens], cache).float()
                out = runner(ids[:tokens], positions[:tokens], cache).float()
                worst = max(worst, float((out - reference).norm() / reference.norm()))
        stats = runner.stats
        print(f"== {frontend}: first call {first:.2f} s, capture {stats['capture_seconds']:.2f} s, "
              f"{stats['graphs']} graphs; worst rel. error against eager {worst:.1e}")
        for key in sorted(set(SECONDS) | set(COUNTS)):
            print(f"  {key:40s} " + (f"{SECONDS[key]:8.3f} s " if key in SECONDS else " " * 11) + f"n={COUNTS[key]}")
        runner.release_graphs()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
