"""Rewards R = R_acc + 0.2 R_fmt (paper, appendix A).

R_acc: the last `\\boxed{...}` of the response is symbolically equivalent to the ground truth
(`math-verify`). R_fmt: the response has the expected shape: some step-by-step reasoning, then a
non-empty boxed answer at the end (see `format_ok`).

Model outputs are untrusted. Nothing is `eval`ed; extraction is a linear scan that gives up on
over-long or over-nested answers; plain numbers are compared exactly with `fractions.Fraction` in
process; everything else goes to math-verify in a separate worker process that is killed and
restarted when a check exceeds its time bound (sympy can spin for ever on `9^9^9^9`, and a signal
cannot interrupt C code), so a pathological response scores 0 within the bound.
"""

from __future__ import annotations

import multiprocessing as mp
import re
import signal
from dataclasses import dataclass
from fractions import Fraction

FORMAT_WEIGHT = 0.2
MAX_ANSWER_CHARS = 300  # a boxed answer longer than this scores 0 (no legitimate answer is)
MAX_NESTING = 24
MIN_REASONING_CHARS = 20  # R_fmt: text before the box
MAX_TRAILING_CHARS = 120  # R_fmt: text after the box


def _last_box(text: str) -> tuple[int, str, int] | None:
    """(start of the last `\\boxed`/`\\fbox`, its content, index just past it), or None if unusable.

    A linear scan that stops after MAX_ANSWER_CHARS or MAX_NESTING levels.
    """
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = start + (len("\\fbox") if text.startswith("\\fbox", start) else len("\\boxed"))
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text):
        return None
    if text[i] != "{":  # "\boxed 5"
        m = re.match(r"[^\s$]{1,%d}" % MAX_ANSWER_CHARS, text[i : i + MAX_ANSWER_CHARS + 1])
        return (start, m.group(0), i + m.end()) if m else None
    depth = 0
    for j in range(i, min(len(text), i + MAX_ANSWER_CHARS + 2)):
        c = text[j]
        if c == "{":
            depth += 1
            if depth > MAX_NESTING:
                return None
        elif c == "}":
            depth -= 1
            if depth == 0:
                inner = text[i + 1 : j].strip()
                return (start, inner, j + 1) if inner else None
    return None  # unbalanced, or longer than MAX_ANSWER_CHARS


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`, `\\boxed N`), None if absent or unusable."""
    box = _last_box(text)
    return box[1] if box else None


def format_ok(text: str) -> bool:
    """Expected format: >= MIN_REASONING_CHARS of reasoning, then a boxed answer near the end."""
    box = _last_box(text)
    if box is None:
        return False
    start, _, end = box
    tail = text[end:].strip().strip("$.\\]) \n")
    return len(text[:start].strip()) >= MIN_REASONING_CHARS and len(tail) <= MAX_TRAILING_CHARS


_NUM = re.compile(r"^-?(\d+(\.\d*)?|\.\d+)$")
_FRAC = re.compile(r"^(-?)\\[dt]?frac\{(-?\d+)\}\{(-?\d+)\}$")
_SLASH = re.compile(r"^(-?\d+)/(\d+)$")


def _normalise(s: str) -> str:
    s = s.strip().strip("$").strip()
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    for junk in ("\\!", "\\,", "\\;", "\\left", "\\right", "\\displaystyle"):
        s = s.replace(junk, "")
    s = s.replace(" ", "").rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    return s


def as_fraction(s: str) -> Fraction | None:
    """Exact value of a plain number (int, decimal, a/b, \\frac{a}{b}), else None."""
    s = _normalise(s)
    if _NUM.match(s):
        return Fraction(s)
    m = _FRAC.match(s) or None
    if m:
        den = int(m.group(3))
        return None if den == 0 else Fraction(int(m.group(2)), den) * (-1 if m.group(1) else 1)
    m = _SLASH.match(s)
    if m and int(m.group(2)) != 0:
        return Fraction(int(m.group(1)), int(m.group(2)))
    return None


def _verify_loop(conn) -> None:
    """Worker process: answer (gold, pred) pairs with math-verify."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    from math_verify import parse, verify

    while True:
        gold, pred = conn.recv()
        try:
            ok = bool(verify(parse("\\boxed{" + gold + "}"), parse("\\boxed{" + pred + "}")))
        except Exception:
            ok = False
        conn.send(ok)


class _Verifier:
    """A math-verify worker process with a hard time bound per check."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.proc = None
        self.conn = None
        self.timeouts = 0  # checks that ran past the bound (scored 0)

    def _start(self):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_verify_loop, args=(child,), daemon=True)
        self.proc.start()

    def check(self, gold: str, pred: str) -> bool:
        if self.proc is None or not self.proc.is_alive():
            self._start()
            timeout = self.timeout_s + 30.0  # first call also pays the worker's start-up
        else:
            timeout = self.timeout_s
        self.conn.send((gold, pred))
        if self.conn.poll(timeout):
            return self.conn.recv()
        self.close()  # stuck: kill it; the next check starts a fresh worker
        self.timeouts += 1
        return False

    def close(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.join()
            self.proc = None


@dataclass(frozen=True)
class Score:
    accuracy: float
    format: float

    @property
    def reward(self) -> float:
        return self.accuracy + FORMAT_WEIGHT * self.format


class Grader:
    """Scores responses against ground-truth answers; `close()` stops the worker."""

    def __init__(self, timeout_s: float = 3.0):
        self._verifier = _Verifier(timeout_s)

    def equivalent(self, pred: str, gold: str) -> bool:
        if len(pred) > MAX_ANSWER_CHARS:
            return False
        if _normalise(pred) == _normalise(gold):
            return True
        a, b = as_fraction(pred), as_fraction(gold)
        if a is not None and b is not None:
            return a == b
        return self._verifier.check(gold, pred)

    def score(self, response: str, answer: str) -> Score:
        if isinstance(response, bytes):
            response = response.decode("utf-8", errors="replace")
        pred = last_boxed(response)
        acc = pred is not None and self.equivalent(pred, answer)
        return Score(float(acc), float(format_ok(response)))

    @property
    def timeouts(self) -> int:
        """Checks so far that ran past the worker's time bound, each scored 0."""
        return self._verifier.timeouts

    def close(self):
        self._verifier.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
