"""Capture configuration: which token counts get a CUDA graph, where the graph is cut, how pieces compile."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

SIZE_SCHEDULES = ("vllm", "sglang")
COMPILERS = ("eager", "inductor")
"""The piece compilers (``capture/compilers.py`` holds one class per name)."""
COMPILER_CHOICES = (*COMPILERS, "auto")
"""``CaptureConfig.compiler``'s values: a piece compiler, or ``"auto"`` (``runtime/search.py``)."""
FRONTENDS = ("auto", "dynamo", "breakable")
VERIFY = ("off", "first_last", "all")
GRAPH_MODES = ("piecewise", "full", "full_and_piecewise")
DEFAULT_MAX_DECODE_BATCH = 256
DEFAULT_MAX_TOKENS = 512


def vllm_sizes(max_tokens: int) -> list[int]:
    """vLLM's ladder: [1, 2, 4] + range(8, 256, 8) + range(256, max + 1, 16)."""
    ladder = [1, 2, 4, *range(8, 256, 8), *range(256, max_tokens + 1, 16)]
    return [s for s in ladder if s <= max_tokens]


def sglang_sizes(max_tokens: int) -> list[int]:
    """SGLang's piecewise token ladder (58 sizes up to 8192)."""
    ladder = [
        *range(4, 33, 4),
        *range(48, 257, 16),
        *range(288, 513, 32),
        *range(576, 1025, 64),
        *range(1280, 4097, 256),
        *range(4608, max(max_tokens, 4608) + 1, 512),
    ]
    return [s for s in ladder if s <= max_tokens]


