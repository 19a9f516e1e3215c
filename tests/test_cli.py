"""``python -m kvjax``: subcommands are registered, and bad input gets one line on stderr.

The table below is every bad input a new user met (a preset, a file or a size on the command
line): each exits with the documented status (2 usage, 1 runtime) and prints exactly one
line on stderr naming the value and what was expected, never a traceback.
"""

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from engine_cases import write_preset

from kvjax.__main__ import main
from kvjax.tools.cli import CommandError, run_command
from kvjax.tools.demo_report import check_plot_path

REPO = Path(__file__).resolve().parents[1]
GOOD_LINE = json.dumps({"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [0]})


def run_cli(argv, capsys):
    """``(exit status, stdout, stderr)`` of ``main(argv)``."""
    try:
        code = main(argv)
    except SystemExit as exit_info:  # argparse exits itself
        code = exit_info.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def files(tmp_path):
    """Bad and good input files, by name."""
    paths = {name: tmp_path / name for name in ("syntax.toml", "latin1.toml", "negative.toml",
                                                   "binary.jsonl", "latin1.jsonl", "empty.jsonl",
                                                   "blank.jsonl", "broken.jsonl", "good.jsonl")}
    paths["syntax.toml"].write_text("[model]\nnum_layers = 2\nd_model = \n")
    paths["latin1.toml"].write_bytes("[model]\nname = 'caf\xe9'\n".encode("latin-1"))
    paths["negative.toml"].write_text(Path(write_preset(tmp_path / "small.toml")).read_text()
                                      .replace("num_blocks = 64", "num_blocks = -1"))
    paths["binary.jsonl"].write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)))  # a PNG
    paths["latin1.jsonl"].write_bytes(f"{GOOD_LINE}\n{{\"note\": \"caf\xe9\"}}\n".encode("latin-1"))
    paths["empty.jsonl"].write_bytes(b"")
    paths["blank.jsonl"].write_text("\n  \n")
    paths["broken.jsonl"].write_text(f"{GOOD_LINE}\n{{\"timestamp\": 1,\n")
    paths["good.jsonl"].write_text(GOOD_LINE + "\n")
    paths["dir"] = tmp_path
    paths["short.toml"] = Path(write_preset(tmp_path / "short.toml"))  # max_model_len 384
    paths["four_blocks.toml"] = Path(write_preset(tmp_path / "four_blocks.toml", num_blocks=4, max_model_len=2048))
    return {name: str(path) for name, path in paths.items()}


