"""Presets: shipped by name, read from a path, and every bad one refused with a clear message."""

from pathlib import Path

import numpy as np
import pytest

from kvjax.config.presets import load_preset, preset_dir, preset_names
from kvjax.serving.model import ModelConfig, Transformer, load_weights, save_weights
from kvjax.serving.preset import build_engine_parts


def test_the_tiny_preset_ships_with_its_weights():
    assert "tiny" in preset_names()
    sections = load_preset("tiny")
    cfg = ModelConfig.from_dict(sections["model"])
    assert cfg.num_q_heads % cfg.num_kv_heads == 0 and cfg.vocab_size == 256
    weights = Path(sections["weights"])
    assert weights.is_absolute() and weights.parent == preset_dir() and weights.is_file()
    assert weights.stat().st_size < 1 << 20  # small enough to ship in the wheel


def test_a_path_reads_that_file_and_weights_resolve_beside_it(tmp_path, monkeypatch):
    model_cfg = ModelConfig(num_layers=1, d_model=32, num_q_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64)
    save_weights(Transformer(model_cfg, seed=5), tmp_path / "mine.npz")
    fields = "\n".join(f"{k} = {getattr(model_cfg, k)!r}" for k in model_cfg.__dataclass_fields__)
    preset = tmp_path / "mine.toml"
    preset.write_text(f'weights = "mine.npz"\n[model]\n{fields}\n[cache]\npage_size = 8\nnum_blocks = 8\n'
                      .replace("'", '"'))
    assert load_preset(preset)["weights"] == str((tmp_path / "mine.npz").resolve())
    monkeypatch.chdir(tmp_path)  # a relative path: the weights' path is absolute all the same
    assert load_preset("mine.toml")["weights"] == str((tmp_path / "mine.npz").resolve())
    assert load_preset(str(preset))["cache"] == {"page_size": 8, "num_blocks": 8}
    shipped = build_engine_parts(str(preset), tiers=False)["model"]
    random = build_engine_parts(str(preset), tiers=False, weights="random", seed=1)["model"]
    expected = Transformer(model_cfg, seed=5).embed.embedding[...]
    np.testing.assert_array_equal(shipped.embed.embedding[...], expected)
    assert not np.array_equal(random.embed.embedding[...], expected)


@pytest.mark.parametrize("text, message", [
    ("[model]\nnum_layers = 2\nd_model = \n", r"bad.toml:3:11: invalid TOML: Invalid value$"),
    ("[model]\n[model]\n", r"bad.toml:2:\d+: invalid TOML: "),
    ("[model\n", r"bad.toml:1:\d+: invalid TOML: "),
    ("weights = 3\n[model]\n", r"bad.toml: weights=3 must be the name of a weights file beside the preset"),
    # a misspelled section or name used to be ignored: no tiers, or random weights, without a word
    ("[tier]\nhost_bytes = 1\n", r"bad.toml: unknown top-level names \['tier'\]; expected some of \['weights', "),
    ('weight = "tiny.npz"\n', r"bad.toml: unknown top-level names \['weight'\]"),
    ("cache = 5\n", r"bad.toml: cache = 5 must be a \[cache\] table"),
])
def test_a_bad_preset_file_names_file_line_and_problem(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_preset(path)


def test_unknown_names_and_missing_files_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"^preset 'nope' is not a shipped preset; expected one of \['tiny'"):
        load_preset("nope")
    with pytest.raises(ValueError, match=r"preset '' is not a shipped preset"):
        load_preset("")
    with pytest.raises(ValueError, match=r"preset file '.*missing.toml' does not exist; expected a TOML file"):
        load_preset(tmp_path / "missing.toml")
    with pytest.raises(ValueError, match=r"preset file '.*' is a directory"):
        load_preset(str(tmp_path) + "/")
    with pytest.raises(ValueError, match=r"preset=3 must be a preset name or the path of a .toml file"):
        load_preset(3)
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes("name = 'caf\xe9'\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.toml: not UTF-8 text \(invalid continuation byte at byte 11\)"):
        load_preset(latin1)


def test_weights_argument_is_checked(tmp_path):
    with pytest.raises(ValueError, match=r"weights=3 must be None \(the preset's\), 'random' or a path"):
        build_engine_parts("tiny", weights=3)
    with pytest.raises(ValueError, match=r"weights file '.*nowhere.npz' does not exist"):
        build_engine_parts("tiny", weights=str(tmp_path / "nowhere.npz"))


def test_a_preset_copied_without_its_weights_says_where_it_looked(tmp_path):
    """The shipped tiny.toml copied to edit: its weights = "tiny.npz" is read beside the copy.
    The error named only a path, not the preset's entry that led there nor the way out."""
    preset = tmp_path / "mine.toml"
    preset.write_text((preset_dir() / "tiny.toml").read_text())
    with pytest.raises(ValueError, match=r"^preset '.*mine.toml' names weights 'tiny.npz', expected beside it at "
                                         r"'.*tiny.npz', which does not exist; copy that file there, or pass "
                                         r"weights='random' \(demo: --random-weights\)$"):
        build_engine_parts(str(preset), tiers=False)
    assert build_engine_parts(str(preset), tiers=False, weights="random")["model"] is not None


def test_npz_weights_round_trip_and_refuse_another_shape(tmp_path):
    cfg = ModelConfig(num_layers=1, d_model=32, num_q_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64)
    model = Transformer(cfg, seed=2)
    save_weights(model, tmp_path / "w.npz")
    save_weights(model, tmp_path / "half.npz", dtype="float16")
    loaded = load_weights(cfg, tmp_path / "w.npz")
    np.testing.assert_array_equal(loaded.layers[0].q_proj.kernel[...], model.layers[0].q_proj.kernel[...])
    half = load_weights(cfg, tmp_path / "half.npz")
    assert half.layers[0].q_proj.kernel[...].dtype == np.float32
    np.testing.assert_allclose(half.layers[0].q_proj.kernel[...], model.layers[0].q_proj.kernel[...],
                               rtol=1e-3, atol=1e-4)
    assert (tmp_path / "half.npz").stat().st_size < (tmp_path / "w.npz").stat().st_size
    wider = ModelConfig(num_layers=1, d_model=32, num_q_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=96)
    with pytest.raises(ValueError, match=r"parameter 'layers/0/down/kernel' is \(64, 32\) there, the config "
                                         r"needs \(96, 32\)"):
        load_weights(wider, tmp_path / "w.npz")
    deeper = ModelConfig(num_layers=2, d_model=32, num_q_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64)
    with pytest.raises(ValueError, match=r"parameter 'layers/1/attn_norm/scale' is missing there"):
        load_weights(deeper, tmp_path / "w.npz")
    with pytest.raises(ValueError, match="already exists; expected a new path"):
        save_weights(model, tmp_path / "w.npz")
    with pytest.raises(ValueError, match=r"dtype='float16' applies to .npz files only"):
        save_weights(model, tmp_path / "dir", dtype="float16")
