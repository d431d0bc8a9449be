"""Redaction of personal data in captured text, before anything is written: built-in patterns for e-mail
addresses, phone numbers (international, North American, Chinese mobile), payment card numbers (checked with
Luhn), Chinese resident ID numbers (checked with their ISO 7064 digit) and US social security numbers, plus the
profile's own patterns (serve.capture.redact).

Why our own patterns and not Presidio: Presidio's recognizers need a spaCy model (none is reachable here) and
cover no Chinese ID or phone formats; these few regular expressions run on the gateway's request path in
microseconds. A value is replaced by its kind in brackets, "[EMAIL]", so a training record keeps its shape.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

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


@dataclass(frozen=True)
class Pattern:
    kind: str
    regex: re.Pattern[str]
    valid: Callable[[str], bool] = lambda _: True  # a check that keeps look-alikes (order numbers) as they are


# Order matters: a Chinese ID before the digit runs it contains; a Chinese mobile number with its +86 before a
# card number (13 digits that may pass Luhn); a card before the looser international phone patterns.
BUILT_IN = (
    Pattern("EMAIL", re.compile(r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+")),
    Pattern("CN_ID", re.compile(r"(?<!\d)\d{17}[\dXx](?![\dA-Za-z])"), chinese_id_ok),
    Pattern("PHONE", re.compile(r"(?<![\d+])(?:\+?86[ -]?)?1[3-9]\d(?:[ -]?\d{4}){2}(?!\d)")),  # China mobile
    Pattern("CARD", re.compile(r"(?<!\d)\d(?:[ -]?\d){12,18}(?!\d)"), luhn_ok),
    Pattern("SSN", re.compile(r"(?<!\d)\d{3}-\d{2}-\d{4}(?!\d)")),
    Pattern("PHONE", re.compile(r"(?<![\w+])\+?(?:\d[ .-]?)?\(?\d{3}\)?[ .-]?\d{3}[ .-]?\d{4}(?!\d)")),
    Pattern("PHONE", re.compile(r"(?<![\w+])\+\d{1,3}(?:[ .-]?\d{2,4}){2,5}(?!\d)")),
)


@dataclass
class Redactor:
    patterns: tuple[Pattern, ...] = BUILT_IN
    extra: list[re.Pattern[str]] = field(default_factory=list)

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

        for pattern in self.patterns:
            text = pattern.regex.sub(replace(pattern.kind, pattern.valid), text)
        for regex in self.extra:
            text = regex.sub(replace("REDACTED", lambda _: True), text)
        return text, count
