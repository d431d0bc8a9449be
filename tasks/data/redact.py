"""Redaction of credentials and personal data in captured text, before anything is written.

- Credentials: the regular-expression rules of detect-secrets (Yelp's secret scanner, pinned in pyproject.toml;
  every `RegexBasedDetector` it ships: AWS, OpenAI, GitHub, GitLab, Slack, Stripe, Twilio, SendGrid, npm, PyPI,
  JWTs, private keys, basic-auth URLs, ...), so the rule set is maintained upstream, not here. Two of its matches
  are widened to what must go with them: a private key's `BEGIN ... PRIVATE KEY` line to its whole PEM block, and an
  AWS access key id to the 40-character secret access key pasted beside it (the shape detect-secrets' own AWS
  verification looks for, plugins/aws.py:get_secret_access_keys). Its entropy and keyword plugins are left out:
  they judge quoted strings and assignments in code, not prose.
- Personal data: e-mail addresses, phone numbers (international, North American, Chinese mobile), payment card
  numbers (checked with Luhn), IBANs (checked with ISO 13616's mod-97), Chinese resident ID numbers (checked with
  their ISO 7064 digit), US social security numbers and IP addresses (v4 and v6, checked by `ipaddress`), plus the
  profile's own patterns (serve.capture.redact).

Why not Presidio for the personal data: its recognizers need a spaCy model (none is reachable here) and cover no
Chinese ID or phone formats. A value is replaced by its kind in brackets, "[EMAIL]", "[SECRET]", so a training
record keeps its shape.
"""

from __future__ import annotations

import ipaddress
import re
import string
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cache

ID_WEIGHTS = (7, 9, 10, 5, 8, 4, 2, 1, 6, 3, 7, 9, 10, 5, 8, 4, 2)
ID_CHECK = "10X98765432"


def luhn_ok(text: str) -> bool:
    digits = [int(c) for c in text if c.isdigit()]
    total = 0
    for index, digit in enumerate(reversed(digits)):
        if index % 2:
            digit = digit * 2 - 9 if digit > 4 else digit * 2
        total += digit
    return 13 <= len(digits) <= 19 and total % 10 == 0


def chinese_id_ok(text: str) -> bool:
    """GB 11643-1999: 17 digits and a check character (ISO 7064 MOD 11-2)."""
    body, check = text[:17], text[17].upper()
    return body.isdigit() and ID_CHECK[sum(int(d) * w for d, w in zip(body, ID_WEIGHTS, strict=True)) % 11] == check


def iban_ok(text: str) -> bool:
    """ISO 13616: the country code and check digits moved to the end, letters as 10..35, the number mod 97 is 1."""
    compact = text.replace(" ", "").upper()
    if not 15 <= len(compact) <= 34:
        return False
    digits = "".join(str(int(c, 36)) for c in compact[4:] + compact[:4])
    return int(digits) % 97 == 1


