"""The README's main job, reduced: the demo's cached run computes less and outputs the same."""

import io

import numpy as np
import pytest
from engine_cases import write_preset

from kvjax.__main__ import main
from kvjax.text.tokenizer import ByteTokenizer
from kvjax.tools.demo import run_demo
from kvjax.tools.workload import WorkloadSpec, _continuation

SPEC = WorkloadSpec(system_prompts=2, questions_per_system_prompt=3, conversations=2, turns_per_conversation=2,
                    few_shot_templates=1, queries_per_template=3, examples_per_template=2,
                    system_prompt_chars=64, max_new_tokens=4)


@pytest.fixture
def small_preset(tmp_path):
    """A preset with the engine tests' shapes, so the step compiles once for both files."""
    return write_preset(tmp_path / "small.toml")


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
    assert "some replies (end of the prompt -> generated text):" in text and "sys0-q0/t0" in text
    assert f"{num_requests}/{num_requests} requests" in progress.getvalue()
    if "plot skipped" not in text:
        assert plot.read_bytes().startswith(b"\x89PNG")


def test_demo_with_tiers_hits_host_and_disk_and_builds_nothing_after_warmup(tmp_path):
    """Prompts visited in turn outgrow a small device pool and host tier: later questions hit
    their prefix on host and on disk, the outputs stay the same, and serving compiles nothing."""
    # 64 device blocks over 24 host blocks: with 40, which pages reach disk depends on how the
    # requests batch (arrival timing), and about 1 run in 6 hit none there
    preset = write_preset(tmp_path / "tiered.toml", host_blocks=24)
    preset_disk = tmp_path / "preset-disk"
    with open(preset, "a") as file:  # the demo's disk tier replaces the preset's, and says so
        file.write(f'disk_dir = "{preset_disk}"\ndisk_bytes = {1 << 20}\n')
    spec = WorkloadSpec(system_prompts=10, questions_per_system_prompt=3, system_prompt_chars=120,
                        rotate_prompts=True, conversations=1, turns_per_conversation=2, few_shot_templates=1,
                        queries_per_template=2, examples_per_template=2, max_new_tokens=4)  # fmt: skip
    out = io.StringIO()
    result = run_demo(out, preset=preset, spec=spec, plot_path=None)
    text = out.getvalue()
    assert result.identical and result.ok, text
    hits = result.engines["cached"].metrics.to_json()["counters"]["hit_tokens"]
    assert hits["host"] > 0 and hits["disk"] > 0, hits
    assert ("tiers of the cached run: device 64 blocks, host 24 blocks, disk 64 MiB in a temporary directory "
            f"(not the preset's disk_dir {str(preset_disk)!r})") in text
    assert not preset_disk.exists()
    assert "its misses of prompts seen before count as other_namespace)" in text
    assert "compilations after warm-up: 0 cached, 0 uncached" in text


def test_demo_command_lists_its_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    for option in ("--plot", "--no-plot", "--no-tiers", "--kernel-checks", "--no-compile-cache", "--kv-quant",
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


@pytest.mark.parametrize("low_ms, high_ms", [(12.1, 12.9), (12.0, 18.0), (12.0, 1200.0), (0.5, 20_000.0)])
def test_ttft_plot_ticks_do_not_overlap_and_headline_and_caption_show(low_ms, high_ms):
    """The CDF's x tick labels stayed readable whatever the spread of TTFTs (a log axis over
    less than a decade used to label its minor ticks, which overlapped)."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvjax.tools.demo_report import UNCACHED_CAPTION, ttft_figure

    rng = np.random.default_rng(0)
    ids = [f"r{i}" for i in range(40)]
    uncached = dict(zip(ids, np.geomspace(low_ms, high_ms, 40) / 1e3))
    cached = {rid: seconds * rng.uniform(0.4, 1.0) if low_ms * 2 < high_ms else seconds
              for rid, seconds in uncached.items()}
    fig = ttft_figure({"cached": cached, "uncached": uncached}, ids)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for axes in fig.axes:
        for axis in (axes.xaxis, axes.yaxis):
            labels = [t for t in axis.get_ticklabels(which="both") if t.get_visible() and t.get_text()]
            boxes = sorted((t.get_window_extent(renderer) for t in labels), key=lambda b: (b.x0, b.y0))
            texts = [t.get_text() for t in labels]
            assert len(boxes) >= 2 and len(set(texts)) == len(texts), texts
            assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:]), \
                [t.get_text() for t in labels]
    p50 = np.percentile(1e3 * np.array(list(uncached.values())), 50)
    title = fig._suptitle.get_text()
    assert f"uncached p50 {p50:,.0f} ms" in title and "cached p50" in title and "p99" in title
    assert [text.get_text() for text in fig.legends[0].get_texts()] == ["cached", "uncached"]
    assert UNCACHED_CAPTION in [text.get_text() for text in fig.texts]
    assert "namespace of its own" in UNCACHED_CAPTION
    plt.close(fig)


@pytest.mark.parametrize("add_bos, add_eos", [(True, True), (True, False), (False, False)])
def test_a_later_turn_appends_no_bos_or_eos_mid_conversation(add_bos, add_eos):
    # each later turn appended the tokenizer's BOS (and EOS) inside the prompt
    tokenizer = ByteTokenizer(add_bos=add_bos, add_eos=add_eos)
    appended = _continuation(tokenizer, "\nUser: hi\nAssistant:")
    assert appended.tolist() == list(b"\nUser: hi\nAssistant:")
