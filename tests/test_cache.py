"""The persistent cache (``piecewise.cache``): a later first call takes the recorded front-end directly; a
changed model, config or version misses; a corrupt entry misses with one log line; processes writing at once
leave one whole entry; ``piecewise cache`` lists and clears."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import sys
import warnings

import pytest
import torch

import piecewise
from piecewise import cache
from piecewise.cli import main

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(HERE, "fixtures"))
import break_models as bm  # noqa: E402


def first_call(model, cache_dir, **fields):
    """A runner's first call on a decode-like input; its output and the runner."""
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, cache_dir=cache_dir, **fields))
    ours = model.make_cache()
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        output = runner(torch.arange(3) % 64, torch.arange(3), ours)
    return runner, output, [str(w.message) for w in caught if "piecewise" in str(w.message)]


def test_a_later_first_call_takes_the_recorded_front_end_without_trying_dynamo(tmp_path):
    runner, output, warned = first_call(bm.make("mlp"), tmp_path)
    assert runner.stats["cache"] == "miss" and runner.stats["frontend"] == "breakable"
    assert len(warned) == 1 and "jit_subprocess" in warned[0]  # the Dynamo trial failed, with its warning
    entries = cache.Store(tmp_path).list()
    assert [(e["frontend"], e["model"]) for e in entries] == [("breakable", "break_models.BreakModel")]

    again, output_again, warned_again = first_call(bm.make("mlp"), tmp_path)  # a new model: another process's
    assert again.stats["cache"] == "hit" and again.stats["frontend"] == "breakable"
    assert warned_again == []  # Dynamo was not tried again
    assert "recorded in the cache" in again.stats["frontend_reason"]
    assert again.stats["frontend_reason"].startswith("Dynamo blocked")
    torch.testing.assert_close(output_again, output)
    model = bm.make("mlp")  # and the runner computes what the model does
    with torch.no_grad():
        expected = model(torch.arange(3) % 64, torch.arange(3), model.make_cache())
    torch.testing.assert_close(output_again, expected)


@pytest.mark.parametrize("change", ["model code", "weights shape", "config", "version", "token arguments"])
def test_a_changed_model_config_or_version_misses(tmp_path, monkeypatch, change):
    model = bm.make("mlp")
    config = piecewise.CaptureConfig(max_tokens=8)
    key, _ = cache.key_of(model, config, ["input_ids", "positions"])
    names = ["input_ids", "positions"]
    if change == "model code":
        monkeypatch.setattr(cache, "_code", lambda m: {"break_models.BreakModel": "edited"})
    elif change == "weights shape":
        model = bm.BreakModel("mlp", dim=8)
    elif change == "config":
        config = piecewise.CaptureConfig(max_tokens=16)
    elif change == "version":
        monkeypatch.setattr(torch, "__version__", torch.__version__ + ".other")
    else:
        names = ["input_ids"]
    assert cache.key_of(model, config, names)[0] != key


def test_the_key_ignores_parameter_values_and_the_cache_dir_itself():
    one, other = bm.make("mlp", seed=0), bm.make("mlp", seed=1)
    assert cache.key_of(one, piecewise.CaptureConfig(cache_dir="/a"), ["x"])[0] == \
        cache.key_of(other, piecewise.CaptureConfig(cache_dir="/b"), ["x"])[0]


