"""From a Dynamo failure (reason text + user stack) to a blocker kind, a call chain and a remedy.

Kinds are decided from Dynamo's reason text and ``gb_type`` first, then from what the chain passes through
(a frame in the stdlib ``logging`` or ``random`` module, the source line of the innermost user frame).
"""

from __future__ import annotations

import logging
import os
import re
import sysconfig
import traceback
from dataclasses import dataclass

import torch

from piecewise.errors import BlockerKind

logger = logging.getLogger(__name__)

KINDS = tuple(kind.value for kind in BlockerKind)

FIXES: dict[str, str] = {
    "jit_subprocess": (
        "The called code runs host-side setup (a subprocess, a lock, file I/O) that Dynamo cannot trace. Make "
        "the library function an opaque op so tracing records one call and never enters it: "
        "fn = piecewise.wrap_opaque(library.fn, fake=...), and call fn from forward."
    ),
    "host_sync": (
        "Keep values on the device: replace .item() / .tolist() / .cpu() / printing tensors and Python `if` "
        "on tensor values with tensor ops (torch.where, masks, clamp), or compute host-side values before "
        "forward and pass them in. Code that must branch on tensor values (an MoE's loop over the experts that "
        "got tokens) goes into one function made a splitting op, piecewise.opaque_op(name, split=True), which "
        "runs eagerly between captured pieces. A host sync is illegal while a CUDA graph captures."
    ),
    "data_dependent_shape": (
        "Keep shapes static: use a fixed-size formulation (torch.where(cond, x, y) or a mask multiply instead "
        "of boolean indexing, padding to a maximum count, topk with a fixed k), or move the op into a function "
        "made a splitting op, piecewise.opaque_op(name, split=True), so it runs eagerly between captured pieces."
    ),
    "compiler_disabled": (
        "A torch.compiler.disable region cannot be traced with fullgraph=True. Make the function an opaque op "
        "instead: fn = piecewise.wrap_opaque(fn, fake=...) (add split=True if it must run eagerly, outside "
        "the CUDA graphs)."
    ),
    "state_update": (
        "State kept across calls and updated from its own value (a step counter, a running sum, "
        "index_add_/index_put_(accumulate=True)) would advance more than once: the first call runs the model "
        "several times on its inputs (warm-up, then one run per capture size). Move the update into a "
        "function made a splitting op, piecewise.opaque_op(name, mutates_args=..., split=True), that skips it "
        "while piecewise.context().rehearsal is True, or keep the state outside forward. (Writes that only "
        "overwrite, such as KV-cache writes at given positions, are fine.)"
    ),
    "token_mixing": (
        "Every call is padded to a capture size, so code in the captured pieces must compute each token's row "
        "from that row alone. Put what combines tokens (a sum, mean, softmax or sort over the token dimension, "
        "pooling, reading the last row with x[-1]) in a function made a splitting op, "
        "piecewise.opaque_op(name, split=True), which runs eagerly on the real rows only, or compute it after "
        "forward on the outputs."
    ),
    "token_branch": (
        "One trace serves every token count: compute the branch's condition outside forward and pass it in, "
        "or make the code that depends on the token count a splitting op, piecewise.opaque_op(name, split=True)."
    ),
    "state_guard": (
        "Dynamo compiles the forward for the Python state it saw (a list it appends to, a counter, a flag) and "
        "traces it again whenever that state differs, here on every call. Keep such state out of forward (collect it "
        "after the call, count in a tensor on the device), pass the value in as a tensor argument, or use "
        "CaptureConfig(frontend='breakable') (frontend='auto' takes it), which runs the forward's Python at capture "
        "and refuses a value its graphs would keep (replays run no Python: a hook or a log line runs at capture "
        "only)."
    ),
    "frozen_value": (
        "A captured graph keeps the Python values of its capture: a number drawn with random, read from a clock or "
        "a counter, or from an attribute set between calls, would stay the one seen at capture. Compute such values "
        "on the device (torch.rand(..., device=x.device) instead of random.random()), pass them in as tensor "
        "arguments, or read them inside a splitting op (piecewise.opaque_op(..., split=True)), which runs on every "
        "call."
    ),
    "token_layout": (
        "piecewise pads each call to a capture size and cuts it back, so the token count must appear as itself: one "
        "row per token in one dimension (dimension 0 for a splitting op's outputs), and a splitting op given the "
        "count as a number gets the count itself (x.shape[0]), not an expression of it. Reshape [tokens * n, ...] "
        "to [tokens, n, ...] around the op, and compute derived numbers inside it."
    ),
    "output_object": (
        "Return tensors, or tuples, lists, dicts and ModelOutputs of them: piecewise cuts those to the call's tokens "
        "and copies them out of the graphs' memory. Transformers: call with use_cache=False; for decoding with a KV "
        "cache use piecewise.generate, or integrations.token_model.TokenModel(integrations.transformers.enable(model)) "
        "with a cache from its make_kv_cache."
    ),
    "transformers_cache": (
        "piecewise serves a KV cache of its own, written at the real rows only: decode with "
        "piecewise.generate(model, prompts), or integrations.token_model.TokenModel(integrations.transformers."
        "enable(model)) with a cache from its make_kv_cache (one graph set for prefill and decode of many sequences). "
        "For a forward without a cache, call with use_cache=False and no past_key_values."
    ),
    "module_hook": (
        "Dynamo traces the compiled module's forward, not its call: hooks on the module itself (and global module "
        "hooks) would not run. Register the hook on a submodule, apply it to the runner's output, or use "
        "CaptureConfig(frontend='breakable') (frontend='auto' takes it), which runs the module's call."
    ),
    "side_stream": (
        "Dynamo's trace of this torch keeps the forward's side streams as objects the graph cannot be split around. "
        "Use CaptureConfig(frontend='breakable') (frontend='auto' takes it), which joins a side stream left open at "
        "a splitting op, or fork and join the stream inside a splitting op."
    ),
    "token_argument_write": (
        "The written tensor was taken for a token argument (its first dimension equals the call's token count), "
        "which piecewise copies into a padded buffer each call: compile with dynamic={...} naming only the real "
        "token arguments, so that state stays static and is written in place."
    ),
    "batch_first": (
        "piecewise takes dimension 0 of the token arguments as the tokens, unless told otherwise (token ids shaped "
        "[1, T] are taken batch-first by themselves). Name the token dimension of each token argument: "
        "piecewise.compile(model, dynamic={'inputs_embeds': 1, 'input_pos': 0}); or call a transformers model "
        "through piecewise.integrations.transformers.TokenModel(enable(model)), which takes input_ids [T], "
        "positions [T] and a KV cache."
    ),
    "python_rng": (
        "Python/NumPy randomness is drawn on the host, outside torch's generators and outside the graph. Use "
        "torch's RNG on the device (torch.rand(..., device=x.device)) or draw the values before forward and "
        "pass them in as a tensor."
    ),
    "logging": (
        "Remove print/logging from forward, or guard it with `if not torch.compiler.is_compiling():` "
        "(replayed CUDA graphs run no Python, so such lines would never run there anyway)."
    ),
    "unsupported_context_manager": (
        "Dynamo only enters context managers it knows (torch.no_grad, autocast, ...). Move the `with` out of "
        "forward, or put the code that needs it in a function made opaque with piecewise.wrap_opaque(fn, "
        "fake=...)."
    ),
    "unsupported_builtin": (
        "Dynamo cannot trace this call. Do it once outside forward (e.g. in __init__), or make the function "
        "that contains it an opaque op: piecewise.wrap_opaque(fn, fake=...)."
    ),
    "capture_illegal": (
        "This op is illegal inside a CUDA graph capture (host sync, CPU work, or an allocation the capture "
        "cannot see). Make it a splitting op so it runs eagerly between captured pieces: "
        "piecewise.opaque_op(name, split=True) or piecewise.wrap_opaque(fn, split=True), or replace it with "
        "a capture-safe kernel."
    ),
}

