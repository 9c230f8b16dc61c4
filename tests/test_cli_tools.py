"""``piecewise bench`` and ``piecewise generate`` on CPU: the table's rows and numbers (JSON), the plot, factory
targets at several token counts, and the usage errors a user must read."""

from __future__ import annotations

import json
import os

import pytest
import torch

from piecewise.cli import main

transformers = pytest.importorskip("transformers")
HERE = os.path.dirname(os.path.abspath(__file__))
TARGETS = os.path.join(HERE, "fixtures", "doctor_targets.py")


@pytest.fixture
def checkpoint(tmp_path):
    """A transformers config folder without weights (a small Llama)."""
    transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             eos_token_id=255).save_pretrained(tmp_path)
    return str(tmp_path)


def test_bench_of_a_checkpoint_times_eager_each_mode_and_auto_with_their_errors(checkpoint, capsys, tmp_path):
    png = tmp_path / "bench.png"
    pytest.importorskip("matplotlib")
    assert main(["bench", checkpoint, "--random-weights", "--decode", "1,3", "--prefill", "6", "--context", "6",
                 "--modes", "breakable,dynamo", "--rounds", "1", "--json", "--plot", str(png)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [c["label"] for c in report["calls"]] == ["decode B=1", "decode B=3", "prefill 6"]
    rows = {row["name"]: row for row in report["modes"]}
    assert list(rows) == ["eager", "breakable", "dynamo", "auto"]
    for name, row in rows.items():
        assert not row["error"], (name, row["error"])
        assert set(row["ms"]) == {"decode B=1", "decode B=3", "prefill 6"} and min(row["ms"].values()) > 0
        assert max(row["rel_error"].values()) <= 1e-5, (name, row["rel_error"])  # the same numbers as eager
    assert rows["breakable"]["chosen"].startswith("breakable, ") and report["auto"] == rows["auto"]["chosen"]
    assert rows["breakable"]["first_call_s"] > 0
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_bench_of_a_factory_takes_its_inputs_at_each_token_count(capsys):
    assert main(["bench", f"{TARGETS}:clean_model", "--tokens", "2,5", "--modes", "breakable", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "2 tokens ms" in out and "5 tokens ms" in out and "breakable" in out and "auto →" in out


@pytest.mark.parametrize("argv,message", [
    (["--modes", "fastest"], r"unknown mode\(s\) \['fastest'\]; the modes: dynamo, dynamo\+full, dynamo\+inductor"),
    (["--decode", "1,x"], r"--decode takes comma-separated token counts"),
    (["--rounds", "0"], r"argument --rounds: must be at least 1, got 0"),
    (["--plot", "/nonexistent-folder/p.png"], r"--plot /nonexistent-folder/p.png: the folder /nonexistent-folder does "
                                              r"not exist"),
    (["--tokens", "4"], r"--tokens is for a path/to/file.py:factory target; a checkpoint folder takes --decode"),
    ([], r"holds a config but no weights: add --random-weights"),
    (["--context", "-5"], r"argument --context: must be 0 or more, got -5"),
])
def test_bench_usage_errors_say_what_to_give(checkpoint, capsys, argv, message):
    import re

    extra = [] if "holds" in message else ["--random-weights"]
    assert main(["bench", checkpoint, *extra, *argv]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_generate_prints_the_greedy_tokens_transformers_generates(checkpoint, capsys):
    from piecewise.bench import load_transformers

    model = load_transformers(checkpoint, random_weights=True)  # the weights the command makes (seeded)
    prompts = [torch.tensor([5, 6, 7, 8]), torch.tensor([9, 10])]
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(input_ids=prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=5, do_sample=False, eos_token_id=255, pad_token_id=0)
            expected.append(out[0, len(prompt):].tolist())
    assert main(["generate", checkpoint, "--random-weights", "--prompt-ids", "5,6,7,8", "--prompt-ids", "9,10",
                 "-n", "5", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"new_tokens": expected}
    assert main(["generate", checkpoint, "--random-weights"]) == 2
    assert "give at least one --prompt TEXT or --prompt-ids 1,2,3" in capsys.readouterr().err


def test_bench_of_a_factory_without_an_inputs_function_says_what_to_write(capsys):
    assert main(["bench", f"{TARGETS}:jit_model", "--tokens", "2,5"]) == 2
    assert "--tokens needs jit_model_inputs(num_tokens) beside jit_model in the target's file" in capsys.readouterr().err


def test_bench_of_a_batch_first_factory_counts_its_tokens_as_the_runner_does(capsys):
    """gpt-fast's ids [1, 7] are 7 tokens (the runner takes them batch-first): counted as 1, every mode was built for
    one token and refused the call, the table cut its reason mid-sentence."""
    assert main(["bench", f"{TARGETS}:gpt_fast_prefill", "--modes", "breakable,dynamo", "--rounds", "1",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [call["label"] for call in report["calls"]] == ["7 tokens"], report["calls"]
    rows = {row["name"]: row for row in report["modes"]}
    assert not rows["breakable"]["error"] and not rows["dynamo"]["error"], rows
    assert max(rows["dynamo"]["rel_error"].values()) <= 1e-5


@pytest.mark.parametrize("argv,message", [
    (["--prompt-ids", "1,2,x"], r"--prompt-ids takes comma-separated token ids, e\.g\. 1,2,3; got '1,2,x'"),
    (["--prompt-ids", "1,2", "--top-p", "0"], r"top_p 0\.0 \(in \(0, 1\]\)"),
    (["--prompt-ids", "1,99999"], r"token id 99999, outside the model's vocabulary of 256"),
])
def test_generate_bad_input_says_what_to_give(checkpoint, capsys, argv, message):
    import re

    assert main(["generate", checkpoint, "--random-weights", *argv]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_bench_of_a_factory_refuses_a_checkpoints_flags_rather_than_ignoring_them(capsys):
    assert main(["bench", f"{TARGETS}:clean_model", "--decode", "1,8"]) == 2
    assert "--decode and --prefill are for a transformers checkpoint folder" in capsys.readouterr().err


def test_cache_list_piped_keeps_whole_names_and_keys(tmp_path, capsys, monkeypatch):
    """Piped (not a terminal), the table is as wide as its rows: the model's qualified name and key are whole."""
    import torch

    import piecewise
    from piecewise.models.llama import LlamaConfig, TinyLlama

    model = TinyLlama(LlamaConfig(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                                  head_dim=8, intermediate_size=16, max_seq_len=16)).eval()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=4, cache_dir=tmp_path))
    with torch.no_grad():
        runner(torch.arange(3), torch.arange(3), model.make_kv_cache())
    capsys.readouterr()
    assert main(["cache", "list", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    key = piecewise.cache.Store(tmp_path).list()[0]["key"]
    assert "piecewise.models.llama.TinyLlama" in out and key[:24] in out and "…" not in out


@pytest.mark.parametrize("command", ["bench", "generate"])
@pytest.mark.parametrize("config", ['{"model_type": "nosuchmodel", "hidden_size": 64}', '{"model_type": "llama", '])
def test_a_config_transformers_cannot_load_is_one_line_naming_the_folder(tmp_path, capsys, command, config):
    (tmp_path / "config.json").write_text(config)
    extra = ["--prompt-ids", "5,6"] if command == "generate" else []
    assert main([command, str(tmp_path), "--random-weights", *extra]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path}: transformers cannot load it: " in err and "Traceback" not in err
