"""The persistent cache: what makes a second process's first call fast.

One directory (``CaptureConfig(cache_dir=...)``; by default ``$PIECEWISE_CACHE_DIR``, else
``$XDG_CACHE_HOME/piecewise`` or ``~/.cache/piecewise``; ``None``, or the variable set to ``off``, turns it off)
holds:

- ``inductor/``: Inductor's own caches (compiled graphs, AOTAutograd results, Triton kernels, autotuning), which
  piecewise points Inductor at (``TORCHINDUCTOR_CACHE_DIR``) unless the user chose a directory for them. Inductor
  keys its entries itself.
- ``entries/<key>.json``: per model, the first call's outcome: the front-end and graph mode taken, why, and what
  was measured. The key hashes the model's code (the source files of its modules' classes), its parameters' and
  buffers' names, shapes and dtypes (not their values), the token arguments, the ``CaptureConfig``, the torch /
  Triton / transformers / piecewise versions and the device. A later first call with the same key takes the
  recorded front-end directly (``frontend="auto"`` skips trying the others).

A missing, corrupt or foreign entry is a miss with one log line, never an error and never a wrong graph: an entry
only ever chooses among the front-ends the first call would try, and the first call checks what it takes as
always. Entries are written whole (a temporary file renamed into place), so concurrent processes see one
complete entry or none. ``piecewise cache`` lists and clears the directory.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

DEFAULT = "default"
"""``CaptureConfig.cache_dir``'s default: the environment's or the user's cache folder (``resolve``)."""
ENVIRONMENT = "PIECEWISE_CACHE_DIR"
FORMAT = 1
"""The entry format; another format is a miss."""


def resolve(setting: str | os.PathLike | None) -> Path | None:
    """The cache directory for ``CaptureConfig.cache_dir``, or None when the cache is off."""
    if setting is None:
        return None
    if str(setting) != DEFAULT:
        return Path(setting).expanduser()
    value = os.environ.get(ENVIRONMENT)
    if value is not None:
        return None if value.strip().lower() in ("", "off", "0", "none") else Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "piecewise"


def _versions() -> dict[str, str]:
    from . import __version__

    versions = {"torch": torch.__version__, "piecewise": __version__, "python": sys.version.split()[0]}
    for name in ("triton", "transformers"):
        module = sys.modules.get(name)
        if module is not None:
            versions[name] = getattr(module, "__version__", "?")
    return versions


def _code(model: torch.nn.Module) -> dict[str, str]:
    """Each module class's qualified name → a hash of its source file (any edit of the file is another model)."""
    files: dict[str, str] = {}
    hashes: dict[str, str] = {}
    for cls in sorted({type(m) for m in model.modules()}, key=lambda c: f"{c.__module__}.{c.__qualname__}"):
        name = f"{cls.__module__}.{cls.__qualname__}"
        try:
            path = inspect.getsourcefile(cls)
        except (TypeError, OSError):
            path = None
        if path is None or not os.path.exists(path):
            hashes[name] = "no source"
            continue
        if path not in files:
            files[path] = hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
        hashes[name] = files[path]
    return hashes


def _device(model: torch.nn.Module) -> str:
    tensor = next(iter(model.parameters()), None)
    tensor = tensor if tensor is not None else next(iter(model.buffers()), None)
    if tensor is not None and tensor.is_cuda:
        props = torch.cuda.get_device_properties(tensor.device)
        return f"{props.name} sm_{props.major}{props.minor}"
    return tensor.device.type if tensor is not None else "cpu"


def _opaque_ops() -> str:
    """A hash of the opaque ops registered (``opaque_op`` / ``wrap_opaque``) and the code of their functions: a fix
    the doctor suggests (wrapping a JIT library's entry point) changes what the first call would take."""
    from .opaque import _opaque_ops

    parts = []
    for name in sorted(_opaque_ops):
        code = getattr(_opaque_ops[name].impl, "__code__", None)
        parts.append(f"{name}:{hashlib.sha256(code.co_code).hexdigest()[:8] if code else ''}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def key_of(model: torch.nn.Module, config: Any, token_names: list[str]) -> tuple[str, dict[str, Any]]:
    """(the entry's key, what it hashes, readable)."""
    import dataclasses

    fields = {f.name: repr(getattr(config, f.name)) for f in dataclasses.fields(config)
              if f.init and f.name != "cache_dir"}
    tensors = [(name, list(t.shape), str(t.dtype)) for name, t in
               [*model.named_parameters(), *model.named_buffers()]]
    from .runtime.layout import inner

    shown = type(inner(model))  # a batch-first model behind the runtime's tokens-first view: the model's own name
    described = {"format": FORMAT, "model": f"{shown.__module__}.{shown.__qualname__}",
                 "code": _code(model), "tensors": hashlib.sha256(json.dumps(tensors).encode()).hexdigest()[:16],
                 "tensor_count": len(tensors), "token_arguments": list(token_names), "config": fields,
                 "opaque_ops": _opaque_ops(),
                 "versions": _versions(), "device": _device(model)}
    digest = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:24]
    return digest, described