# Host-process primitives reached from JIT kernel libraries on first use.
_PROCESS_MODULES = frozenset(
    {"_thread", "threading", "subprocess", "_posixsubprocess", "posix", "nt", "os", "fcntl", "msvcrt",
     "multiprocessing", "_multiprocessing", "filelock", "select", "selectors", "socket", "_socket", "signal",
     "tempfile", "shutil", "io", "_io"}
)
_LOCK_NAMES = re.compile(r"`(?:lock|RLock|Lock|Condition|Semaphore|BoundedSemaphore|\w*FileLock)`")
_RNG_LINE = re.compile(r"\b(?:np|numpy)\.random\.|(?<![\w.])random\.\w+\(")
_DEBUG_MODULE = re.compile(r"module: ([\w.]+)")
_DISABLED_FN = re.compile(r"<function (?P<name>[\w.<>]+) at 0x")

_TORCH_DIR = os.path.dirname(os.path.realpath(torch.__file__)) + os.sep
_SITE_DIRS = tuple(
    os.path.realpath(path) + os.sep
    for path in {sysconfig.get_paths().get(key) for key in ("purelib", "platlib")}
    if path
)
_STDLIB_DIRS = tuple(
    os.path.realpath(path) + os.sep
    for path in {sysconfig.get_paths().get(key) for key in ("stdlib", "platstdlib")}
    if path
)


