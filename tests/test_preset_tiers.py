"""A preset's host and disk tiers set from ``cache_options`` (as from its [tiers] section)."""

import os
import re

import pytest

from kvjax.config.presets import preset_dir
from kvjax.serving.engine import Engine
from kvjax.serving.preset import build_engine_parts
from kvjax.tiers.disk_lock import LOCK_FILE


def test_cache_options_turn_the_disk_tier_on(tmp_path):
    options = {"disk_dir": str(tmp_path), "disk_bytes": 1 << 24, "host_bytes": 4 << 20, "kv_quant": "int8"}
    cache = build_engine_parts("tiny", cache_options=options)["cache"]
    try:
        config = cache.config
        assert (config.disk_dir, config.disk_bytes, config.host_bytes) == (str(tmp_path), 1 << 24, 4 << 20)
        assert cache.pool.config.kv_quant == "int8"  # [cache] keys still go to [cache]
        assert cache.disk_tier.directory == str(tmp_path) and os.path.exists(tmp_path / LOCK_FILE)
    finally:
        cache.close()
    assert cache.disk_tier.closed


@pytest.mark.parametrize("options, tiers, message", [
    ({"disk_dir": "DIR"}, True, (r"a disk tier \(disk_dir='DIR'\) needs host_bytes > 0 and "
                                 r"disk_bytes > 0; got host_bytes=2097152, disk_bytes=0")),
    ({"disk_dir": "DIR", "disk_bytes": 1 << 20, "host_bytes": 0}, True,
     (r"^cache_options disk_dir='DIR' needs host_bytes > 0 \(the disk tier sits below the host tier\); "
      r"pass host_bytes too$")),
    ({"disk_dir": "DIR", "disk_bytes": 1 << 20}, False,
     r"^cache_options \['disk_bytes', 'disk_dir'\] configure the host and disk tiers, which tiers=False leaves out$"),
    ({"disk_gb": 1}, True, r"unknown \[cache\]/\[tiers\] keys \['disk_gb'\]"),
])  # fmt: skip
def test_cache_options_for_tiers_that_cannot_be_built_are_refused(tmp_path, options, tiers, message):
    directory = str(tmp_path / "disk")
    options = {key: directory if value == "DIR" else value for key, value in options.items()}
    with pytest.raises(ValueError, match=message.replace("DIR", re.escape(directory))):
        build_engine_parts("tiny", tiers=tiers, cache_options=options)
    assert not os.path.exists(directory)  # refused before anything was created


def test_a_disk_directory_written_with_other_weights_is_never_read(tmp_path):
    # the manifests named shapes, dtype and codec only: an engine restarted with other weights
    # of the same shapes fetched the last one's KV from disk and generated other tokens
    options = {"disk_dir": str(tmp_path / "disk"), "disk_bytes": 64 << 20, "write_policy": "write_through"}
    prompt = list(range(1, 65))

    # the same weights with another RoPE base rotate K otherwise: another model's KV too
    other_rope = tmp_path / "rope.toml"
    other_rope.write_text(preset_dir().joinpath("tiny.toml").read_text().replace("rope_theta = 10000.0",
                                                                             "rope_theta = 500000.0"))

    def generate(seed, cache_options, preset="tiny"):
        engine = Engine.from_preset(preset, weights="random", seed=seed, cache_options=cache_options)
        try:
            engine.add_request("r", tokens=prompt, max_new_tokens=4)
            finish = [event for event in engine.run() if hasattr(event, "output_token_ids")][-1]
            assert engine.cache.flush(timeout=60)
            return finish.output_token_ids.tolist(), finish.hit_tokens_by_tier.get("disk", 0)
        finally:
            engine.close()

    assert generate(1, options)[1] == 0
    assert generate(1, options)[1] > 0  # the same weights read what they wrote
    uncached, _ = generate(2, None)
    assert generate(2, options) == (uncached, 0)
    uncached, _ = generate(1, None, str(other_rope))
    assert generate(1, options, str(other_rope)) == (uncached, 0)
