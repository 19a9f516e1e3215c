"""The README's main job, reduced: the demo's cached run computes less and outputs the same."""

import io

import pytest
from engine_cases import BLOCKS, BUCKETS, MAX_LEN, MODEL, PAGE, SCHEDULER

from kvjax.__main__ import main
from kvjax.tools.demo import run_demo
from kvjax.tools.workload import WorkloadSpec

SPEC = WorkloadSpec(system_prompts=2, questions_per_system_prompt=3, conversations=2, turns_per_conversation=2,
                    few_shot_templates=1, queries_per_template=3, examples_per_template=2,
                    system_prompt_chars=64, max_new_tokens=4)


@pytest.fixture
def small_preset(tmp_path):
    """A preset with the engine tests' shapes, so the step compiles once for both files."""
    model = "\n".join(f"{k} = {v!r}" for k, v in vars_of(MODEL).items()).replace("'", '"')
    scheduler = "\n".join(f"{k} = {getattr(SCHEDULER, k)!r}" for k in ("max_num_seqs", "token_budget",
                                                                       "max_prefill_chunk"))
    path = tmp_path / "small.toml"
    path.write_text(f"[model]\n{model}\n[cache]\npage_size = {PAGE}\nnum_blocks = {BLOCKS}\n"
                    f"[scheduler]\n{scheduler}\n[engine]\nmax_model_len = {MAX_LEN}\n"
                    f"token_buckets = {list(BUCKETS)}\n")
    return str(path)


def vars_of(config):
    return {name: getattr(config, name) for name in config.__dataclass_fields__}


def test_reduced_demo_saves_prefill_with_identical_outputs(small_preset, tmp_path):
    out, progress = io.StringIO(), io.StringIO()
    plot = tmp_path / "ttft.png"
    result = run_demo(out, preset=small_preset, spec=SPEC, plot_path=str(plot), progress=progress)
    text = out.getvalue()
    assert result.identical and result.ok, text
    assert result.prefill_tokens["cached"] < result.prefill_tokens["uncached"]
    num_requests = 2 * 3 + 2 * 2 + 3
    assert len(result.results["cached"].outputs) == num_requests
    for row in ("metric", "cached", "uncached", "prefill_tokens", "ttft p50 (ms)", "token hit rate"):
        assert row in text
    assert "same generated tokens with and without the cache: yes" in text
    assert f"{num_requests}/{num_requests} requests" in progress.getvalue()
    if "plot skipped" not in text:
        assert plot.read_bytes().startswith(b"\x89PNG")


def test_demo_command_lists_its_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    for option in ("--plot", "--no-plot", "--tiers", "--kernel-checks", "--no-compile-cache", "--kv-quant",
                   "--kv-scale"):
        assert option in help_text


def test_demo_with_quantized_pages_still_matches_itself(small_preset):
    out = io.StringIO()
    result = run_demo(out, preset=small_preset, spec=SPEC, plot_path=None, progress=None,
                      cache_options={"kv_quant": "int8", "kv_scale": "page"})
    text = out.getvalue()
    assert "pages stored as int8/page" in text
    assert result.identical and result.ok, text


def test_demo_rejects_an_unknown_page_format(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--kv-quant", "int4"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'int4'" in capsys.readouterr().err


def test_kernel_checks_pass_and_are_reported():
    """`demo --kernel-checks`: every implementation this machine can run, against the reference."""
    import io

    from kvjax.tools.demo_kernels import kernel_checks

    out = io.StringIO()
    assert kernel_checks(out) == 0, out.getvalue()
    text = out.getvalue()
    for check in ("paged attention [xla", "[pallas_gpu, interpret mode]",
                  "[pallas_tpu, interpret mode]", "write_kv", "round trip"):
        assert check in text
    assert "FAIL" not in text
