"""Where `llmops serve` listens: its ports, chosen once, and who may call it; an open service off loopback, a Triton
clients could reach and TLS files that are not there are refused before anything starts."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from tasks.platform.config import ListenSection, Profile
from tasks.platform.errors import BadInput
from tasks.platform.ports import free_port, port_in_use
from tasks.platform.signed_tokens import TokenVerifier
from tasks.runtime.gateway import KeyRing

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass
class Ports:
    gateway: int
    http: int
    grpc: int
    metrics: int
    control: int
    gateway_metrics: int


def choose_ports(listen: ListenSection, own_tritons: bool = True) -> Ports:
    """The configured ports, 0 replaced by a free one, chosen once: restarts keep them. Without Tritons of its own
    (`--triton-discover`), Triton's ports are theirs, in use as they should be."""
    wanted = {
        "port": listen.port,
        "triton_http_port": listen.triton_http_port,
        "triton_grpc_port": listen.triton_grpc_port,
        "triton_metrics_port": listen.triton_metrics_port,
        "control_port": listen.control_port,
        "gateway_metrics_port": listen.gateway_metrics_port,
    }
    for name, port in wanted.items():
        if port and port_in_use(port) and (own_tritons or not name.startswith("triton_")):
            raise BadInput(
                f"serve.listen.{name} {port}: port in use; pick another (--{name.replace('_', '-')}, 0 = any free port)"
            )
    chosen = [port or free_port() for port in wanted.values()]
    return Ports(*chosen)


def client_credentials(profile: Profile) -> KeyRing:
    """Who may call the gateway: the environment's API keys (LLMOPS_API_KEYS_FILE is followed: a key removed there
    stops working, no restart) and, where the profile sets serve.auth.jwt, signed tokens of its issuer."""
    return KeyRing(os.environ, TokenVerifier(profile.serve.auth.jwt) if profile.serve.auth.jwt else None)


def check_listen(listen: ListenSection, api_keys: dict | bool) -> None:
    """Refuse an open service off loopback (no API keys, or keys in cleartext), a Triton whose ports clients
    could reach (it answers inference without keys), and TLS files that are not there."""
    if listen.host not in LOOPBACK:
        if not api_keys:
            raise BadInput(
                f"serve.listen.host {listen.host}: clients from other machines need API keys or tokens; "
                "set LLMOPS_API_KEYS_FILE (one key a line), LLMOPS_API_KEYS, or serve.auth.jwt in the profile"
            )
        if listen.tls_cert is None and not listen.behind_tls_proxy:
            raise BadInput(
                f"serve.listen.host {listen.host}: keys from other machines would cross in cleartext; give "
                "--tls-cert and --tls-key, or --behind-tls-proxy where a proxy in front terminates TLS"
            )
    if listen.control_host not in LOOPBACK and listen.tls_cert is None:
        raise BadInput(
            f"serve.listen.control_host {listen.control_host}: the control key would cross the network in cleartext; "
            "keep the control API on 127.0.0.1, or give --tls-cert and --tls-key"
        )
    if listen.triton_host not in LOOPBACK and not listen.triton_ports_firewalled:
        raise BadInput(
            f"serve.listen.triton_host {listen.triton_host}: Triton answers inference there without API keys; "
            "keep it on 127.0.0.1, or close its ports to clients (a NetworkPolicy, a firewall) and say so with "
            "--triton-ports-firewalled"
        )
    for name in ("tls_cert", "tls_key"):
        path = getattr(listen, name)
        if path is not None and not Path(path).is_file():
            raise BadInput(f"serve.listen.{name} {path}: no such file")
