"""Unit tests of kvstore.safe_text: escaping and cutting peer text, and the warning throttle."""

from __future__ import annotations

import logging
import unicodedata
from pathlib import Path

import pytest

from kvstore.safe_text import (
    TEXT_LIMIT,
    WARNING_INTERVAL,
    WARNINGS_PER_PEER,
    WARNINGS_TOTAL,
    WarningThrottle,
    printable,
)


def _has_unsafe(text: str) -> bool:
    return any(
        unicodedata.category(c) in ("Cc", "Cf", "Cs", "Zl", "Zp") or c == "\x7f" for c in text
    )


def test_line_breaks_and_terminal_escapes_are_shown_as_escapes() -> None:
    forged = b"x\n2026-11-28 04:40:00,000 CRITICAL [server 0] FORGED\r\x1b[2J\x07\tend"
    assert printable(forged) == (
        "x\\n2026-11-28 04:40:00,000 CRITICAL [server 0] FORGED\\r\\x1b[2J\\x07\\tend"
    )


@pytest.mark.parametrize(
    ("char", "shown"),
    [
        ("\x00", "\\x00"),
        ("\x7f", "\\x7f"),
        ("\x85", "\\x85"),  # C1 next line
        ("\x9b", "\\x9b"),  # C1 control sequence introducer
        ("\u2028", "\\u2028"),
        ("\u2029", "\\u2029"),
        ("\u202e", "\\u202e"),  # right-to-left override
        ("\u2066", "\\u2066"),  # left-to-right isolate
        ("\u200b", "\\u200b"),
        ("\ufeff", "\\ufeff"),
        ("\U000e0041", "\\U000e0041"),  # tag character
        ("\ud800", "\\ud800"),  # lone surrogate
    ],
)
def test_every_unsafe_character_class_is_escaped(char: str, shown: str) -> None:
    assert printable(f"a{char}b") == f"a{shown}b"


def test_no_character_of_any_code_point_survives_unescaped() -> None:
    every = "".join(chr(c) for c in range(0x110000) if unicodedata.category(chr(c)) != "Cn")
    for start in range(0, len(every), 50):
        assert not _has_unsafe(printable(every[start : start + 50], limit=1000))


def test_bytes_that_are_not_utf8_are_shown_as_hex_and_utf8_is_kept() -> None:
    assert printable(b"w\xff\xfe-\xe2\x82\xac-\xc3") == "w\\xff\\xfe-\u20ac-\\xc3"
    assert printable(bytearray(b"\x1b")) == "\\x1b"
    assert printable(memoryview(b"ok")) == "ok"


def test_plain_text_and_other_objects_pass_unchanged() -> None:
    assert printable("worker-0 rank 3 \u00e9\u4e2d") == "worker-0 rank 3 \u00e9\u4e2d"
    assert printable(ValueError("bad\nvalue")) == "bad\\nvalue"
    assert printable(12) == "12"
    assert printable("a\\nb") == "a\\nb"  # a backslash is left as it is


def test_long_text_is_cut_with_a_marker_saying_how_much() -> None:
    assert printable("a" * 250) == "a" * 200 + "... (50 more characters)"
    assert printable(b"b" * 10_000, limit=8) == "bbbbbbbb... (9992 more bytes)"
    assert printable("x" * 5, limit=5) == "xxxxx"


def test_the_cut_never_splits_an_escape_and_counts_input_not_output() -> None:
    assert printable("\n" * 10, limit=5) == "\\n\\n... (8 more characters)"
    assert printable(b"\xff" * 10, limit=9) == "\\xff\\xff... (8 more bytes)"
    # multi-byte characters count as their bytes, and one split by the read-ahead is not kept
    assert printable("\u20ac".encode() * 100, limit=5) == "\u20ac" * 5 + "... (285 more bytes)"
    assert printable(b"a" + "\U0001f600".encode() * 3, limit=2) == "a\U0001f600... (8 more bytes)"


def test_work_is_bounded_by_the_limit_not_the_input() -> None:
    huge = b"\n" * 50_000_000
    assert printable(huge, limit=4) == "\\n\\n... (49999998 more bytes)"


