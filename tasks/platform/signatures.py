"""Signed statements with SSH keys (OpenSSH's `ssh-keygen -Y sign` / `-Y verify`, OpenSSH 8.0 and later): an
approval is a statement a person signs with their own key, verified against an allowed-signers file the operator
writes (ssh-keygen(1), ALLOWED SIGNERS: `principal [namespaces="llmops-approval"] key-type base64-key`).

Why ssh-keygen: every approver already has an SSH key (or an agent holding one: `-f key.pub` signs through the
agent), the format is OpenSSH's documented SSHSIG, and no library of ours holds keys or parses signatures.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

from tasks.platform.errors import BadInput

NAMESPACE = "llmops-approval"  # the signature's purpose: a key's signature for anything else never verifies here


class SignatureRefused(Exception):
    """A statement whose signature does not verify against the allowed signers."""


def statement_text(statement: dict[str, str]) -> str:
    """The bytes signed: the statement as canonical JSON (sorted keys, no spaces)."""
    return json.dumps(statement, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def sign(statement: dict[str, str], key: Path) -> str:
    """The armored SSHSIG signature of the statement by `key` (a private key file, or a public key whose private
    half an ssh-agent holds)."""
    if not key.is_file():
        raise BadInput(f"--key {key}: no such key file")
    done = subprocess.run(
        ["ssh-keygen", "-q", "-Y", "sign", "-f", str(key), "-n", NAMESPACE],
        input=statement_text(statement),
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0 or "BEGIN SSH SIGNATURE" not in done.stdout:
        raise BadInput(f"--key {key}: ssh-keygen could not sign: {done.stderr.strip()[-300:]}")
    return done.stdout


def verify(statement: dict[str, str], signature: str, principal: str, allowed_signers: Path) -> str:
    """The signing key's fingerprint when `principal` signed `statement` with a key the allowed-signers file lists
    for it (and for this namespace); SignatureRefused otherwise."""
    if not allowed_signers.is_file():
        raise SignatureRefused(f"allowed-signers file {allowed_signers}: not found")
    with tempfile.TemporaryDirectory(prefix="llmops-signature-") as folder:
        signature_file = Path(folder) / "statement.sig"
        signature_file.write_text(signature)
        done = subprocess.run(
            ["ssh-keygen", "-Y", "verify", "-f", str(allowed_signers), "-I", principal, "-n", NAMESPACE]
            + ["-s", str(signature_file)],
            input=statement_text(statement),
            capture_output=True,
            text=True,
            timeout=60,
        )
    said = (done.stdout + done.stderr).strip()
    if done.returncode != 0 or not said.startswith("Good"):
        raise SignatureRefused(f"the signature of {principal} does not verify against {allowed_signers}: {said[-300:]}")
    return said.rsplit(" ", 1)[-1]  # "Good "ns" signature for P with ED25519 key SHA256:..."