@dataclass
class CaptureConfig:
    """How `piecewise.compile` traces, splits, compiles and captures a model.

    Every field is validated on construction; a bad value raises ``ValueError`` naming the field.
    """

    capture_sizes: list[int] | None = None
    """Token counts that get a CUDA graph. None: the ``size_schedule`` ladder up to ``max_tokens``
    (``max_tokens`` itself is added when the ladder does not end on it)."""

    max_tokens: int | None = None
    """Largest token count served by graphs; larger calls run without graphs. None: the largest of
    ``capture_sizes`` when they are given, else 512. Given together with ``capture_sizes``, it must equal their
    largest size (the top of the graphs)."""

    size_schedule: str = "vllm"
    """Default ladder when ``capture_sizes`` is None: ``"vllm"`` (51 sizes at 512) or ``"sglang"`` (58 at 8192)."""

    splitting_ops: tuple[str, ...] | None = None
    """Ops (``"ns::name"``) at which the graph is cut and that run eagerly between pieces.
    None: every op registered with ``piecewise.opaque_op(..., split=True)``."""

    compiler: str = field(default_factory=lambda: os.environ.get("PIECEWISE_COMPILER") or "auto")
    """How each piece is compiled: ``"eager"`` (the FX graph as is), ``"inductor"`` (once, for the symbolic
    token dimension), or ``"auto"`` (the default): each of them tried at the first call and Inductor taken where
    it is more than 5% faster (geometric mean over a few token counts, measured on CUDA graphs) within
    ``compile_budget_s`` (``runtime/search.py``; recorded in the persistent cache, so a later process takes it
    without the search; eager without CUDA). ``$PIECEWISE_COMPILER`` sets the default (``eager``: no first call compiles Inductor)."""

    compile_budget_s: float = 120.0
    """``compiler="auto"``: the first calls' seconds the search may spend; past them it takes the fastest
    candidate measured so far."""

    frontend: str = "auto"
    """How the forward is turned into pieces. ``"dynamo"``: one Dynamo trace split into FX pieces at the splitting
    ops (pieces can be compiled with Inductor). ``"breakable"``: the forward's Python runs under stream capture and
    each splitting op ends one graph and starts the next (cannot fail on Python Dynamo cannot trace); with
    ``compiler="inductor"`` the forward runs through ``torch.compile`` with graph breaks allowed, each region
    Dynamo traces compiled by Inductor, the rest run as written. ``"auto"``: Dynamo when it traces the forward with
    no blocker, else breakable (with Inductor regions when ``compiler="inductor"``), with one warning naming each
    blocker and the fix that would bring Dynamo back; breakable too when the trace would pad one-token calls to 2
    and ``compiler`` is ``"eager"`` (the same pieces, fewer sizes)."""

    max_padding_factor: float | None = None
    """Run a call without graphs when its capture size is more than this factor above its real token count
    (SGLang uses 2 for prefill). None: every call up to the top of the graphs is padded and replayed."""

    verify: str = "off"
    """Check the graphs against eager at the first call, after capture (see ``PiecewiseModel.verify``):
    ``"off"``, ``"first_last"`` (the smallest and the largest size) or ``"all"``. A mismatch raises
    ``piecewise.VerificationError`` with the report."""

    strict: bool = False
    """True: the Dynamo front-end must take the forward whole. Code Dynamo cannot trace raises
    ``piecewise.CaptureBlockedError`` naming the blocker, its call chain and the fix, instead of the fallback
    (``frontend="auto"``: breakable; ``frontend="dynamo"``: one more eager region, with one warning)."""

    cuda_graphs: bool = True
    """Capture CUDA graphs when the model runs on CUDA. False: pieces always run without graphs."""

    clone_outputs: bool = True
    """Return outputs that the next call cannot overwrite (one copy per output). False returns views of
    graph-owned memory, valid until the next call, as vLLM and SGLang do."""

    graph_mode: str | None = None
    """``"piecewise"``: graphs cut at every splitting op. ``"full"``: one graph of the whole forward per size, for
    calls whose splitting ops are all capturable (``opaque_op(..., capturable=...)``); other calls run without
    graphs. ``"full_and_piecewise"``: full graphs for the calls they serve up to ``max_decode_batch`` tokens,
    piecewise graphs for the rest (vLLM's default). None: ``"full_and_piecewise"`` when every splitting op the
    model calls is capturable for some call, else ``"piecewise"``."""

    max_decode_batch: int | None = None
    """Largest token count served by full graphs (sizes of the ladder up to it). None: the smaller of
    ``max_tokens`` and 256. A decode step of B sequences has B tokens."""

    cache_dir: str | os.PathLike | None = "default"
    """The persistent cache (``piecewise.cache``): a directory for what makes a later process's first call fast
    (Inductor's compiled artifacts, the front-end the first call took). ``"default"``: ``$PIECEWISE_CACHE_DIR``
    (``off`` turns it off), else ``~/.cache/piecewise``; None: off."""

    _sizes: list[int] = field(init=False, repr=False, compare=False)
    _top_given: bool = field(init=False, repr=False, compare=False, default=True)

    def __post_init__(self) -> None:
        if self.max_tokens is None:
            explicit = list(self.capture_sizes or [])
            valid = explicit and all(isinstance(v, int) and v >= 1 for v in explicit)  # bad ones: refused below
            self.max_tokens = max(explicit) if valid else DEFAULT_MAX_TOKENS
            self._top_given = False
        else:
            self._top_given = True
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"CaptureConfig.max_tokens must be a positive int, got {self.max_tokens!r}")
        if self.size_schedule not in SIZE_SCHEDULES:
            raise ValueError(
                f"CaptureConfig.size_schedule must be one of {SIZE_SCHEDULES}, got {self.size_schedule!r}"
            )
        if self.compiler not in COMPILER_CHOICES:
            source = " (from $PIECEWISE_COMPILER)" if self.compiler == os.environ.get("PIECEWISE_COMPILER") else ""
            raise ValueError(f"CaptureConfig.compiler must be one of {COMPILER_CHOICES}, got {self.compiler!r}{source}")
        if self.verify not in VERIFY:
            raise ValueError(f"CaptureConfig.verify must be one of {VERIFY}, got {self.verify!r}")
        if self.graph_mode is not None and self.graph_mode not in GRAPH_MODES:
            raise ValueError(f"CaptureConfig.graph_mode must be None or one of {GRAPH_MODES}, got {self.graph_mode!r}")
        decode = self.max_decode_batch
        if decode is not None and (isinstance(decode, bool) or not isinstance(decode, int) or decode < 1):
            raise ValueError(f"CaptureConfig.max_decode_batch must be None or a positive int, got {decode!r}")
        if self.frontend not in FRONTENDS:
            raise ValueError(f"CaptureConfig.frontend must be one of {FRONTENDS}, got {self.frontend!r}")
        if self.cache_dir is not None and not isinstance(self.cache_dir, (str, os.PathLike)):
            raise ValueError(f"CaptureConfig.cache_dir must be a path, 'default' or None, got {self.cache_dir!r}")
        budget = self.compile_budget_s
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0:
            raise ValueError(f"CaptureConfig.compile_budget_s must be a positive number of seconds, got {budget!r}")
        factor = self.max_padding_factor
        if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor >= 1):
            raise ValueError(f"CaptureConfig.max_padding_factor must be None or a number >= 1, got {factor!r}")
        for name in ("strict", "cuda_graphs", "clone_outputs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"CaptureConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.splitting_ops is not None:
            if isinstance(self.splitting_ops, str):
                raise ValueError(
                    f"CaptureConfig.splitting_ops must be a tuple of 'ns::name' strings, got the string "
                    f"{self.splitting_ops!r}; write ({self.splitting_ops!r},)"
                )
            ops = tuple(self.splitting_ops)
            bad = [op for op in ops if not isinstance(op, str) or op.count("::") != 1]
            if bad:
                raise ValueError(f"CaptureConfig.splitting_ops entries must look like 'ns::name', got {bad!r}")
            self.splitting_ops = ops
        self._sizes = self._resolve_sizes()

    def _resolve_sizes(self) -> list[int]:
        if self.capture_sizes is None:
            ladder = vllm_sizes if self.size_schedule == "vllm" else sglang_sizes
            sizes = ladder(self.max_tokens)
            if not sizes or sizes[-1] != self.max_tokens:
                sizes.append(self.max_tokens)
            return sizes
        sizes = list(self.capture_sizes)
        bad = [s for s in sizes if not isinstance(s, int) or isinstance(s, bool) or s < 1]
        if bad:
            raise ValueError(f"CaptureConfig.capture_sizes must hold positive ints, got {bad!r}")
        duplicates = sorted({s for s in sizes if sizes.count(s) > 1})
        if duplicates:
            raise ValueError(f"CaptureConfig.capture_sizes has duplicate sizes {duplicates!r}")
        too_big = [s for s in sizes if s > self.max_tokens]
        if too_big:
            raise ValueError(
                f"CaptureConfig.capture_sizes has sizes {too_big!r} above max_tokens={self.max_tokens}; "
                f"raise max_tokens or drop them"
            )
        if not sizes:
            raise ValueError("CaptureConfig.capture_sizes is empty; give at least one size or None for the default")
        if self._top_given and max(sizes) < self.max_tokens:
            raise ValueError(
                f"CaptureConfig.capture_sizes tops at {max(sizes)} but max_tokens={self.max_tokens}: calls of "
                f"{max(sizes) + 1}..{self.max_tokens} tokens would have no graph to pad to. Leave max_tokens out "
                f"(the largest capture size is the top of the graphs; larger calls run without graphs) or add "
                f"{self.max_tokens} to capture_sizes"
            )
        return sorted(sizes)

    @property
    def sizes(self) -> list[int]:
        """The resolved capture sizes, ascending."""
        return list(self._sizes)

    def replace(self, **changes) -> "CaptureConfig":
        """A copy with some fields changed (validated again); a ``max_tokens`` that was derived stays derived."""
        if not self._top_given:
            changes.setdefault("max_tokens", None)
        return dataclasses.replace(self, **changes)
