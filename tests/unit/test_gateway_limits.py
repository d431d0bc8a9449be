"""Who may call the gateway of `llmops serve` and how much: API keys as read from the environment and key
files, the limits per client (requests per second, tokens per minute) and overall (requests in flight), the
access log and the per-client metrics; and what `llmops serve` refuses before it starts (no keys or no TLS
off loopback, a Triton open to clients). The app runs as it is (TestClient); Triton is a MockTransport."""

from __future__ import annotations

import pytest

from tasks.platform.errors import BadInput
from tasks.serving.gateway import read_api_keys

# --- API keys -------------------------------------------------------------------------------------------


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


def test_serve_refuses_a_public_address_without_api_keys(tmp_path, monkeypatch):
    """Before anything starts: clients from other machines would reach an endpoint open to anyone."""
    from flows.serve import serve
    from tasks.platform.config import load_profile

    monkeypatch.delenv("LLMOPS_API_KEYS", raising=False)
    monkeypatch.delenv("LLMOPS_API_KEYS_FILE", raising=False)
    with pytest.raises(BadInput, match=r"serve.listen.host 0.0.0.0: clients from other machines need API keys"):
        serve(load_profile("cpu-tiny", ["serve.listen.host=0.0.0.0"]), tmp_path, None, None)
    assert not (tmp_path / "triton").exists()  # nothing was started


def test_a_hash_in_a_key_is_kept_and_a_name_ends_at_the_first_colon(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("team-a: aaaa#aaaa:aaaaaaaaaaaa # team a's\n#bbbbbbbbbbbbbbbbbbbb\n")
    assert read_api_keys({"LLMOPS_API_KEYS_FILE": str(keys)}) == {"aaaa#aaaa:aaaaaaaaaaaa": "team-a"}


def test_a_short_key_from_the_environment_is_refused_naming_its_entry():
    with pytest.raises(BadInput, match=r"LLMOPS_API_KEYS entry 2: an API key must be at least 16 characters"):
        read_api_keys({"LLMOPS_API_KEYS": "cccccccccccccccccccc,short"})


def test_a_key_written_twice_is_refused_naming_both_places(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("team-a: aaaaaaaaaaaaaaaaaaaa\nteam-b: aaaaaaaaaaaaaaaaaaaa\n")
    with pytest.raises(BadInput, match=r"keys line 2: the same API key as LLMOPS_API_KEYS_FILE .*keys line 1"):
        read_api_keys({"LLMOPS_API_KEYS_FILE": str(keys)})
    keys.write_text("team-a: cccccccccccccccccccc\n")
    with pytest.raises(BadInput, match=r"keys line 1: the same API key as LLMOPS_API_KEYS entry 1"):
        read_api_keys({"LLMOPS_API_KEYS_FILE": str(keys), "LLMOPS_API_KEYS": "cccccccccccccccccccc"})