@dataclass
class Finding:
    """A classified failure before it becomes a Blocker: kind, short message, kept frames."""

    kind: str
    message: str
    frames: list[traceback.FrameSummary]


def real_path(path: str) -> str:
    return os.path.realpath(path) if path and not path.startswith("<") else path


def is_torch_internal(path: str) -> bool:
    return real_path(path).startswith(_TORCH_DIR)


def is_stdlib(path: str) -> bool:
    if path.startswith("<frozen"):
        return True
    real = real_path(path)
    return real.startswith(_STDLIB_DIRS) and not real.startswith(_SITE_DIRS)


def _stdlib_module(path: str) -> str | None:
    """Top-level module name of a stdlib or site-packages file (``subprocess``, ``logging``, ``filelock``)."""
    real = real_path(path)
    for root in (*_SITE_DIRS, *_STDLIB_DIRS):
        if real.startswith(root):
            relative = real[len(root):]
            return relative.split(os.sep, 1)[0].removesuffix(".py")
    return None


def keep_frames(stack: list[traceback.FrameSummary]) -> tuple[list[traceback.FrameSummary], str | None]:
    """Frames the user needs: no torch internals, and no stdlib tail below the last user/library frame.

    Returns the kept frames and ``module.function`` of the first dropped stdlib frame of the tail (the
    stdlib entry point the code called, e.g. ``subprocess.check_output``), if any.
    """
    frames = [frame for frame in stack if not is_torch_internal(frame.filename)]
    last_user = max((i for i, frame in enumerate(frames) if not is_stdlib(frame.filename)), default=-1)
    if last_user < 0:
        return frames[:1], None
    tail = frames[last_user + 1:]
    via = f"{_stdlib_module(tail[0].filename)}.{tail[0].name}" if tail else None
    return frames[: last_user + 1], via


def _explanation(reason: str) -> str:
    """Dynamo's ``Explanation:`` text, first sentence, or the first line of the reason."""
    match = re.search(r"Explanation:\s*(.+)", reason)
    text = match.group(1).strip() if match else ""
    sentence = re.split(r"(?<=[.)`])\s+(?=[A-Z])", text, maxsplit=1)[0]
    return sentence.replace(".`", "`").rstrip(".")