class Store:
    """One cache directory."""

    def __init__(self, root: Path):
        self.root = root
        self.entries = root / "entries"
        self.entry_reason = ""
        """Why the recorded front-end was taken, as the entry loaded last says."""

    def load(self, key: str) -> dict[str, Any] | None:
        """The entry for ``key``, or None (a miss, logged once with its reason when it was there but unusable)."""
        path = self.entries / f"{key}.json"
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            logger.info("piecewise: cache entry %s unreadable (%s): a miss", path, exc)
            return None
        try:
            entry = json.loads(data.decode())  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            if not isinstance(entry, dict) or entry.get("format") != FORMAT or entry.get("key") != key:
                raise ValueError("not an entry of this format and key")
            if not isinstance(entry.get("frontend"), str) or not isinstance(entry.get("described", {}), dict) or \
                    not isinstance(entry.get("options", {}), dict):
                raise ValueError("no front-end recorded")
        except ValueError as exc:
            logger.warning("piecewise: cache entry %s is corrupt (%s): a miss; it is written again", path, exc)
            return None
        return entry

    def save(self, key: str, described: dict[str, Any], outcome: dict[str, Any]) -> None:
        """Write the entry whole (a temporary file renamed into place); a failure to write is logged, not raised."""
        entry = {"format": FORMAT, "key": key, "written": time.time(), "described": described, **outcome}
        try:
            self.entries.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.entries, prefix=f".{key}.", suffix=".tmp",
                                             delete=False) as handle:
                json.dump(entry, handle, indent=1)
                temporary = handle.name
            os.replace(temporary, self.entries / f"{key}.json")
        except OSError as exc:
            logger.warning("piecewise: cannot write the cache entry under %s (%s)", self.entries, exc)

    def list(self) -> list[dict[str, Any]]:
        """Every readable entry (model, front-end, graph mode, when written, its file)."""
        found = []
        for path in sorted(self.entries.glob("*.json")) if self.entries.is_dir() else []:
            entry = self.load(path.stem)
            if entry is not None:
                found.append({"key": path.stem, "model": entry.get("described", {}).get("model", "?"),
                              "frontend": entry["frontend"], "graph_mode": entry.get("graph_mode", ""),
                              "first_call_s": entry.get("first_call_s"), "written": entry.get("written"),
                              "path": str(path)})
        return found

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.root.rglob("*") if p.is_file()) if self.root.is_dir() else 0

    def clear(self) -> int:
        """Remove the entries and Inductor's caches under the root; the number of files removed."""
        import shutil

        removed = 0
        for sub in (self.entries, self.root / "inductor"):
            if sub.is_dir():
                removed += sum(1 for p in sub.rglob("*") if p.is_file())
                shutil.rmtree(sub, ignore_errors=True)
        return removed


_UNUSABLE: set[Path] = set()


def usable(root: Path) -> bool:
    """Whether ``root`` can hold the cache (made if missing, a file written and removed); a directory that cannot
    is reported once and the cache is off for it."""
    if root in _UNUSABLE:
        return False
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, prefix=".probe."):
            pass
    except OSError as exc:
        _UNUSABLE.add(root)
        logger.warning("piecewise: the cache directory %s cannot be written (%s): the persistent cache is off; "
                       "set CaptureConfig(cache_dir=...) or $%s to a writable folder, or to None / off", root, exc,
                       ENVIRONMENT)
        return False
    return True


def open_entry(model: torch.nn.Module, config: Any, token_names: list[str]):
    """(the store, the model's key, what the key hashes, its entry or None) for ``config.cache_dir``, with
    Inductor pointed at the store; Nones when the cache is off or its directory cannot be written."""
    root = resolve(config.cache_dir)
    if root is None or not usable(root):
        return None, None, None, None
    use_for_inductor(root)
    store = Store(root)
    key, described = key_of(model, config, token_names)
    return store, key, described, store.load(key)


def use_for_inductor(root: Path) -> None:
    """Point Inductor's caches at ``root/inductor`` unless the user chose a directory for them (the variable set
    to something other than Inductor's own default)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:
        return
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    target = str(root / "inductor")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = target