# (argv with {file} placeholders, exit status, regex of the one stderr line)
BAD_INPUT = [
    (["demo", "--preset", "nope"], 2,
     r"kvjax demo: error: preset 'nope' is not a shipped preset; expected one of \['tiny'\]"),
    (["demo", "--preset", "{dir}/missing.toml"], 2, r"preset file '.*/missing.toml' does not exist; expected a TOML"),
    (["demo", "--preset", "{syntax.toml}"], 2, r"syntax.toml:3:11: invalid TOML: Invalid value"),
    (["demo", "--preset", "{latin1.toml}"], 2, r"latin1.toml: not UTF-8 text .*expected a TOML preset"),
    (["demo", "--preset", "{negative.toml}"], 2, r"num_blocks=-1"),
    (["demo", "--plot", "/nonexistent/dir/x.png"], 2,
     r"plot path '/nonexistent/dir/x.png': folder '/nonexistent/dir' does not exist"),
    (["demo", "--plot", "{dir}"], 2, r"plot path '.*' is a folder; expected a file name"),
    (["demo", "--plot", "{dir}/ttft.txt"], 2, r"ends in '.txt'; expected one of .*\.png"),
    (["demo", "--kv-quant", "int4"], 2, r"argument --kv-quant: invalid choice: 'int4'"),
    (["demo", "--preset", "{four_blocks.toml}", "--no-plot"], 1,
     r"kvjax demo: error: no request finished: all \d+ submitted requests were rejected "
     r"\(first, .*needs \d+ blocks.*has 4\); expected a preset whose pool holds"),
    (["demo", "--preset", "{short.toml}", "--no-plot"], 2,
     r"kvjax demo: error: request 'sys0-q0/t0' needs 1300 prompt \+ 32 new tokens; max_model_len=384"),
    (["replay", "{binary.jsonl}", "--device-blocks", "8"], 2,
     r"binary.jsonl:1: not UTF-8 text \(byte 0x89 at column 1\); expected JSON lines"),
    (["replay", "{latin1.jsonl}", "--device-blocks", "8"], 2, r"latin1.jsonl:2: not UTF-8 text"),
    (["replay", "{broken.jsonl}", "--device-blocks", "8"], 2, r"broken.jsonl:2: not valid JSON"),
    (["replay", "{empty.jsonl}", "--device-blocks", "8"], 1,
     r"kvjax replay: warning: trace '.*empty.jsonl' holds no requests .*nothing replayed"),
    (["replay", "{blank.jsonl}", "--device-blocks", "8"], 1, r"blank.jsonl' holds no requests"),
    (["replay", "{dir}/missing.jsonl", "--device-blocks", "8"], 2, r"No such file .*missing.jsonl"),
    (["replay", "{dir}", "--device-blocks", "8"], 2, r"Is a directory"),
    (["replay", "{good.jsonl}", "--device-blocks", "0"], 2, r"argument --device-blocks: 0 must be >= 1"),
    (["replay", "{good.jsonl}", "--device-blocks", "2k"], 2, r"argument --device-blocks: '2k' is not an integer"),
    (["replay", "{good.jsonl}", "--device-blocks", "8", "--host-blocks", "-1"], 2,
     r"argument --host-blocks: -1 must be >= 0"),
    (["replay", "{good.jsonl}", "--device-blocks", "8", "--disk-blocks", "x"], 2,
     r"argument --disk-blocks: 'x' is not an integer"),
    (["replay", "{good.jsonl}", "--device-blocks", "8", "--block-tokens", "0"], 2,
     r"argument --block-tokens: 0 must be >= 1"),
    (["replay", "{good.jsonl}"], 2, r"the following arguments are required: --device-blocks"),
    # write-through copies every block to the host tier: without one it meant nothing, and ran
    (["replay", "{good.jsonl}", "--device-blocks", "8", "--write-through"], 2,
     r"kvjax replay: error: --write-through needs a host tier \(--host-blocks M with M >= 1\)"),
    (["replay", "{good.jsonl}", "--device-blocks", "8", "--write-through", "--host-blocks", "0"], 2,
     r"--write-through needs a host tier"),
    (["replay", "{good.jsonl}", "--device-blocks", "8", "--write-through", "--nodes", "2"], 2,
     r"--write-through needs a host tier"),
    # an infinite rate ran, and wrote "Infinity" into the --json line (not JSON)
    (["replay", "{good.jsonl}", "--device-blocks", "8", "--nodes", "2", "--prefill-tokens-per-s", "inf"], 2,
     r"prefill_tokens_per_s=inf must be a finite number > 0"),
    (["replay", "{good.jsonl}", "--device-blocks", "8", "--nodes", "2", "--decode-tokens-per-s", "inf"], 2,
     r"decode_tokens_per_s=inf must be a finite number > 0"),
    (["replay", "{good.jsonl}", "--device-blocks", "8", "--nodes", "2", "--link-bytes-per-s", "inf"], 2,
     r"link_bytes_per_s=inf must be a finite number > 0"),
    # every session thread died in time.sleep with a traceback, and the demo exited 0
    (["cluster-demo", "--arrival-ms", "inf"], 2,
     r"kvjax cluster-demo: error: arrival_ms=inf must be in \[0, 3600000\] \(milliseconds between sessions"),
    (["cluster-demo", "--arrival-ms", "1e300"], 2, r"arrival_ms=1e\+300 must be in \[0, 3600000\]"),
    (["serve-everything"], 2, r"invalid choice: 'serve-everything'"),
]


@pytest.mark.parametrize("argv, status, message", BAD_INPUT, ids=[" ".join(case[0]) for case in BAD_INPUT])
def test_bad_input_is_one_line_without_traceback(argv, status, message, tmp_path, capsys):
    paths = files(tmp_path)
    argv = [re.sub(r"\{([^}]+)\}", lambda m: paths[m.group(1)], arg) for arg in argv]
    code, _, err = run_cli(argv, capsys)
    assert code == status, (code, err)
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert "Traceback" not in err
    assert re.search(message, err), err


