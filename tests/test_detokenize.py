"""Streaming detokenization with the tiny byte-level BPE tokenizer: no broken characters, no partial stop strings."""
from __future__ import annotations

import pytest

from specdec.orchestrator.detokenize import Detokenizer

from tiny_models import build_tokenizer

REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def encode(tok, text: str) -> list[int]:
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text, "the tiny tokenizer must round-trip the test texts"
    return ids


def stream(tok, ids: list[int], stop=(), step: int = 1) -> tuple[list[str], str, Detokenizer]:
    """Feed ``ids`` ``step`` at a time until a stop string; (pieces from add, the finish() text, detok)."""
    detok = Detokenizer(tok, stop)
    pieces = []
    for i in range(0, len(ids), step):
        pieces.append(detok.add(ids[i : i + step]))
        if detok.stopped:
            break
    return pieces, detok.finish(), detok


TEXTS = [
    "def foo(bar):\n    return bar + 1\n",
    "café déjà vu",
    "a → b ⇒ c",
    "rocket 🚀! and 👍🏽 too",
    "mixed: naïve 日本語 text\n",
]


@pytest.mark.parametrize("step", [1, 2, 3])
@pytest.mark.parametrize("text", TEXTS)
def test_pieces_concatenate_to_the_full_decode(tok, text, step):
    ids = encode(tok, text)
    pieces, tail, detok = stream(tok, ids, step=step)
    assert "".join(pieces) + tail == text
    assert not detok.stopped


@pytest.mark.parametrize("text", [t for t in TEXTS if not t.isascii()])
def test_split_multibyte_character_is_never_emitted_as_replacement(tok, text):
    ids = encode(tok, text)
    # The test is only worth something if some character really is split across tokens.
    assert any(REPLACEMENT in tok.decode([i]) for i in ids), "no character split across tokens"
    pieces, tail, _ = stream(tok, ids)
    for piece in [*pieces, tail]:
        assert REPLACEMENT not in piece, pieces
    # Each piece ends on a whole character: every prefix of the stream is a prefix of the text.
    shown = ""
    for piece in pieces:
        shown += piece
        assert text.startswith(shown)


def test_incomplete_character_at_the_end_is_flushed_by_finish(tok):
    """Generation may end mid-character; finish() then returns what the full decode shows."""
    ids = encode(tok, "ok 🚀")[:-2]  # drop the emoji's last byte tokens
    pieces, tail, _ = stream(tok, ids)
    assert "".join(pieces) == "ok "
    assert tail == tok.decode(ids)[len("ok "):] and tail.startswith(REPLACEMENT)


def check_stop(tok, text: str, stop: list[str], step: int = 1) -> str:
    """Stream ``text`` with stop strings; the output is the text cut right before the earliest stop, and no
    moment of the stream shows anything past that cut (so no part of a stop string is ever emitted)."""
    cut = min(text.find(s) for s in stop if s in text)
    expected = text[:cut]
    ids = encode(tok, text)
    detok = Detokenizer(tok, stop)
    shown = ""
    for i in range(0, len(ids), step):
        shown += detok.add(ids[i : i + step])
        assert expected.startswith(shown), f"emitted {shown!r}, beyond {expected!r}"
        if detok.stopped:
            break
    assert detok.stopped
    assert detok.finish() == ""
    assert shown == expected
    return shown


@pytest.mark.parametrize("step", [1, 4])
@pytest.mark.parametrize("text, stop", [
    ("def foo(bar):\n    return bar\n\ndef baz():", ["\n\ndef"]),
    ("x = 1  # STOP here", ["STOP"]),
    ("print('hello')", ["print"]),  # stop at the very start: nothing at all is emitted
    ("value = 42;", [";"]),  # one-character stop string at the very end
    ("café au lait", ["é a"]),  # the stop string starts inside a split multi-byte character
    ("a → b", ["→"]),
])
def test_stop_string_is_cut_exactly_and_never_partly_emitted(tok, text, stop, step):
    check_stop(tok, text, stop, step)


def test_stop_string_spanning_two_tokens(tok):
    text = "def foo(bar):\n    return bar + 1\n"
    ids = encode(tok, text)
    # A stop string made of the end of one token and the start of the next.
    for i in range(len(ids) - 1):
        left, right = tok.decode([ids[i]]), tok.decode([ids[i + 1]])
        if len(left) >= 2 and len(right) >= 2:
            break
    stop = left[-2:] + right[:2]
    at = len(tok.decode(ids[: i + 1])) - 2
    assert text.find(stop) == at, "pick a stop string that first occurs at the token boundary"

    detok = Detokenizer(tok, [stop])
    shown = "".join(detok.add([t]) for t in ids[: i + 1])
    assert not detok.stopped
    assert shown == text[:at]  # the first half of the stop string is held back, the rest is out
    shown += detok.add([ids[i + 1]])
    assert detok.stopped
    assert shown == text[:at]
    assert detok.finish() == ""


def test_earliest_of_several_stop_strings_wins(tok):
    """Two stop strings completed by the same tokens: the cut is at the one that starts first, whatever
    their order in the request."""
    text = "return bar + 1\n"
    for stop in (["+ 1", "bar"], ["bar", "+ 1"]):
        assert check_stop(tok, text, stop, step=len(encode(tok, text))) == "return "


def test_stop_string_that_never_completes_is_flushed_by_finish(tok):
    """A possible stop-string start is held back while it may grow into the stop string; when generation
    ends without one, finish() returns it."""
    text = "x = 1  # STO"
    ids = encode(tok, text)
    detok = Detokenizer(tok, ["STOP"])
    shown = "".join(detok.add([t]) for t in ids)
    assert not detok.stopped
    assert shown == "x = 1  # "  # "STO" could still become "STOP"
    assert detok.finish() == "STO"


def test_held_back_prefix_released_when_text_diverges(tok):
    text = "x = 1  # STOne"
    ids = encode(tok, text)
    detok = Detokenizer(tok, ["STOP"])
    shown = "".join(detok.add([t]) for t in ids)
    assert not detok.stopped
    assert shown == text  # "STOn" can no longer be "STOP": nothing is held back
    assert detok.finish() == ""


def test_no_stop_strings_finish_flushes_nothing_more_than_the_rest(tok):
    ids = encode(tok, TEXTS[0])
    detok = Detokenizer(tok)
    shown = "".join(detok.add([t]) for t in ids)
    assert shown + detok.finish() == TEXTS[0]
    assert detok.finish() == ""  # a second call adds nothing


def test_bytes_that_never_complete_a_character_are_not_held_back_forever(tok):
    """A model emitting lone continuation bytes (junk UTF-8) must not make every step decode a growing
    tail: after MAX_HELD_BACK_TOKENS the replacement character is shown and decoding moves on."""
    from specdec.orchestrator.detokenize import MAX_HELD_BACK_TOKENS

    lone = encode(tok, "é")[-1:]  # é is two bytes; its last token alone is a continuation byte
    assert tok.decode(lone) == REPLACEMENT
    detok = Detokenizer(tok)
    shown = ""
    for i in range(3 * MAX_HELD_BACK_TOKENS):
        shown += detok.add(lone)
        assert len(detok._ids) - detok._read < MAX_HELD_BACK_TOKENS  # what the next step decodes stays bounded
    assert REPLACEMENT in shown and detok.finish() is not None