@pytest.mark.parametrize("damage", ["truncated", "not json", "another key", "not text"])
def test_a_corrupt_entry_is_a_miss_with_one_log_line_and_is_written_again(tmp_path, caplog, damage):
    runner, output, _ = first_call(bm.make("mlp"), tmp_path)
    path = tmp_path / "entries" / (cache.Store(tmp_path).list()[0]["key"] + ".json")
    text = path.read_text()
    if damage == "not text":
        path.write_bytes(b"\xff\xfe\x00garbage")
    else:
        path.write_text({"truncated": text[: len(text) // 2], "not json": "\x00garbage",
                         "another key": text.replace('"key": "', '"key": "x')}[damage])
    with caplog.at_level(logging.INFO, logger="piecewise.cache"):
        again, output_again, warned = first_call(bm.make("mlp"), tmp_path)
    corrupt = [r for r in caplog.records if "corrupt" in r.getMessage()]
    assert len(corrupt) == 1 and str(path) in corrupt[0].getMessage()
    assert again.stats["cache"] == "miss" and again.stats["frontend"] == "breakable"
    torch.testing.assert_close(output_again, output)
    assert json.loads(path.read_text())["frontend"] == "breakable"  # whole again


def test_an_entry_found_with_the_front_end_given_by_the_config_is_said_so(tmp_path):
    runner, output, _ = first_call(bm.make("mlp"), tmp_path, frontend="breakable")
    assert runner.stats["cache"] == "miss"
    again, output_again, _ = first_call(bm.make("mlp"), tmp_path, frontend="breakable")
    assert again.stats["cache"] == "hit, front-end given by the config"
    torch.testing.assert_close(output_again, output)


def test_a_recorded_front_end_that_fails_now_falls_back_to_the_search(tmp_path):
    """An entry only orders the candidates: one recording Dynamo for a model Dynamo cannot take (a JIT call added
    after the entry was written, say) costs a failed trial, never a wrong result."""
    model = bm.make("mlp")
    # the default compiler="auto" has nothing to measure on a CPU: the runner is keyed as with eager pieces
    config = piecewise.CaptureConfig(max_tokens=8, cache_dir=tmp_path, compiler="eager")
    key, described = cache.key_of(model, config, ["input_ids", "positions"])
    cache.Store(tmp_path).save(key, described, {"frontend": "dynamo", "options": {"on_blocker": "report"},
                                                "frontend_reason": "recorded"})
    runner, output, warned = first_call(model, tmp_path)
    assert runner.stats["cache"] == "hit" and runner.stats["frontend"] == "breakable"
    assert len(warned) == 1
    with torch.no_grad():
        fresh = bm.make("mlp")
        torch.testing.assert_close(output, fresh(torch.arange(3) % 64, torch.arange(3), fresh.make_cache()))


def test_off_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("PIECEWISE_CACHE_DIR", str(tmp_path / "env"))
    runner, _, _ = first_call(bm.make("mlp"), None)
    assert runner.stats["cache"] == "off" and not (tmp_path / "env").exists()
    monkeypatch.setenv("PIECEWISE_CACHE_DIR", "off")
    runner, _, _ = first_call(bm.make("mlp"), "default")
    assert runner.stats["cache"] == "off"
    monkeypatch.setenv("PIECEWISE_CACHE_DIR", str(tmp_path / "env"))
    runner, _, _ = first_call(bm.make("mlp"), "default")
    assert runner.stats["cache"] == "miss" and cache.Store(tmp_path / "env").list()


def test_cache_dir_must_be_a_path_or_none():
    with pytest.raises(ValueError, match=r"cache_dir must be a path, 'default' or None, got 3"):
        piecewise.CaptureConfig(cache_dir=3)


def _writer(root: str, barrier, index: int, rounds: int) -> None:
    store = cache.Store(cache.Path(root))
    barrier.wait()
    for round_ in range(rounds):
        store.save("shared", {"writer": index}, {"frontend": f"writer-{index}", "round": round_, "pad": "x" * 20000})


def _reader(root: str, barrier, rounds: int, seen) -> None:
    store = cache.Store(cache.Path(root))
    barrier.wait()
    for _ in range(rounds):
        entry = store.load("shared")
        seen.append("none" if entry is None else entry["frontend"] if len(entry["pad"]) == 20000 else "partial")


def test_processes_writing_one_entry_at_once_leave_it_whole(tmp_path):
    """Two writers and a reader on one entry, started together: every read is a whole entry (or none yet)."""
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(3)
    with context.Manager() as manager:
        seen = manager.list()
        processes = [context.Process(target=_writer, args=(str(tmp_path), barrier, i, 200)) for i in range(2)]
        processes.append(context.Process(target=_reader, args=(str(tmp_path), barrier, 400, seen)))
        for process in processes:
            process.start()
        for process in processes:
            process.join(120)
        assert [p.exitcode for p in processes] == [0, 0, 0]
        assert set(seen) <= {"none", "writer-0", "writer-1"}, set(seen)
    assert cache.Store(tmp_path).load("shared")["frontend"] in ("writer-0", "writer-1")
    assert not list((tmp_path / "entries").glob("*.tmp"))


def test_cli_lists_and_clears(tmp_path, capsys):
    first_call(bm.make("mlp"), tmp_path)
    assert main(["cache", "list", "--dir", str(tmp_path), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [e["frontend"] for e in listed["entries"]] == ["breakable"] and listed["dir"] == str(tmp_path)
    assert main(["cache", "clear", "--dir", str(tmp_path)]) == 0
    assert "removed" in capsys.readouterr().out
    assert cache.Store(tmp_path).list() == []


def test_an_unwritable_cache_directory_turns_the_cache_off_with_one_warning(tmp_path, caplog):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="piecewise.cache"):
        runner, output, _ = first_call(bm.make("mlp"), blocked / "cache")
        again, _, _ = first_call(bm.make("mlp"), blocked / "cache")
    assert runner.stats["cache"] == "off" and again.stats["cache"] == "off"
    assert len([r for r in caplog.records if "cannot be written" in r.getMessage()]) == 1


class _RandomAfterBreak(torch.nn.Module):
    """A JIT-style call (Dynamo blocked) and a Python random draw (breakable refuses the frozen value): auto's
    third candidate, Dynamo with graph breaks, takes it."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        import random

        return self.lin(bm.jit_scale(x)) + random.random() * 1e-30


def test_the_entry_records_the_dynamo_candidate_that_took_the_forward(tmp_path):
    config = piecewise.CaptureConfig(max_tokens=4, cache_dir=tmp_path)
    for _ in range(2):
        runner = piecewise.compile(_RandomAfterBreak(), config, dynamic={"x": 0})
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runner(torch.randn(3, 8))
        assert runner.stats["frontend"] == "dynamo"
    (entry,) = [json.loads(p.read_text()) for p in (tmp_path / "entries").glob("*.json")]
    assert entry["options"] == {"on_blocker": "break"}
    assert runner.stats["cache"] == "hit"  # the second first call took the recorded candidate


_SCALE = torch.rand(8)


class _OneTokenPath(torch.nn.Module):
    """Dynamo's trace holds for more than one token (calls of 1 padded to 2), so with eager pieces the search moves
    on to breakable, which refuses the forward (a global tensor it would freeze): Dynamo is taken after all."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.linear(x)
        if h.shape[0] == 1:
            h = h * 1.0
        return h * _SCALE


def test_a_recorded_front_end_the_search_came_back_to_is_taken_again(tmp_path):
    """The recorded Dynamo candidate, tried first in a later process, was left again for breakable (whose refusal
    then ended the first call): the cache records where the search ended, not a step to retake."""
    outcomes = []
    for _ in range(2):
        model = _OneTokenPath()
        runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, compiler="eager", cache_dir=tmp_path))
        x = torch.randn(3, 8)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.testing.assert_close(runner(x), model(x))
        outcomes.append((runner.stats["cache"], runner.stats["frontend"]))
    assert outcomes == [("miss", "dynamo"), ("hit", "dynamo")]
