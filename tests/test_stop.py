"""Stop strings over scripted streams of decoded pieces: hold back, release, cut, and agree with the whole text."""

from __future__ import annotations

import random

import pytest

from minfer.errors import BadRequestError
from minfer.runtime.stop import StopMatcher, find_stop


def stream(pieces, stops) -> tuple[list[str], bool, str]:
    """(what each push emitted, whether it stopped, the final text including the flush)."""
    m = StopMatcher(stops)
    out, stopped = [], False
    for piece in pieces:
        text, stopped = m.push(piece)
        out.append(text)
        if stopped:
            break
    tail = m.flush()
    return out, stopped, "".join(out) + tail


def whole(text, stops) -> str:
    hit = find_stop(text, stops)
    return text if hit is None else text[: hit[0]]


def test_stop_spanning_several_tokens_is_held_then_dropped():
    pieces = ["Hello", " wor", "ld<", "|e", "nd", "|>", " more"]
    out, stopped, final = stream(pieces, ["<|end|>"])
    assert out == ["Hello", " wor", "ld", "", "", ""]  # "<", "<|e", "<|end" held back, then dropped
    assert stopped and final == "Hello world"


def test_a_prefix_that_never_completes_is_released():
    m = StopMatcher(["<|end|>"])
    assert m.push("a<|e") == ("a", False) and m.held == "<|e"
    assert m.push("x") == ("<|ex", False) and m.held == ""
    assert m.push("<|en") == ("", False)
    assert m.flush() == "<|en"  # generation ended for another reason: the held text is the model's text
    assert m.flush() == ""


def test_stop_in_the_very_first_piece():
    assert stream(["STOP and more"], ["STOP"]) == ([""], True, "")
    m = StopMatcher("STOP")  # a lone string is one stop string, as in OpenAI's API
    assert m.push("STOP") == ("", True) and m.stop == "STOP"
    assert m.push("after") == ("", True) and m.flush() == ""  # nothing after a stop


def test_multibyte_characters():
    # the pieces are whole characters (the incremental decoder guarantees it); stops match on characters
    out, stopped, final = stream(["你好", "世", "界!", "…"], ["世界"])
    assert out == ["你好", "", ""] and stopped and final == "你好"
    out, stopped, final = stream(["I ", "❤️", " tea 🍵", " x"], ["🍵"])
    assert stopped and final == "I ❤️ tea "
    # a held multi-byte prefix released intact
    out, stopped, final = stream(["é", "tê", "te"], ["été"])
    assert out == ["", "étê", "te"] and not stopped and final == "étête"


def test_several_stops_with_overlapping_prefixes():
    stops = ["abc", "abd", "bd"]
    # "abd" and "bd" complete together: the longer one (earlier start) is cut
    assert stream(["x", "a", "b", "d", "y"], stops)[2] == "x"
    assert stream(["xab", "c"], stops)[2] == "x"
    assert stream(["xa", "bx"], stops) == (["x", "abx"], False, "xabx")
    # the stop that completes first wins, even if another one started earlier
    assert stream(["a", "b", "c"], ["abc", "b"])[2] == "a"
    assert whole("abc", ["abc", "b"]) == "a"
    # a stop inside a held prefix of a longer one
    assert stream(["<", "|", "e"], ["<|end|>", "|e"])[2] == "<"


def test_no_stops_passes_everything_through():
    assert stream(["a", "b"], []) == (["a", "b"], False, "ab")


def test_streaming_equals_whole_text_for_any_split():
    rng = random.Random(0)
    alphabet = "ab<|>é世 "
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 14)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, max(len(text) - 1, 0)))) if len(text) > 1 else []
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        expected = whole(text, stops)
        assert stream(pieces, stops)[2] == expected, (text, stops, pieces)
        assert stream([text], stops)[2] == expected
        # one character at a time too; the emitted text never contains a stop string
        out, _, final = stream(list(text), stops)
        assert final == expected and not any(s in final for s in stops)


def test_bad_stop_strings():
    with pytest.raises(BadRequestError, match="empty"):
        StopMatcher(["ok", ""])
    with pytest.raises(BadRequestError, match="empty"):
        StopMatcher("")
    with pytest.raises(BadRequestError, match="stop strings must be strings"):
        StopMatcher(["ok", 3])
    with pytest.raises(BadRequestError, match="str"):
        StopMatcher(["x"]).push(b"bytes")
