"""The gateway's pure parts: API keys read from the environment or a file (bad lines named), and stop
sequences cut as OpenAI does. Requests against a real gateway are in tests/integration/test_serving.py."""

import pytest

from tasks.platform.errors import BadInput
from tasks.serving.gateway import read_api_keys
from tasks.serving.gateway.stops import cut_at_stop, held_back


def test_api_keys_come_from_a_file_with_names_or_from_the_environment(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# clients\nteam-a: aaaaaaaaaaaaaaaaaaaa\n\nbbbbbbbbbbbbbbbbbbbb  # unnamed\n")
    found = read_api_keys({"LLMOPS_API_KEYS_FILE": str(keys), "LLMOPS_API_KEYS": "cccccccccccccccccccc, "})
    assert found == {
        "aaaaaaaaaaaaaaaaaaaa": "team-a",
        "bbbbbbbbbbbbbbbbbbbb": "keys:4",
        "cccccccccccccccccccc": "client-1",
    }
    assert read_api_keys({}) == {}


def test_a_short_key_or_a_missing_file_is_refused_with_its_line(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("team-a: aaaaaaaaaaaaaaaaaaaa\nteam-b: short\n")
    with pytest.raises(BadInput, match=r"keys line 2: an API key must be at least 16 characters"):
        read_api_keys({"LLMOPS_API_KEYS_FILE": str(keys)})
    with pytest.raises(BadInput, match="LLMOPS_API_KEYS_FILE .*missing: cannot read"):
        read_api_keys({"LLMOPS_API_KEYS_FILE": str(tmp_path / "missing")})


def test_stop_sequences_cut_the_text_and_hold_back_a_partial_match():
    assert cut_at_stop("cold\nUser:", ["\nUser:"]) == ("cold", True)
    assert cut_at_stop("cold", ["ol", "d"]) == ("c", True)
    assert cut_at_stop("cold", []) == ("cold", False)
    assert held_back("cold\nUs", ["\nUser:"]) == 3  # "\nUs" may begin the stop sequence
    assert held_back("cold", ["\nUser:"]) == 0


def test_serve_refuses_a_public_address_without_api_keys(tmp_path, monkeypatch):
    """Before anything starts: clients from other machines would reach an endpoint open to anyone."""
    from flows.serve import serve
    from tasks.platform.config import load_profile

    monkeypatch.delenv("LLMOPS_API_KEYS", raising=False)
    monkeypatch.delenv("LLMOPS_API_KEYS_FILE", raising=False)
    with pytest.raises(BadInput, match=r"serve.listen.host 0.0.0.0: clients from other machines need API keys"):
        serve(load_profile("cpu-tiny", ["serve.listen.host=0.0.0.0"]), tmp_path, None, None)
    assert not (tmp_path / "triton").exists()  # nothing was started