# Reasons Dynamo gives without an explanation (or with advice for export users), reworded.
_TERSE_REASONS = {
    "generic_jump": "Data-dependent branching: Python control flow (`if`, `while`, `bool()`) on a tensor value",
    "Consider annotating your code using torch._check*(). Could not guard on data-dependent expression": (
        "Data-dependent branching: a Python condition on a size known only when the code runs (e.g. "
        "`if t.numel() > 0` after `torch.where` / `nonzero`)"),
    "Consider annotating your code using torch._check*(). Could not extract specialized integer from "
    "data-dependent expression": (
        "Data-dependent value: a Python int taken from a size known only when the code runs (e.g. looping or "
        "indexing with the count of a `nonzero` result)"),
}


def short_message(reason: str, gb: str | None) -> str:
    lines = reason.strip().splitlines()
    first = lines[0].strip() if lines else ""
    headline = gb or first or "graph break"
    for candidate in (headline, first):  # torch 2.11 labels some of these `constrain_as_size_example`
        for prefix, reworded in _TERSE_REASONS.items():
            if candidate.startswith(prefix):
                return reworded
    explanation = _explanation(reason)
    if explanation and explanation.lower() != headline.lower():
        return f"{headline}: {explanation}"
    return headline


# torch ≥ 2.14 refuses a context manager it cannot enter by naming its skipped ``__enter__``/``__exit__``.
_CONTEXT_METHOD = re.compile(r"`[\w.]+\.__(?:enter|exit)__`")


def classify(reason: str, gb: str | None, stack: list[traceback.FrameSummary]) -> str:
    """Blocker kind of one Dynamo failure, from its reason text, ``gb_type`` and full user stack."""
    text = f"{gb or ''}\n{reason}"
    lowered = text.lower()
    modules = {_stdlib_module(frame.filename) for frame in stack if is_stdlib(frame.filename)}
    user_frames = [f for f in stack if not is_torch_internal(f.filename) and not is_stdlib(f.filename)]
    innermost_code = (user_frames[-1].line or "") if user_frames else ""
    debug_module = _DEBUG_MODULE.search(text)
    blocked_module = debug_module.group(1).split(".")[0] if debug_module else None

    if "compiler.disable" in lowered or "_dynamo.disable" in lowered:
        return "compiler_disabled"
    if _RNG_LINE.search(innermost_code) or "random" in modules or "Random." in text or blocked_module in (
        "random", "_random"
    ):
        return "python_rng"
    is_print = "builtin operator `print`" in text or "builtin print" in text
    if is_print:
        return "host_sync" if "'Tensor'" in text or "TensorVariable" in text else "logging"
    if "logging" in modules or "logger" in lowered:
        return "logging"
    if (
        blocked_module in _PROCESS_MODULES
        or modules & _PROCESS_MODULES
        or "builtin operator `open`" in text
        or ("context manager" in lowered and _LOCK_NAMES.search(text))
    ):
        return "jit_subprocess"
    if "context manager" in lowered or _CONTEXT_METHOD.search(text):
        return "unsupported_context_manager"
    if "dynamic shape operator" in lowered or "output shape depends on input tensor data" in lowered:
        return "data_dependent_shape"
    host_sync_markers = ("item()", "tolist()", "data dependent operator", "_local_scalar_dense",
                         "data-dependent branching", "generic_jump", "data-dependent expression")
    if any(marker in lowered for marker in host_sync_markers):
        return "host_sync"
    return "unsupported_builtin"


def disabled_function(reason: str) -> str | None:
    match = _DISABLED_FN.search(reason)
    return match.group("name") if match else None


def analyse(reason: str, gb: str | None, stack: list[traceback.FrameSummary]) -> Finding:
    """Kind, message and kept frames of one Dynamo failure."""
    kind = classify(reason, gb, stack)
    frames, via = keep_frames(stack)
    message = short_message(reason, gb)
    if kind == "compiler_disabled" and (name := disabled_function(reason)):
        message = f"calls {name}, which is wrapped in torch.compiler.disable (fullgraph=True cannot skip it)"
    if via:
        message += f" (reached through {via})"
    return Finding(kind=kind, message=message, frames=frames)
