"""The README's main job: every check of the demo must pass and be reported."""

import io

from kvjax.demo import run_demo


def test_demo_passes_every_check():
    out = io.StringIO()
    failed = run_demo(out)
    text = out.getvalue()
    assert failed == 0, text
    for check in ("paged attention [xla] vs reference", "[pallas_gpu, interpret mode]",
                  "[pallas_tpu, interpret mode]", "write_kv", "round trip",
                  "cached greedy tokens == uncached", "prefill tokens computed"):
        assert check in text
    assert "7 passed, 0 failed" in text
