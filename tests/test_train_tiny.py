"""The tiny model's shipped weights and the script that makes them (kvjax.tools.train_tiny).

The shipped weights must speak (readable bytes, a held-out loss far below a uniform guess)
and, like every weights, leave cached and uncached outputs identical.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvjax.config.presets import load_preset
from kvjax.serving.engine import Engine
from kvjax.serving.engine_events import FinishEvent
from kvjax.serving.model import ModelConfig, load_weights, save_weights
from kvjax.tools.train_tiny import TrainSettings, bits_per_byte, corpus, heldout_sequences, train
from kvjax.tools.workload import WorkloadSpec, build_workload, drive

SMALL = ModelConfig(num_layers=1, d_model=32, num_q_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64)
SPEC = WorkloadSpec(system_prompts=1, questions_per_system_prompt=3, conversations=2, turns_per_conversation=2,
                    few_shot_templates=1, queries_per_template=2, examples_per_template=2,
                    system_prompt_chars=96, max_new_tokens=12)


@functools.cache
def shipped():
    sections = load_preset("tiny")
    return load_weights(ModelConfig.from_dict(sections["model"]), sections["weights"])


def test_heldout_sequences():
    seqs = heldout_sequences("abcdefgh", 2, 3)
    np.testing.assert_array_equal(seqs, [[97, 98, 99], [100, 101, 102]])
    assert heldout_sequences("abcdefgh", seq_len=3).shape == (2, 3)
    with pytest.raises(ValueError, match=r"text has 8 bytes: 2 rows of seq_len=3, fewer than num_seqs=3"):
        heldout_sequences("abcdefgh", 3, 3)


def test_the_corpus_holds_out_what_it_reports_on():
    train_text, heldout_text = corpus()
    assert train_text.startswith("# kvjax") and len(train_text) > 10 * len(heldout_text) / 2
    assert "`" not in train_text and "`" not in heldout_text  # code markup stripped
    first_heldout_paragraph = heldout_text.split("\n\n")[0]
    assert len(first_heldout_paragraph) > 20 and first_heldout_paragraph not in train_text


def test_training_lowers_the_loss_and_writes_weights_that_load(tmp_path):
    text = "the page pool holds the blocks of every cached prefix. " * 40
    model, losses = train(SMALL, text, TrainSettings(steps=40, batch=4, seq_len=32, warmup=5))
    assert len(losses) == 40 and np.mean(losses[-5:]) < 0.6 * losses[0]
    save_weights(model, tmp_path / "small.npz", dtype="float16")
    loaded = load_weights(SMALL, tmp_path / "small.npz")
    sequences = heldout_sequences(text, 2, 64)
    assert bits_per_byte(loaded, sequences) == pytest.approx(bits_per_byte(model, sequences), abs=0.05)
    with pytest.raises(ValueError, match=r"text has 10 bytes; expected more than seq_len=32 \+ 1"):
        train(SMALL, "0123456789", TrainSettings(steps=1, seq_len=32))


def test_the_shipped_weights_speak():
    _, heldout_text = corpus()
    loss = bits_per_byte(shipped(), heldout_sequences(heldout_text, 8, 256))
    assert loss < 4.0  # a uniform guess is 8 bits per byte; random weights are worse
    with Engine.from_preset("tiny", tiers=False) as engine:
        engine.add_request("r", prompt="A block of the page pool is", max_new_tokens=48)
        (finish,) = [e for e in engine.run(summary=False) if isinstance(e, FinishEvent)]
    readable = sum(c.isalpha() or c in " ,.\n" for c in finish.text)
    assert readable >= 0.8 * len(finish.text) and len(set(finish.text.split())) >= 3, finish.text


@functools.partial(jax.jit, static_argnums=0)
def _dense_logits(graphdef, state, tokens):
    return nnx.merge(graphdef, state).forward_dense(tokens)


def test_trained_weights_give_identical_tokens_with_and_without_the_cache():
    sessions = build_workload(SPEC)
    with Engine.from_preset("tiny", tiers=False) as cached, Engine.from_preset("tiny", tiers=False) as uncached:
        hot = drive(cached, sessions)
        cold = drive(uncached, sessions, isolate=True)
        cached.check_invariants()
        hits = cached.metrics.to_json()["counters"]["hit_tokens"]["device"]
    assert hits > 0 and hot.outputs.keys() == cold.outputs.keys()
    assert all(finish.status == "finished" for finish in hot.finishes.values())
    for request_id, tokens in hot.outputs.items():
        np.testing.assert_array_equal(tokens, cold.outputs[request_id], err_msg=request_id)
    # One request against the dense forward (no pool), token by token, padded to one shape.
    finish = hot.finishes["chat0/t1"]
    graphdef, state = nnx.split(shipped())
    tokens = [int(t) for t in finish.prompt_token_ids]
    for _ in range(len(finish.output_token_ids)):
        padded = np.zeros(1024, np.int32)
        padded[: len(tokens)] = tokens
        tokens.append(int(np.argmax(_dense_logits(graphdef, state, jnp.asarray(padded))[len(tokens) - 1])))
    assert tokens[len(finish.prompt_token_ids):] == finish.output_token_ids.tolist()
