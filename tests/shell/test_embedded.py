"""The embedded tiny model and tokenizer: deterministic, cached, char-level, loadable offline.

Asserts :mod:`vime_shell.models.embedded`'s invariants: the same spec gives bit-identical weights in
two cache directories; a finished build is reused untouched and different specs never share a
directory; the tokenizer maps every alphabet character to one token and decodes back exactly;
a bad spec is a typed error.
"""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vime_shell.engines.weights import load_safetensors_dir
from vime_shell.models.embedded import (
    BUNDLED_TEXT, SPECIAL_TOKENS, EmbeddedError, EmbeddedSpec, build_embedded,
)
from vime_shell.models.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_embedded(tmp_path_factory.mktemp("a"))


@pytest.fixture(scope="module")
def tokenizer(built):
    return load_tokenizer(built)


def test_same_spec_same_bits_in_another_directory(built, tmp_path):
    again = build_embedded(tmp_path)
    assert again.name == built.name
    ours, theirs = load_safetensors_dir(built), load_safetensors_dir(again)
    assert ours.keys() == theirs.keys()
    assert all(ours[k].equal(theirs[k]) for k in ours)
    other = load_safetensors_dir(build_embedded(tmp_path, EmbeddedSpec(seed=1)))
    assert not all(ours[k].equal(other[k]) for k in ours)


def test_finished_build_is_reused_and_specs_get_their_own_directory(built):
    stamp = (built / "model.safetensors").stat().st_mtime_ns
    assert build_embedded(built.parent) == built
    assert (built / "model.safetensors").stat().st_mtime_ns == stamp
    narrower = EmbeddedSpec(hidden_size=64, num_attention_heads=1, num_key_value_heads=1)
    assert build_embedded(built.parent, narrower) != built
    assert not [p for p in built.parent.iterdir() if p.name.startswith(".building-")]


def test_default_cache_dir_honours_vime_cache_dir(tmp_path, monkeypatch, built):
    monkeypatch.setenv("VIME_CACHE_DIR", str(built.parent))
    assert build_embedded() == built


def test_model_shape_matches_the_spec(built, tokenizer):
    import json

    config = json.loads((built / "config.json").read_text())
    spec = EmbeddedSpec()
    assert config["model_type"] == "qwen2"
    assert config["hidden_size"] // config["num_attention_heads"] == spec.head_dim == 64
    assert len(tokenizer) == len(SPECIAL_TOKENS) + len(set(BUNDLED_TEXT)) == 19
    assert config["vocab_size"] == spec.padded_vocab_size(len(tokenizer)) == 20
    assert tokenizer.padding_side == "left"
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (0, 1)


def test_reserved_vocabulary_rows_are_zero_and_never_produced(built, tokenizer):
    weights = load_safetensors_dir(built)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert weights[name].shape[0] == 20
        # Row 0 is <pad>, which transformers zeroes in the embedding (padding_idx).
        assert not weights[name][19:].any() and weights[name][1:19].abs().sum(1).min() > 0
    ids = tokenizer(BUNDLED_TEXT + "".join(SPECIAL_TOKENS))["input_ids"]
    assert max(ids) == 18
    assert tokenizer.decode([5, 19, 6]) == tokenizer.decode([5, 6])  # a sampled reserved id


@pytest.mark.parametrize("tokens, multiple, padded", [(19, 4, 20), (19, 8, 24), (20, 4, 20),
                                                      (1, 1, 1), (151646, 128, 151680)])
def test_padded_vocab_size_rounds_up_to_the_multiple(tokens, multiple, padded):
    assert EmbeddedSpec(make_vocab_size_divisible_by=multiple).padded_vocab_size(tokens) == padded


def test_tp_launch_check_reads_the_padded_vocabulary(built, monkeypatch, tmp_path):
    from vime_shell.run.launch_checks import launch_checks
    from vime_shell.settings.train_config import ConfigError, TrainConfig

    monkeypatch.chdir(tmp_path)  # the default run dir, away from a demo run in the checkout
    monkeypatch.setenv("WORLD_SIZE", "2")
    plan = launch_checks(TrainConfig(tensor_model_parallel_size=2), built)
    assert (plan.layout.tp, plan.layout.dp) == (2, 1)
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size=3: does not divide the "
                                          r"model's 20 vocabulary rows.*"
                                          r"make-vocab-size-divisible-by"):
        launch_checks(TrainConfig(tensor_model_parallel_size=3), built)


@given(st.text(alphabet=sorted(set(BUNDLED_TEXT)), max_size=12))
def test_char_level_round_trip(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)
    assert tokenizer.decode(ids) == text


@pytest.mark.parametrize("kwargs, field", [
    (dict(hidden_size=0), "hidden_size"),
    (dict(hidden_size=64, num_attention_heads=3), "num_attention_heads"),
    (dict(num_attention_heads=2, num_key_value_heads=3), "num_key_value_heads"),
    (dict(seed=-1), "seed"),
    (dict(make_vocab_size_divisible_by=0), "make_vocab_size_divisible_by"),
])
def test_bad_spec_names_the_field(kwargs, field):
    with pytest.raises(EmbeddedError, match=field):
        EmbeddedSpec(**kwargs)
