"""Scoring: what an agent's reply commits to as its answer, that answer against the gold
(as a number, by math-verify, else normalised exact match), and which episodes score at all.

The episode loop scores in worker processes that a hung sympy call cannot stall (score_answer_isolated): a worker
is this file run as a script, started by the pool, never by hand:

    python scoring.py PARENT_PID    # one JSON line [prediction, gold] in on stdin, one line [score, method] out

Imports nothing of the project and neither torch nor vLLM (so a worker starts in seconds); math_verify and sympy are
imported on first use, inside the functions that compare.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from fractions import Fraction
from pathlib import Path


# ---- Reading the committed answer: think blocks, the answer line and its boxes

def strip_think(text):
    """Drop <think>...</think> blocks; a dangling </think> (opening tag in the prompt) drops everything before it,
    an unclosed <think> (reply cut off while thinking) drops everything after it."""
    text = re.sub(r"<think>.*?</think>", "", text, flags=re.DOTALL)
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    if "<think>" in text:
        text = text.split("<think>", 1)[0]
    return text


# only at the start of a line, after optional markdown (quote, list bullet or number, heading, emphasis): prose such
# as "I computed the answer: 16 earlier" in the middle of a line commits to nothing
_ANSWER_MARKER = re.compile(
    r"^[ \t]*(?:(?:[>#*_+-]|\d+[.)])[ \t]*)*(?:final[ \t]+answer|answer)[ \t]*(?:\*\*|__)?[ \t]*[:：]",
    re.IGNORECASE | re.MULTILINE)
_BOXED = re.compile(r"\\boxed\s*\{")


def _boxes(text):
    """(start, end, content, closed) of every \\boxed{ that is not inside an earlier closed box, in order. A box whose
    braces never close (a reply cut off inside it) holds the rest of its line."""
    boxes, inside_until = [], 0
    for match in _BOXED.finditer(text):
        if match.start() < inside_until:
            continue
        depth, i = 1, match.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            boxes.append((match.start(), i, text[match.end():i - 1], True))
            inside_until = i
        else:
            line_end = text.find("\n", match.end())
            line_end = len(text) if line_end == -1 else line_end
            boxes.append((match.start(), line_end, text[match.end():line_end], False))
    return boxes


# A note after the committed value: trailing natural-language prose after a space or punctuation, as a careful grader
# reads "Final answer: 42 - verified with bash": "42 (checked with the tool)", "42 [computed]", "42 — verified",
# "42, as the script printed", "42: confirmed", "42; the tool agrees", "42. Verified.", "42 since ...", "42 which ...".
# It is dropped only when it names no other candidate answer (no digit, no math, no number or math word, no word
# that offers or conditions an alternative: "42, maybe 43", "42 (or 43)", "42, unless ..." stay whole and score as
# hedges) and what it leaves is one value (see _is_one_value).
_NOTE_START = re.compile(
    r"\s+(?=[(\[])|\s*(?=[\uff08\u3010])"                # 42 (checked)   42 [computed by the tool]   42（已验证）
    r"|\s*(?=[\u2013\u2014])"                            # 42 — verified   42—verified
    r"|\s+(?=--?\s)"                                     # 42 - verified   42 -- verified
    r"|\s*(?=[,;:.]\s|[\uff0c\uff1b\uff1a\u3002])"       # 42, as printed   42: checked   42. Verified.   42，as
    r"|\s+(?=[^\W\d_])")                                 # 42 since ...   42 verified with bash
_MARKED_NOTE = re.compile(r"\s*[(\[\uff08\u3010\u2013\u2014]")  # brackets and en/em dashes only ever open a note
_NOTE_INTRODUCER = re.compile(r"^[\s,;:.\uff0c\uff1b\uff1a\u3002\u2013\u2014-]+")
# math words: in a note they name a value; in a head they belong to it; after a number they are no unit
_NEVER_A_UNIT = (r"pi|theta|alpha|beta|gamma|delta|epsilon|phi|omega|lambda|sigma|tau|sin|cos|tan|cot|csc|arcsin|"
                 r"arccos|arctan|sinh|cosh|tanh|log|ln|exp|sqrt|factorial|infinity")
_MATH_WORDS = (rf"{_NEVER_A_UNIT}|mu|lg|squared|cubed|times|plus|minus|divided|mod|modulo|pmod|choose|binom|max|"
               r"gcd|lcm|det|infinite|undefined")
_NUMBER_WORDS = (r"zero|one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|\w+teen|twenty|thirty|forty|"
                 r"fifty|sixty|seventy|eighty|ninety|hundred|thousand|million|billion|dozen|half|halves|thirds?|"
                 r"quarters?|fourths?|fifths?|sixths?|sevenths?|eighths?|ninths?|tenths?|\w+tieths?|hundredths?")
_ALTERNATIVE_WORDS = r"or|nor|either|else|otherwise|alternatively|unless|versus|vs"
_MATH_SYMBOL = r"\d\\$^_=+*/<>{}|%\u221a\u03c0\u221e\u00d7\u00f7\u00b1\u2264\u2265\u2260\u2212\u0370-\u03ff"
_CANDIDATE_ANSWER = re.compile(rf"[{_MATH_SYMBOL}]|\b(?:{_MATH_WORDS}|{_NUMBER_WORDS}|{_ALTERNATIVE_WORDS})\b",
                               re.IGNORECASE)
_PRONOUN_ONE = re.compile(r"\b(?:the|this|that|each|every|any|which|only|same|right|correct)\s+one\b", re.IGNORECASE)
_WORD = re.compile(r"[^\W\d_]{2,}")
# two words, a long one, or two letters of a script without variables (已验证)
_LONG_PROSE = re.compile(r"[^\W\d_]{4,}|[^\W\d_]{2,}[\W_]+(?:[^\W\d_][\W_]+)*[^\W\d_]{2,}|[^\W\d_A-Za-z]{2,}")
# after a value that is text (Yes, \text{red}), only a note that opens like one: "red, green" is a list of two values
_CONNECTIVE = re.compile(
    r"(?:since|because|as|which|that|so|thus|hence|therefore|verified|checked|confirmed|computed|calculated|"
    r"obtained|found|given|per|by|from|according|using|via|with|where|see)\b", re.IGNORECASE)
_MATH_CHAR = re.compile(rf"[{_MATH_SYMBOL}()\[\]]|(?<![^\W\d_])-")  # a hyphen inside a word is prose
_HEAD_WORDS_ALLOWED = re.compile(rf"(?:{_MATH_WORDS}|and)", re.IGNORECASE)  # "2 and 3" is a set, "2 pi" a value


def _is_one_value(head):
    """Whether what comes before a note can be the committed value: its brackets balance ("42 (checked with 3" does
    not) and, in its last sentence, no prose follows its first math ("so it is 42" can be, "42 checked with 3"
    cannot; \\text{} and LaTeX commands aside)."""
    if head.count("{") != head.count("}") or sum(map(head.count, "([")) != sum(map(head.count, ")]")):
        return False
    last = re.split(r"(?<=[.!?;])\s+", head)[-1]
    last = re.sub(r"\\(?:begin|end)\s*\{[^{}]*\}|\\[A-Za-z]+", " ", _TEXT_COMMAND.sub(" ", last))
    first_math = _MATH_CHAR.search(last)
    return not first_math or all(_HEAD_WORDS_ALLOWED.fullmatch(word)
                                 for word in re.findall(r"[^\W\d_]{3,}", last[first_math.start():]))


def _is_note(note, marked, text_head):
    """Whether the text after a possible note start is prose: any word in brackets or after an en/em dash; otherwise
    two words or a long one ("x^2 - xy" and "3 abc" are math), and after a text value, one that opens like a note."""
    if marked:
        return bool(_WORD.search(note))
    if text_head and not _CONNECTIVE.match(note):
        return False
    return bool(_LONG_PROSE.search(note))


def _drop_trailing_note(text):
    """The text without its trailing prose note (the longest one that qualifies), or unchanged. A note starts after
    the last character or word that could belong to a value."""
    if len(text) > 1000:  # a value with a note is short; the search below is quadratic in the worst case
        return text
    masked = _PRONOUN_ONE.sub(lambda m: m[0][:-3] + "   ", text)  # "the same one": a pronoun, not a value
    notes_from = max((m.end() for m in _CANDIDATE_ANSWER.finditer(masked)), default=0)
    # the head is math when math precedes that point (\text{}, $ and emphasis aside) or a bracket or a minus
    # sign follows it before the note starts
    math_before = _MATH_CHAR.search(re.sub(r"[$*`]", "", _TEXT_COMMAND.sub(r"\1", text[:notes_from])))
    math_after = _MATH_CHAR.search(text, notes_from)
    for start in _NOTE_START.finditer(text, notes_from):
        head, tail = text[:start.start()].strip(), text[start.start():]
        text_head = not math_before and not (math_after and math_after.start() < start.start())
        if head and _is_note(_NOTE_INTRODUCER.sub("", tail), bool(_MARKED_NOTE.match(tail)), text_head):
            if _is_one_value(head):
                return head
            if not text_head:
                break  # a later start leaves more prose after the value in the head: no shorter note qualifies
    return text


def _clean_answer_text(text):
    previous = None
    while text != previous:
        previous = text
        text = _drop_trailing_note(text.strip().strip("*").strip().rstrip(".").strip())
        if len(text) >= 2 and text[0] == text[-1] == "$":
            text = text.strip("$").strip()
    return text


def _answer_key(value):
    """What makes two committed values the same answer: the number they read as, else their normalised text."""
    number = read_number(value)
    return normalize_answer(value) if number is None else number


def _one_answer(values):
    """The answer a line commits to. Several boxes that hold one value (\\boxed{5} since 2+3 = \\boxed{5}) commit
    to it; boxes with different values (\\boxed{a} or \\boxed{b}) are a hedge, returned as the list "a, b", which
    scores like the same hedge inside one box. None when every value is empty."""
    distinct = {}
    for value in values:
        if value:
            distinct.setdefault(_answer_key(value), value)
    return ", ".join(distinct.values()) or None


# Words that offer or condition an alternative: beside a box they make a value written outside it a second one
_HEDGING = re.compile(rf"\b(?:{_ALTERNATIVE_WORDS}|maybe|perhaps|possibly|possible|could|might)\b", re.IGNORECASE)
_VALUE_OUTSIDE = re.compile(rf"[{_MATH_SYMBOL}]|\b(?:{_MATH_WORDS}|{_NUMBER_WORDS})\b", re.IGNORECASE)


def _opened(text, start, end, boxes):
    """text[start:end] with each of these boxes (all inside it) replaced by its content."""
    parts, at = [], start
    for box_start, box_end, content, _ in boxes:
        parts += [text[at:box_start], content]
        at = box_end
    return "".join(parts + [text[at:end]])


def _offers_another_value(text, start, end, boxes):
    """Whether the committing line text[start:end] offers a value outside its boxes as an alternative to them: a
    hedging word and a value ("\\boxed{42} or 43", "\\boxed{42}, maybe 43", "42 or \\boxed{43}"); a derivation
    ("\\boxed{5} since 2+3 = \\boxed{5}") or a note offers none."""
    outside = _opened(text, start, end, [(b_start, b_end, " ", closed) for b_start, b_end, _, closed in boxes])
    outside = re.sub(r"\\[,;:! ]|\\q?quad\b|[$*_`]", " ", _TEXT_COMMAND.sub(r" \1 ", outside))
    return bool(_HEDGING.search(outside) and _VALUE_OUTSIDE.search(outside))


def extract_final_answer(text):
    """The answer the reply commits to, or None. Last line that starts with `Final answer:`/`Answer:` (after optional
    markdown such as `**`, `>`, `-`; ASCII or full-width colon): the content of the boxes that open on that line
    (one cut off before its closing brace holds the rest of the line), else the rest of the line without a trailing
    prose note. Without such a line (or with an empty one), the balanced boxes on the line of the last one
    anywhere. Several different values on the committing line are a hedge (see _one_answer), and so is a value
    offered beside its boxes ("\\boxed{42} or 43": the line is returned with the boxes opened, to score as one)."""
    text = strip_think(text)
    boxes = _boxes(text)
    markers = list(_ANSWER_MARKER.finditer(text))
    if markers:
        start = markers[-1].end()
        line_end = text.find("\n", start)
        line_end = len(text) if line_end == -1 else line_end
        on_line = [box for box in boxes if start <= box[0] < line_end]
        if on_line and _offers_another_value(text, start, line_end, on_line):
            return _clean_answer_text(_opened(text, start, line_end, on_line))
        values = [content.strip() if closed else _clean_answer_text(content) for _, _, content, closed in on_line]
        answer = _one_answer(values) if on_line else _clean_answer_text(text[start:line_end])
        if answer:
            return answer
    closed = [box for box in boxes if box[3]]
    if closed:
        line_start = text.rfind("\n", 0, closed[-1][0]) + 1
        line_end = text.find("\n", closed[-1][1])
        line_end = len(text) if line_end == -1 else line_end
        on_line = [box for box in closed if box[0] >= line_start]
        if _offers_another_value(text, on_line[0][0], line_end, on_line):  # the work before the box is no offer
            return _clean_answer_text(_opened(text, on_line[0][0], line_end, on_line))
        return _one_answer([content.strip() for _, _, content, _ in on_line])
    return None


# ---- Scoring an answer: pure functions

_IN_SCORER_WORKER = False  # True in a scorer worker process (_scorer_worker_main)


def _math_verify_timeout():
    # math_verify's timeouts use signal.alarm, which only works in the main thread; elsewhere run without them. A
    # scorer worker runs without them too: there the pool's hard kill (SCORE_TIMEOUT_S) is the one limit.
    in_main_thread = threading.current_thread() is threading.main_thread()
    return 5 if in_main_thread and not _IN_SCORER_WORKER else None


def _math_verify(prediction, gold):
    """True/False when math_verify decides, None when it cannot (error or nothing parsed)."""
    from math_verify import LatexExtractionConfig, parse as mv_parse, verify as mv_verify  # here: seconds to import
    from math_verify.errors import TimeoutException as MathVerifyTimeout

    timeout = _math_verify_timeout()
    try:
        # $...$ makes bare LaTeX such as \frac{1}{2} or \sqrt{2} parse
        gold_parsed = mv_parse(f"${gold.strip('$')}$", parsing_timeout=timeout, raise_on_error=True)
        # the prediction as LaTeX only: where that fails, math_verify's other reading picks one number out of the
        # text ("42 (i.e. 43)" -> 43, 42\text{, }43 -> 42), and an answer holding several values is none of them;
        # its own $ signs go, as math_verify reads one math span ("$42$, maybe 43" would read as 42)
        latex = re.sub(r"(?<!\\)\$", "", prediction)
        pred_parsed = mv_parse(f"${latex}$", extraction_config=[LatexExtractionConfig()],
                               parsing_timeout=timeout, raise_on_error=True)
        if not gold_parsed or all(isinstance(p, str) for p in pred_parsed):
            return None
        pred_parsed = [_exact_decimals(p) for p in pred_parsed]
        return bool(mv_verify(gold_parsed, pred_parsed, timeout_seconds=timeout, raise_on_error=True))
    except (Exception, MathVerifyTimeout):  # sympy errors, recursion, its timeout (a BaseException): "cannot decide"
        return None


def _exact_decimals(expr):
    """A parsed prediction with each decimal in it as the exact rational it names (0.333333 -> 333333/1000000).
    math_verify rounds floats to 6 places before comparing, which makes a truncated 1/3 equal 1/3; the gold's own
    decimals keep that rounding (a gold may itself be rounded)."""
    from sympy import Float, Rational

    floats = expr.atoms(Float) if hasattr(expr, "atoms") else set()
    return expr.xreplace({f: Rational(str(f)) for f in floats}) if floats else expr


def _unbox(text):
    match = re.fullmatch(r"\\boxed\s*\{(.*)\}", text, flags=re.DOTALL)
    return match.group(1) if match else text


def _strip_outer_braces(text):
    while len(text) >= 2 and text[0] == "{" and text[-1] == "}":
        depth = 0
        for i, ch in enumerate(text):
            depth += {"{": 1, "}": -1}.get(ch, 0)
            if depth == 0 and i < len(text) - 1:
                return text  # the first brace closes early: "{a}{b}" is not wrapped
        text = text[1:-1]
    return text


def normalize_answer(text):
    """Exact-match form: no box, no $, no outer braces, no commas or spaces (or LaTeX spacing), no trailing
    period, lowercase."""
    text = text.replace("$", "")
    text = re.sub(r"\\[,;:! ]", "", text)
    text = re.sub(r"[\s,]", "", text).rstrip(".")
    text = _strip_outer_braces(_unbox(text))
    return text.rstrip(".").lower()


# Reading an answer as a number. Models decorate numbers (1\,000, \$1000, 5^\circ, 12 \pmod{20}, **42**, "so the
# answer is 42"), and math_verify, given "$1\,000$", reads the product 1*000: for an integer gold the number decides.
_GROUP_SEPARATOR = r"(?:,|\{,\}|\\[,;: ]|~|[ \u00a0\u2009\u202f])"  # 1,000  1{,}000  1\,000  1~000  1 000
_UNSIGNED = rf"(?:(?:\d{{1,3}}(?:{_GROUP_SEPARATOR}\d{{3}})+|\d+)(?:\.\d+)?|\.\d+)"
_SIGNED = rf"[+-]?\s*{_UNSIGNED}"  # deliberately no exponents: Fraction("1e999999999") would never finish
_NUMBER = re.compile(_SIGNED)
_SLASH_FRACTION = re.compile(rf"({_SIGNED})\s*/\s*({_SIGNED})")
_LATEX_FRACTION = re.compile(rf"([+-]?)\s*\\[dtc]?frac\s*\{{\s*({_SIGNED})\s*\}}\s*\{{\s*({_SIGNED})\s*\}}")
_TEXT_COMMAND = re.compile(r"\\(?:text(?:bf|it|rm|normal)?|math(?:rm|bf|it)|mbox|operatorname)\s*\{([^{}]*)\}")
# never a unit: "2 sin theta" is not 2, "17 but could also be eighteen" not 17
_NOT_A_UNIT = rf"(?:{_NEVER_A_UNIT}|{_NUMBER_WORDS}|{_ALTERNATIVE_WORDS})\b"
_TRAILING_QUALIFIER = re.compile(
    r"(?:\s*\(?\s*\\?[pb]?mod(?:ulo)?\s*\{?\s*\d+\s*\}?\s*\)?"          # 12 \pmod{20}, 12 (mod 20)
    r"|\s*(?:\^\s*\{?\s*\\circ\s*\}?|°|\\degree)"                        # 5^\circ, 5°
    r"|\s*\\?%"                                                          # 25\%
    rf"|(?:\s|\\[,;: ]|~)+(?!{_NOT_A_UNIT})[A-Za-z]{{2,}}\.?(?:\^\{{?[23]\}}?)?)$",      # 1000 dollars, 12 cm^2
    re.IGNORECASE)
_PROSE = re.compile(r"[A-Za-z]{2,}")
_PROSE_PREFIX = re.compile(r"^(?:[A-Za-z][A-Za-z'’]*[\s,:]+)+(?=[+\-\\.\d])")  # so the answer is 42


def _strip_decorations(text):
    """The bare answer: no box, $, \\text{}, markdown emphasis, sentence punctuation, earlier sentences, units,
    trailing qualifiers (mod, degrees, percent), prose before the number, the left side of a single `=`."""
    text = text.replace("\u2212", "-").replace("\\$", "")
    text = re.sub(r"\$|\\[()\[\]]|\\left|\\right|\\displaystyle|\\!", "", text)
    text = _TEXT_COMMAND.sub(r" \1", text)
    previous = None
    while text != previous:
        previous = text
        text = _strip_outer_braces(_unbox(text.strip().strip("*_`").strip().rstrip(".;").strip()))  # not "!": 5!
        sentences = re.split(r"(?<=[.!?;])\s+(?=\S)", text)
        if all(_PROSE.search(sentence) for sentence in sentences[:-1]):  # "42; 43" is two values, not prose
            text = sentences[-1]  # the last sentence
        text = _TRAILING_QUALIFIER.sub("", text)
    if text.count("=") == 1:
        text = text.split("=")[1]
    return _PROSE_PREFIX.sub("", text.strip())


# e-notation as Python prints it (1.5e3, 2e-05); a short exponent, so that writing the number out stays cheap
_E_NOTATION = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)[eE][+-]?\d{1,2}")


def _written_out(prediction):
    """A prediction that is one number in e-notation, written out ("1.5e3" -> "1500", "2e-3" -> "0.002"); any other
    prediction unchanged. Only beside a numeric gold: beside a symbolic one, 2e-3 may mean 2e - 3."""
    from decimal import Decimal

    bare = _strip_decorations(prediction) if len(prediction) <= 1000 else ""  # the regexes stay cheap
    return format(Decimal(bare), "f") if _E_NOTATION.fullmatch(bare) else prediction


def _has_finite_decimal(x):
    """Whether x has a finite decimal expansion: its reduced denominator has no prime factors but 2 and 5."""
    d = x.denominator
    for p in (2, 5):
        while d % p == 0:
            d //= p
    return d == 1


def numbers_agree(predicted, gold):
    """Numeric equality within 1e-8, except that a finite decimal never equals a gold without one (0.333333 and
    0.3333333333 are truncations of 1/3, not its value); 0.5 and 1/2 are equal."""
    if predicted == gold:
        return True
    if _has_finite_decimal(predicted) and not _has_finite_decimal(gold):
        return False
    return abs(predicted - gold) <= Fraction(1, 10**8)


def _fraction(number_text):
    return Fraction(re.sub(rf"\s|{_GROUP_SEPARATOR}", "", number_text))


def read_number(text):
    """An exact Fraction for an answer that is one number (integer, decimal, a/b or \\frac{a}{b}, decorated as
    _strip_decorations allows), else None."""
    if text is None or len(text) > 1000:  # a number is short; the regexes stay cheap
        return None
    bare = _strip_decorations(text)
    try:
        if _NUMBER.fullmatch(bare):
            return _fraction(bare)
        if match := _SLASH_FRACTION.fullmatch(bare):
            return _fraction(match[1]) / _fraction(match[2])
        if match := _LATEX_FRACTION.fullmatch(bare):
            value = _fraction(match[2]) / _fraction(match[3])
            return -value if match[1] == "-" else value
    except (ValueError, ZeroDivisionError):  # more digits than int() reads, a zero denominator
        pass
    return None


# Words that offer alternatives. math_verify reads "42 or 43" as a set (never equal to one value) but "42 (or 43)" or
# 42 \lor 43 as one of the values, so an answer that offers alternatives to a gold of one value is decided here.
_ALTERNATIVES = re.compile(rf"\b(?:{_ALTERNATIVE_WORDS})\b|\\(?:lor|vee)(?![A-Za-z])", re.IGNORECASE)
_SEVERAL_VALUES = re.compile(r"[,;]|\\(?:pm|mp|cup)(?![A-Za-z])|\band\b", re.IGNORECASE)  # a list, a set, a ± pair


def is_hedge(prediction, gold):
    """Whether the prediction offers alternatives ("42 or 43", "42 (or 43)") where the gold is one value."""
    gold_is_one_value = read_number(gold) is not None or not (_ALTERNATIVES.search(gold)
                                                              or _SEVERAL_VALUES.search(gold))
    return gold_is_one_value and bool(_ALTERNATIVES.search(prediction))


def score_answer(prediction, gold):
    """(score 0.0 or 1.0, method). A pure function; it may run for a long time on adversarial input (sympy), so the
    episode loop calls it through score_answer_isolated. A hedge scores 0 (is_hedge; several different boxed
    values come here as a list, which no single value equals). Beside a numeric gold, a prediction in e-notation is
    written out first, and a prediction that reads as a number is compared as one: exactly for an integer gold
    (integer_match), else accepted when numbers_agree. Otherwise math_verify, gold first, with the prediction's
    decimals exact (it also reads forms such as 50\\% for 0.5); when it cannot decide, normalised exact match and
    numbers_agree."""
    if prediction is None or not prediction.strip():
        return 0.0, "missing_final_answer"
    if is_hedge(prediction, gold):
        return 0.0, "hedge"
    gold_number = read_number(gold)
    if gold_number is not None:
        prediction = _written_out(prediction)
        predicted_number = read_number(prediction)
        if predicted_number is not None and gold_number.denominator == 1:
            return float(predicted_number == gold_number), "integer_match"
        if predicted_number is not None and numbers_agree(predicted_number, gold_number):
            return 1.0, "numeric_match"
    decided = _math_verify(prediction, gold)
    if decided is not None:
        return float(decided), "math_verify"
    pred_norm, gold_norm = normalize_answer(prediction), normalize_answer(gold)
    if pred_norm == gold_norm:
        return 1.0, "exact_match"
    pred_num, gold_num = read_number(prediction), read_number(gold)
    if pred_num is not None and gold_num is not None:
        return float(numbers_agree(pred_num, gold_num)), "numeric_match"
    return 0.0, "no_match"


def unscored_reason(prediction, *, bash_calls, finish_reason, error=None):
    """The score method of an episode that cannot score, or None when its answer is to be scored: it must have
    ended with an accepted final answer, run at least one bash command and ended without an error (context
    overflow included)."""
    if finish_reason == "context_overflow":
        return "context_overflow"
    if error is not None or finish_reason == "error":
        return "error"
    if prediction is None:
        return "missing_final_answer"
    if bash_calls == 0:
        return "no_bash_call"
    return None


# ---- Scoring off the event loop, in worker processes that can be killed
#
# sympy can run for minutes on an answer such as 2^{2001^{2000}}, mostly inside C code that holds the GIL (a thread
# would freeze the whole engine) and that no signal interrupts. So the episode loop scores in a small pool of
# worker processes, awaited through the pool's threads: a call takes an idle worker (or starts one); a worker that
# does not answer within SCORE_TIMEOUT_S is killed (0, "score_timeout"), one that dies or garbles its reply too
# (0, "score_error"), and a replacement starts at once. Workers are fresh interpreters (subprocess: no fork of the
# vLLM process and its threads) running this file, `python scoring.py PARENT_PID`, which imports neither torch nor
# vLLM. They die with the pool thread that started them (PR_SET_PDEATHSIG; pool threads live as long as the pool), so
# with the process, even a killed one.

SCORE_TIMEOUT_S = 20.0            # wall-clock limit of one scoring call in a worker (normal answers take ms)
SCORER_PROCESSES = 4              # at most this many workers (and scoring calls at once), started lazily
SCORER_START_TIMEOUT_S = 300.0    # a worker's start-up (imports of sympy and math_verify); not part of the limit
SCORER_MEMORY_BYTES = 4 * 1024**3  # RLIMIT_AS of a worker: a runaway sympy allocation ends in MemoryError

_SCORER_SCRIPT = str(Path(__file__).resolve())  # what a worker runs (the __main__ block at the end)


def signal_on_parent_death(signum: int, parent: int) -> bool:
    """Ask Linux to send this process `signum` when its parent dies (prctl PR_SET_PDEATHSIG; strictly: when the
    parent's thread that started it ends). False when `parent` is no longer the parent (it died before the request,
    so no signal will come); True otherwise, also where prctl is unavailable. For the scorer workers and vLLM's
    EngineCore (engine.py's watchdog), which must not outlive the process that started them."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signum))
    return os.getppid() == parent


def _scorer_worker_main(parent_pid):
    """A worker's loop: one JSON line [prediction, gold] in on stdin, one line [score, method] out."""
    import logging
    import resource
    global _IN_SCORER_WORKER
    _IN_SCORER_WORKER = True
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled": the pool is the timeout
    if not signal_on_parent_death(signal.SIGKILL, parent_pid):  # die with the thread that started us (or now)
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the parent, which ends its workers
    resource.setrlimit(resource.RLIMIT_AS, (SCORER_MEMORY_BYTES, SCORER_MEMORY_BYTES))
    replies = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # a stray print (sympy, warnings) goes to stderr, never into the replies
    for prediction, gold in ((r"\frac{1}{2}", "0.5"), ("x + 1", "y")):  # loads math_verify's grammar and sympy's
        score_answer(prediction, gold)                                   # lazy modules (seconds) before any clock
    replies.write(b'"ready"\n')
    for line in sys.stdin.buffer:
        try:
            prediction, gold = json.loads(line)
            score, method = score_answer(prediction, gold)
        except BaseException as exc:  # MemoryError, RecursionError, ...: this answer scores 0, the worker goes on
            score, method = 0.0, "score_error"
            print(f"[scorer] {type(exc).__name__}: {exc}", file=sys.stderr)
        replies.write((json.dumps([score, method]) + "\n").encode())


class _ScorerWorker:
    """One worker process and the parent's end of its pipes."""

    def __init__(self):
        self.process = subprocess.Popen(
            [sys.executable, _SCORER_SCRIPT, str(os.getpid())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0, close_fds=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
        self.ready = False

    def read_line(self, timeout_s):
        """One reply line; TimeoutError when none comes in time, EOFError when the worker is gone."""
        deadline, line = time.monotonic() + timeout_s, b""
        fd = self.process.stdout.fileno()
        while not line.endswith(b"\n"):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise TimeoutError
            chunk = os.read(fd, 65536)
            if not chunk:
                raise EOFError
            line += chunk
        return json.loads(line)

    def score(self, prediction, gold, timeout_s):
        if not self.ready:
            if self.read_line(SCORER_START_TIMEOUT_S) != "ready":
                raise ValueError("worker did not start")
            self.ready = True
        self.process.stdin.write((json.dumps([prediction, gold]) + "\n").encode())
        score, method = self.read_line(timeout_s)
        return float(score), str(method)

    def kill(self):
        with contextlib.suppress(OSError):
            self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            with contextlib.suppress(OSError):
                pipe.close()


class _ScorerPool:
    """Idle workers wait in a list; a call takes one, or starts one when none is idle (at most one per thread)."""

    def __init__(self, processes):
        self.threads = concurrent.futures.ThreadPoolExecutor(max_workers=processes, thread_name_prefix="scorer")
        self.idle, self.busy, self.lock, self.closed = [], set(), threading.Lock(), False

    def score(self, prediction, gold):
        """Runs in a pool thread. Never raises: a timeout or a broken worker scores 0 and is killed, and its
        replacement starts at once (its start-up overlaps what comes next)."""
        worker = None
        try:
            worker = self.take()
            result = worker.score(prediction, gold, SCORE_TIMEOUT_S)
            self.give_back(worker)
            return result
        except TimeoutError:
            result = 0.0, "score_timeout"
        except Exception:  # a worker that died or garbled its reply, a failed start: this answer only scores 0
            result = 0.0, "score_error"
        with contextlib.suppress(Exception):
            self.replace(worker)
        return result

    def take(self):
        with self.lock:
            if self.closed:
                raise RuntimeError("the scorer pool is shut down")
            while self.idle:
                worker = self.idle.pop()
                if worker.process.poll() is None:
                    break
                worker.kill()  # died while idle
            else:
                worker = _ScorerWorker()
            self.busy.add(worker)
            return worker

    def give_back(self, worker):
        with self.lock:
            self.busy.discard(worker)
            if self.closed:
                worker.kill()
            else:
                self.idle.append(worker)

    def replace(self, worker):
        if worker is not None:
            worker.kill()
        with self.lock:
            self.busy.discard(worker)
            if not self.closed:
                self.idle.append(_ScorerWorker())

    def workers(self):
        with self.lock:
            return self.idle + list(self.busy)

    def shutdown(self):
        with self.lock:
            self.closed = True
            workers, self.idle = self.idle + list(self.busy), []
        for worker in workers:  # a call still waiting on one of them sees EOF and returns at once
            worker.kill()
        self.threads.shutdown(wait=True, cancel_futures=True)


_scorer_pool_instance = None
_scorer_pool_lock = threading.Lock()


def _scorer_pool():
    """The process's scorer pool, created on first use and shut down at exit."""
    global _scorer_pool_instance
    with _scorer_pool_lock:
        if _scorer_pool_instance is None:
            _scorer_pool_instance = _ScorerPool(SCORER_PROCESSES)
        return _scorer_pool_instance


def shutdown_scorer_pool():
    """Kill the scorer workers; the next scoring call starts a new pool."""
    global _scorer_pool_instance
    with _scorer_pool_lock:
        pool, _scorer_pool_instance = _scorer_pool_instance, None
    if pool is not None:
        pool.shutdown()


atexit.register(shutdown_scorer_pool)


async def score_answer_isolated(prediction, gold):
    """score_answer(prediction, gold) in a scorer worker, awaited without blocking the event loop. At most
    SCORE_TIMEOUT_S of scoring (plus a worker's start-up); never raises."""
    if prediction is None or not prediction.strip():
        return score_answer(prediction, gold)
    try:
        pool = _scorer_pool()
        return await asyncio.get_running_loop().run_in_executor(pool.threads, pool.score, prediction, gold)
    except RuntimeError:  # the pool was shut down under this call (exit, or a test)
        return 0.0, "score_error"


if __name__ == "__main__":  # a scorer worker (_ScorerWorker starts it)
    if len(sys.argv) != 2 or not sys.argv[1].isdigit():
        sys.exit(f"usage: python {sys.argv[0]} PARENT_PID (a scorer worker: JSON lines on stdin; see its docstring)")
    _scorer_worker_main(int(sys.argv[1]))