def test_a_tiny_pool_says_why_nothing_ran_and_claims_nothing(tmp_path, capsys):
    preset = write_preset(tmp_path / "four.toml", num_blocks=4, max_model_len=2048)
    code, out, _ = run_cli(["demo", "--preset", preset, "--no-plot"], capsys)
    assert code == 1
    assert "same generated tokens with and without the cache: not checked" in out
    assert "same generated tokens with and without the cache: yes" not in out
    assert re.search(r"cached run: (\d+) of \1 requests rejected \(first, .*has 4\)", out), out
    assert "fewer)" not in out  # no "0 cached vs 0 uncached (infx fewer)"


@pytest.mark.parametrize("raised, status, line", [
    (ValueError("device_blocks=1000000000000 needs 32 TB of trie; expected at most 1e9"), 2,
     "kvjax replay: error: device_blocks=1000000000000 needs 32 TB of trie; expected at most 1e9"),
    (ValueError("a message\nover two lines"), 2, "kvjax replay: error: a message over two lines"),
    (CommandError("nothing ran"), 1, "kvjax replay: error: nothing ran"),
    (FileNotFoundError(2, "No such file or directory", "x.jsonl"), 1,
     "kvjax replay: error: No such file or directory: 'x.jsonl'"),
    (KeyboardInterrupt(), 130, "kvjax replay: error: interrupted"),
])
def test_command_failures_become_one_line_and_a_status(raised, status, line, capsys):
    def fail(args):
        raise raised

    assert run_command(argparse.Namespace(func=fail), "kvjax replay") == status
    assert capsys.readouterr().err == line + "\n"


def test_a_bug_keeps_its_traceback():
    def broken(args):
        raise RuntimeError("invariant broken")

    with pytest.raises(RuntimeError, match="invariant broken"):
        run_command(argparse.Namespace(func=broken), "kvjax demo")


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"], ["replay", "--help"], ["cluster-demo", "--help"]])
def test_help_is_plain_text(argv, capsys):
    code, out, _ = run_cli(argv, capsys)
    assert code == 0
    assert "``" not in out and ":func:" not in out
    if argv == ["--help"]:
        assert "demo" in out and "replay" in out


def test_cluster_demo_help_describes_it_in_a_whole_sentence(capsys):
    """Its description was the docstring's first line, cut off at "on loopback,"."""
    code, out, _ = run_cli(["cluster-demo", "--help"], capsys)
    description = " ".join(out.split("options:")[0].split("\n\n", 1)[1].split())
    assert code == 0 and description.endswith("side by side.") and "round_robin" in description


@pytest.mark.parametrize("command", ["demo", "replay", "cluster-demo"])
def test_every_option_says_what_it_does_not_only_its_default(command, capsys):
    """``--long-prefix-units`` was documented as "(default: 4)" alone."""
    code, out, _ = run_cli([command, "--help"], capsys)
    options = out.split("options:", 1)[1]
    bare = re.findall(r"^\s+(--[\w-]+)(?: [A-Z_ ]+)?\s*\n\s+\(default", options, re.MULTILINE)
    bare += re.findall(r"^\s+(--[\w-]+)(?: [A-Z_ ]+)?\s+\(default", options, re.MULTILINE)
    assert code == 0 and not bare


def test_the_real_entry_point_prints_one_line(tmp_path):
    """``python -m kvjax`` as a user runs it: a subprocess, from outside the checkout."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-m", "kvjax", "demo", "--preset", "nope"], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "kvjax demo: error: preset 'nope' is not a shipped preset; expected one of ['tiny'] or the path "
        "of a .toml file"]


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc (Linux), a folder where no file can be made")
def test_a_plot_path_that_cannot_be_written_is_refused_before_the_demo_runs(tmp_path, capsys):
    """It was found when the plot was saved, after both runs of the workload (minutes)."""
    with pytest.raises(ValueError, match=r"plot path '/proc/kvjax_ttft.png' cannot be written \(.+\); "
                                         r"expected a file in a folder you can write"):  # fmt: skip
        check_plot_path("/proc/kvjax_ttft.png")
    check_plot_path(tmp_path / "new.png")  # the check leaves nothing behind ...
    assert not (tmp_path / "new.png").exists()
    (tmp_path / "old.png").write_bytes(b"an earlier plot")
    check_plot_path(tmp_path / "old.png")  # ... and changes no file that is there
    assert (tmp_path / "old.png").read_bytes() == b"an earlier plot"
