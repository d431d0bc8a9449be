"""Stop sequences as OpenAI applies them: the answer ends before the first one, which is left out.

Triton's generate API has no stop strings, so the gateway cuts the text itself; while streaming it holds
back what could be the start of a stop sequence until the next piece says whether it is one.
"""

from __future__ import annotations


def cut_at_stop(text: str, stop: list[str]) -> tuple[str, bool]:
    """The text up to the first stop sequence, and whether one was found (OpenAI leaves the stop out)."""
    positions = [i for i in (text.find(s) for s in stop) if i >= 0]
    return (text[: min(positions)], True) if positions else (text, False)


def held_back(text: str, stop: list[str]) -> int:
    """How many trailing characters of `text` could begin a stop sequence."""
    return max((k for s in stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


class StopScanner:
    """A streamed answer read piece by piece: what may be sent to the client so far, and whether it stopped."""

    def __init__(self, stop: list[str]):
        self.stop = stop
        self.text = ""  # the answer so far, cut at the stop sequence once one is found
        self.sent = 0  # how much of it the client has
        self.stopped = False

    def feed(self, piece: str) -> str:
        """The text that can be sent after `piece`: all of it but a possible stop sequence's beginning."""
        cut, self.stopped = cut_at_stop(self.text + piece, self.stop)
        self.text = cut
        safe = len(cut) if self.stopped else len(cut) - held_back(cut, self.stop)
        return self.take(safe)

    def flush(self) -> str:
        """What is left once the answer has ended: a held-back beginning that no stop sequence followed."""
        return self.take(len(self.text))

    def take(self, end: int) -> str:
        delta = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta
