"""``piecewise doctor TARGET``: exit codes 0 / 1 / 2 and what the user reads."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from piecewise.cli import main

HERE = os.path.dirname(os.path.abspath(__file__))
TARGETS = os.path.join(HERE, "fixtures", "doctor_targets.py")
SRC = os.path.join(os.path.dirname(HERE), "src")


def target(factory: str) -> str:
    return f"{TARGETS}:{factory}"


def test_clean_model_exits_0(capsys: pytest.CaptureFixture) -> None:
    assert main(["doctor", target("clean_model")]) == 0
    assert "capture-safe" in capsys.readouterr().out


def test_three_element_factory_result_is_accepted(capsys: pytest.CaptureFixture) -> None:
    assert main(["doctor", target("clean_model_with_kwargs")]) == 0


def test_blocked_model_exits_1_with_the_report(capsys: pytest.CaptureFixture) -> None:
    assert main(["doctor", target("jit_model")]) == 1
    out = capsys.readouterr().out
    assert "jit_subprocess" in out
    assert "get_cuda_version" in out
    assert "piecewise.wrap_opaque(fakejit.fp4_quantize" in out


def test_json_output_is_pure_json(capsys: pytest.CaptureFixture) -> None:
    assert main(["doctor", target("jit_model"), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is False
    assert [b["kind"] for b in data["blockers"]] == ["jit_subprocess"]
    assert [f["function"] for f in data["blockers"][0]["chain"]][-1] == "get_cuda_version"


@pytest.mark.parametrize(
    "argv_target, expected",
    [
        (TARGETS, "is not PATH:FACTORY"),
        (os.path.join(HERE, "fixtures", "no_such_file.py") + ":make", "does not exist"),
        (target("no_such_factory"), "has no function 'no_such_factory'"),
        (target("NOT_CALLABLE"), "is not a function"),
        (target("not_a_pair"), "must return (model, args) or (model, args, kwargs)"),
        (target("args_not_a_tuple"), "wrap the inputs in a tuple"),
        (target("bad-name"), "is not a Python identifier"),
    ],
    ids=["no-factory", "missing-file", "missing-factory", "not-callable", "wrong-result", "args-not-tuple",
         "bad-name"],
)
def test_usage_errors_exit_2_and_say_what_was_wrong(
    argv_target: str, expected: str, capsys: pytest.CaptureFixture
) -> None:
    assert main(["doctor", argv_target]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("piecewise doctor: error: ")
    assert expected in captured.err


def test_missing_subcommand_and_unknown_options_exit_2(capsys: pytest.CaptureFixture) -> None:
    assert main([]) == 2
    assert main(["doctor", target("clean_model"), "--no-such-option"]) == 2
    assert "usage: piecewise" in capsys.readouterr().err


def test_console_entry_runs_as_a_process() -> None:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run(
        [sys.executable, "-m", "piecewise", "doctor", target("jit_model")],
        capture_output=True, text=True, env=env, cwd=HERE, timeout=120,
    )
    assert result.returncode == 1, result.stderr
    assert "jit_subprocess" in result.stdout
    chain = result.stdout[result.stdout.index("call chain"):]
    assert "blocker_models.py" in chain and "cli.py" not in chain and "__main__" not in chain  # forward first


def test_a_factory_that_raises_names_its_line_and_an_output_folder_that_is_missing_is_a_usage_error(
        tmp_path, capsys: pytest.CaptureFixture) -> None:
    factory = tmp_path / "broken.py"
    factory.write_text("def settings():\n    return {}\n\n\ndef factory():\n    return settings()['tokenz']\n")
    assert main(["run", f"{factory}:factory"]) == 2
    assert re.search(r"factory\(\) raised KeyError: 'tokenz' at .*broken.py:6 \(`return settings\(\)\['tokenz'\]`\)",
                     capsys.readouterr().err)
    assert main(["verify", target("clean_model"), "--json", str(tmp_path / "missing" / "x.json")]) == 2
    assert "the folder" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--help"], ["run", "no/such/file.py:factory"], ["doctor", "no-colon"]])
def test_help_and_usage_errors_do_not_import_torch(argv: list[str]) -> None:
    # Cold `piecewise --help` must stay fast: torch and Dynamo alone take seconds to import.
    code = ("import sys; from piecewise.cli import main; status = main(%r); "
            "sys.exit(10 + status if 'torch' in sys.modules else status)" % (argv,))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": SRC}, timeout=120)
    assert done.returncode == (0 if argv == ["--help"] else 2), done.stderr


def test_the_demo_jit_example_runs_breakable_and_verifies(capsys: pytest.CaptureFixture) -> None:
    example = os.path.join(os.path.dirname(HERE), "examples", "jit_in_layer.py")
    assert main(["doctor", f"{example}:example"]) == 1
    assert "use breakable" in capsys.readouterr().out
    with pytest.warns(UserWarning, match="runs with the breakable front-end"):
        assert main(["verify", f"{example}:example", "--max-tokens", "8"]) == 0
    assert "breakable front-end" in capsys.readouterr().out


CLI_TARGETS = os.path.join(HERE, "fixtures", "cli_targets.py")


def test_piped_doctor_wraps_its_cards_and_keeps_every_word_of_the_fix(
        capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")  # what a pipe gets: rich's default width
    assert main(["doctor", target("jit_model"), "--json"]) == 1
    fix = json.loads(capsys.readouterr().out)["blockers"][0]["fix"]
    assert main(["doctor", target("jit_model")]) == 1  # stdout is captured: not a terminal
    out = capsys.readouterr().out
    cards = [line for line in out.splitlines() if line[:1] in "│╭╰"]
    assert cards and max(len(line) for line in cards) <= 80  # wrapped inside the card, not cut at its border
    words = set(re.sub("[│╭╮╰╯─]", " ", out).split())
    assert [word for word in fix.split() if word not in words] == []


def test_a_target_file_imports_the_modules_beside_it(capsys: pytest.CaptureFixture) -> None:
    beside = os.path.join(HERE, "fixtures", "beside", "target.py")
    assert main(["doctor", f"{beside}:make"]) == 0, capsys.readouterr().err
    assert "capture-safe" in capsys.readouterr().out
    assert os.path.dirname(beside) not in sys.path  # on the path for the command, not after


@pytest.mark.parametrize("command", ["run", "verify"])
def test_a_refusal_is_one_line_with_the_fix_on_every_command(command: str, capsys: pytest.CaptureFixture) -> None:
    assert main([command, f"{CLI_TARGETS}:refused"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"piecewise {command}: `+=` at ") and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert "updates `self.steps` in place from its own value" in err and "Keep such state out" in err


def test_an_error_of_the_model_keeps_its_traceback() -> None:
    with pytest.raises(ValueError, match="the model's own error"):  # a ValueError, but not piecewise's
        main(["run", f"{CLI_TARGETS}:broken"])


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
def test_run_takes_the_front_end(frontend: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["run", f"{CLI_TARGETS}:linear", "--frontend", frontend, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["frontend"] == frontend


def test_runner_options_the_config_refuses_are_usage_errors(capsys: pytest.CaptureFixture) -> None:
    assert main(["verify", f"{CLI_TARGETS}:linear", "--max-tokens", "0"]) == 2
    err = capsys.readouterr().err
    assert "piecewise verify: error: " in err and "max_tokens must be a positive int, got 0" in err


def test_checkpoint_on_a_missing_folder_says_it_is_missing(capsys: pytest.CaptureFixture) -> None:
    missing = os.path.join(HERE, "fixtures", "no_such_checkpoint")
    assert main(["checkpoint", missing]) == 2
    err = capsys.readouterr().err
    assert f"{missing}: no such folder" in err and "*.safetensors" in err and "hf_quant_config.json" in err


def test_doctor_names_a_method_holding_a_lock_as_the_user_wrote_it(
        capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    root = os.path.dirname(HERE)
    monkeypatch.chdir(root)
    assert main(["doctor", "examples/jit_in_layer.py:example", "--json"]) == 1
    fix = json.loads(capsys.readouterr().out)["blockers"][0]["fix"]
    assert fix.startswith("`CheckedNorm.forward` (in examples/jit_in_layer.py) runs host-side setup")
    with open("examples/jit_in_layer.py") as source:
        lock_line = next(n for n, line in enumerate(source, start=1) if "with _lock:" in line)
    assert f"at line {lock_line}." in fix and "`CheckedNorm.__init__`" in fix and "frontend='breakable'" in fix
    assert "piecewise_target" not in fix and "jit_in_layer.forward" not in fix


def test_doctor_names_a_function_of_a_target_file_by_its_name_and_file(
        capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(os.path.dirname(HERE))
    assert main(["doctor", "tests/fixtures/cli_targets.py:llama_with_locked_attention", "--json"]) == 1
    fix = json.loads(capsys.readouterr().out)["blockers"][0]["fix"]
    assert fix.startswith("`locked_attention` (in tests/fixtures/cli_targets.py) runs host-side setup")
    assert "locked_attention = piecewise.wrap_opaque(locked_attention, fake=lambda q, k, v, positions, " in fix
    assert "piecewise_target" not in fix


@pytest.mark.parametrize("command", ["run", "doctor"])
def test_a_fake_of_the_wrong_shape_is_named_in_one_line(command: str, capfd: pytest.CaptureFixture) -> None:
    assert main([command, f"{CLI_TARGETS}:wrong_fake"]) == 1
    out, err = capfd.readouterr()
    assert err.splitlines() == [
        f"piecewise {command}: the fake of opaque op `test_fixtures::half_width` returns (4, 8) float32, but the op "
        f"returned (4, 4) float32 on the same inputs (tensor inputs: (4, 8) float32). Dynamo traces the forward with "
        f"the fake's outputs, so the code after the op would be traced for the wrong shape: make the fake return the "
        f"real output's shape and dtype (e.g. x.new_empty(...) from its inputs)."]  # and no torch logging


def test_a_kv_cache_too_short_is_one_line_naming_max_seq_len(capsys: pytest.CaptureFixture) -> None:
    assert main(["run", f"{CLI_TARGETS}:short_cache"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "piecewise run: position 7 is past the KV cache, whose max_seq_len is 4 (positions 0 to 3): make a longer "
        "cache, make_kv_cache(max_seq_len=8) or more"]