def test_limit_must_be_positive() -> None:
    with pytest.raises(ValueError, match="limit"):
        printable("x", limit=0)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_one_peer_is_limited_per_interval_and_the_next_line_counts_the_rest() -> None:
    clock = FakeClock()
    throttle = WarningThrottle(per_peer=3, total=100, interval=10.0, clock=clock)
    verdicts = [throttle.allow(b"a") for _ in range(40)]
    assert [v.allowed for v in verdicts] == [True] * 3 + [False] * 37
    assert all(v.suppressed == 0 for v in verdicts)
    clock.now += 10.0
    resumed = throttle.allow(b"a")
    assert resumed.allowed and resumed.suppressed == 37 and resumed.others == 0
    assert resumed.note() == " (37 more from this peer suppressed in the last 10 s)"
    again = throttle.allow(b"a")
    assert again.allowed and again.suppressed == 0 and again.note() == ""


def test_peers_are_limited_independently() -> None:
    clock = FakeClock()
    throttle = WarningThrottle(per_peer=2, total=100, interval=10.0, clock=clock)
    assert [throttle.allow(b"a").allowed for _ in range(3)] == [True, True, False]
    assert [throttle.allow(b"b").allowed for _ in range(3)] == [True, True, False]


def test_the_total_bounds_many_identities_and_is_reported_as_others() -> None:
    clock = FakeClock()
    throttle = WarningThrottle(per_peer=5, total=10, interval=10.0, clock=clock)
    allowed = sum(throttle.allow(f"peer{i}".encode()).allowed for i in range(1000))
    assert allowed == 10
    clock.now += 10.0
    verdict = throttle.allow(b"fresh")
    assert verdict.allowed and verdict.suppressed == 0 and verdict.others == 990
    assert verdict.note() == " (990 from other peers suppressed)"


def test_lines_per_interval_never_exceed_the_total_whatever_the_pattern() -> None:
    clock = FakeClock()
    throttle = WarningThrottle(per_peer=4, total=20, interval=10.0, max_peers=8, clock=clock)
    logged_per_window: dict[int, int] = {}
    for i in range(20_000):
        clock.now = 1000.0 + i * 0.01  # 100 warnings a second over 200 s
        if throttle.allow(i % 37).allowed:
            window = int((clock.now - 1000.0) // 10.0)
            logged_per_window[window] = logged_per_window.get(window, 0) + 1
    assert max(logged_per_window.values()) <= 20
    assert len(throttle) <= 8


def test_remembered_peers_are_bounded_and_a_forgotten_peers_count_is_not_lost() -> None:
    clock = FakeClock()
    throttle = WarningThrottle(per_peer=1, total=1000, interval=10.0, max_peers=3, clock=clock)
    throttle.allow(b"flooder")
    for _ in range(7):
        throttle.allow(b"flooder")  # 7 suppressed, remembered on the flooder's entry
    verdicts = [throttle.allow(f"new{i}".encode()) for i in range(3)]
    assert len(throttle) == 3
    # the third evicts the flooder, and its line reports the flooder's count
    assert [(v.allowed, v.others) for v in verdicts] == [(True, 0), (True, 0), (True, 7)]
    assert throttle.allow(b"flooder").suppressed == 0  # a fresh entry


def test_warn_logs_with_the_note_and_returns_whether_it_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    throttle = WarningThrottle(per_peer=1, total=10, interval=10.0, clock=clock)
    log = logging.getLogger("kvstore.test_safe_text")
    with caplog.at_level(logging.WARNING, logger=log.name):
        assert throttle.warn(log, b"p", "bad message from %s: %s", "p", "why")
        assert not throttle.warn(log, b"p", "bad message from %s: %s", "p", "why")
        assert not throttle.warn(log, b"p", "bad message from %s: %s", "p", "why")
        clock.now += 12.0
        assert throttle.warn(log, b"p", "bad message from %s: %s", "p", "again")
    assert [r.getMessage() for r in caplog.records] == [
        "bad message from p: why",
        "bad message from p: again (2 more from this peer suppressed in the last 12 s)",
    ]
    assert all(r.levelno == logging.WARNING for r in caplog.records)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="per_peer"):
        WarningThrottle(per_peer=0)
    with pytest.raises(ValueError, match="interval"):
        WarningThrottle(interval=0)


def test_the_operations_guide_states_the_settings() -> None:
    guide = " ".join((Path(__file__).parents[2] / "docs" / "operations.md").read_text().split())
    assert f"at most {TEXT_LIMIT} characters are kept" in guide
    assert (
        f"at most {WARNINGS_PER_PEER} per peer (its routing id) and {WARNINGS_TOTAL} for all "
        f"peers together in each {WARNING_INTERVAL:g} s"
    ) in guide
