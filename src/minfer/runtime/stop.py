"""Stop strings over streamed text: emit what is safe, hold back what might begin a stop string.

Generation stops at the first point of the text where any stop string is complete; the text returned
is everything before that occurrence, never the stop string itself. When two stop strings complete at
the same point (``"end"`` and ``"d"``), the longer one, which starts earlier, is cut.

Streaming (OpenAI-style ``stop``): :class:`StopMatcher` takes the decoded pieces as they come (from the
tokenizer's incremental UTF-8-safe decoder, so every piece is whole characters) and returns the text
that can be shown now. A tail that is a prefix of some stop string (``"<|e"`` of ``"<|end|>"``) is held
back until the next pieces either complete the stop (the held text is dropped) or rule it out (it is
released). :meth:`StopMatcher.flush` releases what is still held when generation ends for another
reason (end-of-generation token, ``max_tokens``). A stop string may span any number of pieces, and the
final text is the same however the text is cut into pieces: :func:`find_stop` on the whole text gives
the same cut.
"""

from __future__ import annotations

from collections.abc import Sequence

from minfer.errors import BadRequestError


def _check_stops(stops: str | Sequence[str]) -> tuple[str, ...]:
    # OpenAI's ``stop`` is a string or a list of strings; a lone string is one stop, not its characters
    if isinstance(stops, str):
        stops = (stops,)
    if not isinstance(stops, Sequence):
        raise BadRequestError(f"stop must be a string or a list of strings, got {type(stops).__name__}")
    for s in stops:
        if not isinstance(s, str):
            raise BadRequestError(f"stop strings must be strings, got {s!r}")
        if not s:
            raise BadRequestError("stop strings must not be empty (an empty stop would end every generation at once)")
    return tuple(dict.fromkeys(stops))  # duplicates dropped, order kept


def find_stop(text: str, stops: str | Sequence[str]) -> tuple[int, str] | None:
    """(index, stop string) of the stop occurrence that completes first in ``text``, or None."""
    best: tuple[int, int, str] | None = None  # (end, start, stop)
    for s in _check_stops(stops):
        start = text.find(s)
        if start >= 0:
            # earliest end first; at the same end the earlier start (the longer stop) wins
            key = (start + len(s), start, s)
            if best is None or key[:2] < best[:2]:
                best = key
    return None if best is None else (best[1], best[2])


class StopMatcher:
    """Feeds streamed text pieces through a set of stop strings (see the module docstring)."""

    def __init__(self, stops: str | Sequence[str]) -> None:
        self.stops = _check_stops(stops)
        self._longest = max((len(s) for s in self.stops), default=0)
        self._held = ""
        self.stopped = False
        self.stop: str | None = None  # the stop string that ended the text

    def push(self, piece: str) -> tuple[str, bool]:
        """Add ``piece``; return (text safe to emit now, whether a stop string has completed).

        After a stop every further piece is dropped and ``("", True)`` is returned.
        """
        if not isinstance(piece, str):
            raise BadRequestError(f"StopMatcher.push takes text (str), got {type(piece).__name__}")
        if self.stopped:
            return "", True
        buf = self._held + piece
        if not self.stops:
            self._held = ""
            return buf, False
        # The held text is the longest tail that could still begin a stop string, so every occurrence
        # that was not complete before starts inside it: searching held + piece finds the first one.
        hit = find_stop(buf, self.stops)
        if hit is not None:
            self.stopped, self.stop, self._held = True, hit[1], ""
            return buf[: hit[0]], True
        keep = self._partial_tail(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def _partial_tail(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of some stop string."""
        for n in range(min(len(text), self._longest - 1), 0, -1):
            tail = text[len(text) - n :]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0

    @property
    def held(self) -> str:
        """Text received but not yet emitted (it may begin a stop string)."""
        return self._held

    def flush(self) -> str:
        """End of the stream for another reason: release the held text (nothing after a stop)."""
        text, self._held = self._held, ""
        return "" if self.stopped else text