def ip_ok(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Pattern:
    kind: str
    regex: re.Pattern[str]
    valid: Callable[[str], bool] = lambda _: True  # a check that keeps look-alikes (order numbers) as they are


# Order matters: an IBAN and an IP before the digit runs they contain; a Chinese ID before the digit runs it contains; a Chinese mobile number with its +86 before a
# card number (13 digits that may pass Luhn); a card before the looser international phone patterns.
BUILT_IN = (
    Pattern("EMAIL", re.compile(r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+")),
    Pattern(
        "IBAN",
        re.compile(r"(?<![A-Za-z0-9])[A-Z]{2}\d{2}(?: ?[A-Z0-9]{4}){2,7}(?: ?[A-Z0-9]{1,4})?(?![A-Za-z0-9])"),
        iban_ok,
    ),
    # an IPv6 address (colons and hex, "::" allowed) or a dotted quad; ipaddress decides
    Pattern("IP", re.compile(r"(?<![\w:.])(?:[0-9A-Fa-f]{0,4}:){2,7}[0-9A-Fa-f]{0,4}(?![\w:])"), ip_ok),
    Pattern("IP", re.compile(r"(?<![\w.])(?:\d{1,3}\.){3}\d{1,3}(?![\w.])"), ip_ok),
    Pattern("CN_ID", re.compile(r"(?<!\d)\d{17}[\dXx](?![\dA-Za-z])"), chinese_id_ok),
    Pattern("PHONE", re.compile(r"(?<![\d+])(?:\+?86[ -]?)?1[3-9]\d(?:[ -]?\d{4}){2}(?!\d)")),  # China mobile
    Pattern("CARD", re.compile(r"(?<!\d)\d(?:[ -]?\d){12,18}(?!\d)"), luhn_ok),
    Pattern("SSN", re.compile(r"(?<!\d)\d{3}-\d{2}-\d{4}(?!\d)")),
    Pattern("PHONE", re.compile(r"(?<![\w+])\+?(?:\d[ .-]?)?\(?\d{3}\)?[ .-]?\d{3}[ .-]?\d{4}(?!\d)")),
    Pattern("PHONE", re.compile(r"(?<![\w+])\+\d{1,3}(?:[ .-]?\d{2,4}){2,5}(?!\d)")),
)


PEM_BLOCK = re.compile(r"-----BEGIN[^\n-]*PRIVATE KEY[^\n-]*-----.*?(?:-----END[^\n-]*-----|\Z)", re.DOTALL)
AWS_SECRET = re.compile(r"(?<![%s])[%s]{40}(?![%s])" % ((re.escape(string.ascii_letters + string.digits + "+/="),) * 3))


@cache
def secret_detectors() -> tuple:
    """detect-secrets' regex rules, one instance each (IP addresses are ours: its rule skips private ranges)."""
    from detect_secrets.core.plugins.util import get_mapping_from_secret_type_to_class
    from detect_secrets.plugins.base import RegexBasedDetector
    from detect_secrets.plugins.ip_public import IPPublicDetector

    found: list[type] = list(get_mapping_from_secret_type_to_class().values())
    return tuple(
        plugin()
        for plugin in sorted(found, key=lambda p: p.__name__)
        if issubclass(plugin, RegexBasedDetector) and plugin is not IPPublicDetector
    )


TOKEN = frozenset(string.ascii_letters + string.digits + "-_.+/=")


def whole_tokens(text: str, value: str) -> set[str]:
    """`value` where it occurs in `text`, each occurrence widened to the token around it: detect-secrets' JWT rule
    ends lazily before the signature (`\\.?[A-Za-z0-9-_.+/=]*?`), which must go too."""
    found, start = set(), text.find(value)
    while start >= 0:
        left, right = start, start + len(value)
        while left > 0 and text[left - 1] in TOKEN:
            left -= 1
        while right < len(text) and text[right] in TOKEN:
            right += 1
        found.add(text[left:right])
        start = text.find(value, start + 1)
    return found


def find_credentials(text: str) -> set[str]:
    """Every credential in `text` as detect-secrets finds it, widened to the token it sits in, to the whole PEM
    block of a private key and to the secret access key beside an AWS access key id."""
    from detect_secrets.plugins.aws import AWSKeyDetector
    from detect_secrets.plugins.private_key import PrivateKeyDetector

    found: set[str] = set()
    for detector in secret_detectors():
        values = {v for v in detector.analyze_string(text) if v}
        if isinstance(detector, PrivateKeyDetector) and values:
            found |= {m.group(0) for m in PEM_BLOCK.finditer(text)}
        if isinstance(detector, AWSKeyDetector) and values:
            found |= set(AWS_SECRET.findall(text))
        found |= {token for value in values for token in whole_tokens(text, value)}
    return found


@dataclass
class Redactor:
    patterns: tuple[Pattern, ...] = BUILT_IN
    extra: list[re.Pattern[str]] = field(default_factory=list)
    credentials: bool = True

    @classmethod
    def with_patterns(cls, patterns: Iterable[str]) -> Redactor:
        """The built-in patterns and the profile's (validated at profile load: serve.capture.redact)."""
        return cls(extra=[re.compile(p) for p in patterns])

    def redact(self, text: str) -> tuple[str, int]:
        """`text` with every match replaced by its kind, and how many were replaced."""
        count = 0

        def replace(kind: str, valid: Callable[[str], bool]) -> Callable[[re.Match[str]], str]:
            def swap(match: re.Match[str]) -> str:
                nonlocal count
                if not valid(match.group(0)):
                    return match.group(0)
                count += 1
                return f"[{kind}]"

            return swap

        if self.credentials:
            for secret in sorted(find_credentials(text), key=len, reverse=True):  # a PEM block before a line in it
                count += text.count(secret)
                text = text.replace(secret, "[SECRET]")
        for pattern in self.patterns:
            text = pattern.regex.sub(replace(pattern.kind, pattern.valid), text)
        for regex in self.extra:
            text = regex.sub(replace("REDACTED", lambda _: True), text)
        return text, count
