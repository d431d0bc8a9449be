"""Profiles: validation errors name the key path; overrides go through the same validation."""

import pytest

from tasks.platform.config import available_profiles, load_profile
from tasks.platform.errors import BadInput


def test_every_shipped_profile_validates():
    assert "cpu-tiny" in available_profiles()
    for name in available_profiles():
        assert load_profile(name).name == name


def test_unknown_key_names_its_path():
    with pytest.raises(BadInput, match=r"^profile cpu-tiny: train\.lora_rnk: unknown key$"):
        load_profile("cpu-tiny", ["train.lora_rnk=3"])


def test_wrong_type_names_its_path():
    with pytest.raises(BadInput, match=r"train\.lora_rank: Input should be a valid integer"):
        load_profile("cpu-tiny", ["train.lora_rank=many"])


def test_unknown_key_in_a_profile_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\ndata: {source: x.jsonl}\nregistry: {model_name: m}\nevaluate: {max_new_tokns: 3}\n")
    with pytest.raises(BadInput, match=r"evaluate\.max_new_tokns: unknown key"):
        load_profile(str(bad))


def test_overrides_are_typed_like_yaml():
    profile = load_profile("cpu-tiny", ["train.learning_rate=1e-4", "train.quantization_bit=4", "train.bf16=false"])
    assert profile.train.learning_rate == pytest.approx(1e-4)
    assert profile.train.quantization_bit == 4
    assert profile.train.bf16 is False


def test_override_without_equals_is_rejected():
    with pytest.raises(BadInput, match="expected key=value"):
        load_profile("cpu-tiny", ["train.learning_rate"])


def test_unknown_profile_lists_available():
    with pytest.raises(BadInput, match="cpu-tiny"):
        load_profile("no-such-profile")


def test_relative_data_path_resolves_next_to_the_profile():
    profile = load_profile("cpu-tiny")
    assert profile.data.source.endswith("profiles/data/antonyms.jsonl")


def test_profile_digest_changes_with_any_value():
    a = load_profile("cpu-tiny")
    assert a.digest == load_profile("cpu-tiny").digest
    assert a.digest != load_profile("cpu-tiny", ["evaluate.max_new_tokens=4"]).digest
