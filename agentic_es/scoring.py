"""Scoring: what an agent's reply commits to as its answer, that answer against the gold
(as a number, by math-verify, else normalised exact match), and which episodes score at all.

What an answer commits to is one written policy, docs/scoring.md, rule by rule with examples; the sections below follow it
in its order: where the answer is, the committed value (rule 1), notes, hedges and several values (rules 2-4),
comparing with the gold.

The episode loop scores in worker processes that a hung sympy call cannot stall (score_answer_isolated): a worker
is this file run as a script, started by the pool, never by hand:

    python agentic_es/scoring.py PARENT_PID  # one JSON line [prediction, gold] in on stdin, one line [score, method] out

Imports nothing of the project and neither torch nor vLLM (so a worker starts in seconds); math_verify and sympy are
imported on first use, inside the functions that compare.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import functools
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
from typing import NamedTuple


# ---- Where the answer is (docs/scoring.md: the marker line; rule 5, display math below an empty one; the last box)

def strip_think(text):
    """Without <think>...</think> blocks, what precedes a dangling </think> and what follows an unclosed <think>."""
    text = re.sub(r"<think>.*?</think>", "", text, flags=re.DOTALL)
    return text.rsplit("</think>", 1)[-1].split("<think>", 1)[0]


# only at the start of a line, after optional markdown (quote, list bullet or number, heading, emphasis): prose such
# as "I computed the answer: 16 earlier" in the middle of a line commits to nothing
_ANSWER_MARKER = re.compile(
    r"^[ \t]*(?:(?:[>#*_+-]|\d+[.)])[ \t]*)*(?:final[ \t]+answers?|answers?|réponse(?:[ \t]+finale)?|"
    r"respuesta(?:[ \t]+final)?|resposta(?:[ \t]+final)?|risposta(?:[ \t]+finale)?|(?:endgültige[ \t]+)?antwort|"
    r"(?:окончательный[ \t]+)?ответ|最终答案|答案|答え)[ \t]*(?:\*\*|__)?[ \t]*"
    r"(?:[:：]|(?=(?:\*\*|__)?[ \t]*$))",  # Final answer:  ## Final Answer (a heading, the value below)
    re.IGNORECASE | re.MULTILINE)
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_LINE_BELOW = re.compile(r"(?:\s*\n[ \t]*```[^\n]*)*\s*\n[ \t]*(?:[-*+>][ \t]+|\d+[.)][ \t]+)*(\S[^\n]*)")  # past ``` and bullets
_DISPLAY_MATH = re.compile(r"(?s)[ \t]*\n\s*(\\\[.{0,2000}?\\\]|\$\$.{0,2000}?\$\$|(?:\$|\\\(|\\boxed|\\fbox)[^\n]*"
                           r"|\\begin\{(equation\*?)\}.{0,2000}?\\end\{\2\})")  # below an empty marker line


def _closing_braces(text):
    """{index after each opening brace that closes: index after the brace that closes it}, in one pass."""
    closing, opened = {}, []
    for i, char in enumerate(text):
        if char == "{":
            opened.append(i + 1)
        elif char == "}" and opened:
            closing[opened.pop()] = i + 1
    return closing


def answer_text(reply):
    """The part of a reply that states its answer, or None: the answer statement (the rest of the last marker line,
    to the end of a box opened there; below an empty one, display math or the next line; else the last closed box's
    line, from its first box), then the later statements that may correct or hedge it, each after LATER."""
    text = strip_think(reply)
    closing = _closing_braces(text) if _BOXED.search(text) else {}
    boxes = [(box.start(), closing.get(box.end())) for box in _BOXED.finditer(text)]
    closed = [(box, close) for box, close in boxes if close]
    line_end = lambda i: (text + "\n").find("\n", i)
    answer = earlier = None
    if markers := list(_ANSWER_MARKER.finditer(text)):
        start = markers[-1].end()
        earlier = _earlier_statement(text, markers, line_end)
        end = max([line_end(close) for box, close in boxes if close and start <= box < line_end(start)], default=0)
        end = max(end, line_end(start))
        line = text[start:end].strip(" \t*_")
        if line and (_MATH_CONTENT.search(line) or not any(box >= end for box, _ in closed)):
            answer = line
        elif not line and (display := _DISPLAY_MATH.match(text, end)):
            answer, end = re.sub(r"\\(?:begin|end)\{equation\*?\}", "$$", display[1]), display.end()
        elif not line and (below := _LINE_BELOW.match(text, end)):  # DAPO's Answer: with the value below
            answer, end = below[1].strip(" \t*_"), below.end()
        closed = [(box, close) for box, close in closed if box >= end] or closed  # a box below the marker first
    if answer is None and closed:  # a box labelled a check or an intermediate quantity is no answer (one labelled a
        labels = [_working_label(text, box, close) for box, close in closed]  # check is, where it is the only one)
        closed = [b for b, label in zip(closed, labels) if not label] or [
            b for b, label in zip(closed, labels) if label == "check"]
    if answer is None and not closed and (stated := _STATED_ANSWER.search(text.rstrip().rsplit("\n", 1)[-1])):
        answer, end = stated[1].strip(" \t*_"), len(text)  # no marker, no box: the last line's "the answer is 56."
    if answer is None:
        if not closed:
            return None
        n = len(closed) - 1  # the last box, unless offered as an alternative to an earlier one or told as a past try
        while n and any(pattern.search(text[_sentence_start(text, closed[n][0]):closed[n][0]])
                        for pattern in (_ALTERNATIVE_BEFORE, _RETROSPECT, _CONDITION_BEFORE)):
            n -= 1
        line_of = lambda i: text.rfind("\n", 0, i) + 1
        while n and line_of(closed[n - 1][0]) < line_of(closed[n][0]) and all(  # (a) \boxed{3} (b) \boxed{7}
                _PART_LABEL.match(text, line_of(closed[m][0])) for m in (n - 1, n)):
            n -= 1
        line, end = text.rfind("\n", 0, closed[n][0]) + 1, line_end(closed[n][1])
        start = next(box for box, _ in closed if box >= line)  # the work before the first box is no answer
        cut = next((box for box, close in boxes if start <= box < end and not close), end)
        answer = "$" * (text[line:start].count("$") % 2) + text[start:cut].strip()  # a box inside $...$ stays in math
        if doubt := re.search(r"(?i)\b(\w+)\W{0,3}$", text[line:start]):  # The answer is probably \boxed{45}.
            answer = (doubt[1] + " " if doubt[1].lower() in _DOUBT else "") + answer
        stated = [(box, close) for box, close in closed[:n] if line_of(box) < line and re.search(
            r"(?i)\banswer\b", text[line_of(box):box])]  # The answer is \boxed{64}. ... So \boxed{65}.
        if stated and not _REEXAMINED.search(text[stated[-1][1]:line]):
            earlier = text[stated[-1][0]:stated[-1][1]]
    if earlier:
        answer = earlier + LATER + answer
    later = _later_statements(text, end)
    if not later and _RETRACTED.search(text, end):  # Wait, that's wrong. Let me recompute ... (and nothing more)
        return None
    return _PART_LABEL.sub("", answer) + "".join(  # the parts of an answer are listed together
        ("\n" if _PART_LABEL.match(statement) else CORRECTED if corrected else LATER) + _PART_LABEL.sub("", statement)
        for statement, corrected in later)


# a sentence that takes the answer back: with nothing after it the reply states no answer (_RETRACTED); with a
# value right after it, the value corrects it (_LATER_ANSWER): The answer above is wrong; 43
_RETRACTION = r"""(?:(?:that|this|it|(?:my|the)\s+(?:final\s+|previous\s+|earlier\s+|first\s+)?answer(?:\s+above)?
    |the\s+above)(?:['\u2019]s|\s+is|\s+was|\s+seems|\s+must\s+be)\s+(?:(?:all|definitely|clearly|actually)\s+)?
    (?:wrong|incorrect|not\s+(?:right|correct)|a\s+mistake|an\s+error)|I\s+(?:made|['\u2019]ve\s+made|have\s+made)\s+
    (?:a|an)\s+(?:mistake|error)|scratch\s+that|disregard\s+(?:that|this|the\s+above)|that\s+can(?:['\u2019]|no)t\s+be
    \s+right)"""
_RETRACTED = re.compile(r"(?imx)(?:^|[.!?]\s+)[ \t]*(?:(?:wait|hmm+|oh|oops|no|actually)\b[,.!\s\u2014-]*)*"
                        + _RETRACTION + r"\b")
_CONDITION_BEFORE = re.compile(r"(?i)^\W*(?:if|unless|when|assuming|in case)\b")  # If rotations are ..., \boxed{}
_PART_LABEL = re.compile(r"(?m)^[ \t>*-]*(?:\((?:[a-h]|i{1,3}|iv|vi{0,3}|\d)\)|(?:\*\*)?[Pp]art[ \t]+\w+(?:\*\*)?[:.)])"
                         r"(?:\*\*)?[ \t]*")  # (a)  (ii)  Part 2:
_STATED_ANSWER = re.compile(r"(?im)\b(?:the|my|our)\s+(?:final\s+)?answer\s+(?:is|would\s+be|will\s+be|should\s+be|"
                            r"must\s+be)\s*:?([^\n]+)")
LATER = "\ue000"  # joins an answer statement to a later one (private use: never in a reply)
CORRECTED = "\ue001"  # LATER after text that corrects or re-examines (_REEXAMINED)
# what tells that the text before a later answer statement corrects or re-examines the statement before it
_REEXAMINED = re.compile(r"(?i)\b(?:actually|wait|oops|sorry|hmm+|correct(?:ion|ed|ing)|mistakes?|errors?|erroneous|wrong|"
                         r"incorrect(?:ly)?|typo|missed|miss(?:ing|es)|forgot|overlooked|mis\w+|(?:double|over|under)[- ]?"
                         r"count\w*|re-?(?:check|count|comput|calculat|examin|consider|evaluat|visit|do|work|think)\w*|"
                         r"double-?check\w*|verif\w*|instead|revis\w*|fix\w*|updat\w*|on (?:second thought|reflection)|"
                         r"let me|I\s+meant|scratch\s+that|disregard|my\s+(?:mistake|bad)|(?:correct|right|true|"
                         r"actual)\s+(?:answer|value|result|one|count|total|number))\b")
_MATH_CONTENT = re.compile(r"[\d$\\]|(?<![\w'])(?:[a-zA-Z]|pi|infinity)(?![\w'])|" + "|".join(
    ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "twelve", "twenty",
     "hundred", "thousand"]), re.IGNORECASE)
_ALTERNATIVE_BEFORE = re.compile(r"(?i)\b(?:or|maybe|perhaps|possibly|might|could|alternatively|otherwise)\b")
# after the answer statement, what states an answer again (rule 6): a box; an answer phrase; a correction with a
# verb before its value ("actually it's 43"; the words between are left out) or with its value alone (_CORRECTION_ALONE:
# "Correction: 43", "Oops, 43.", "Sorry, I meant 43.", "The correct value is 43.", "The answer above is wrong; 43", read
# as "correction 43"); an alternative: "Or 43", "It could also be 43.", "But 43 is also possible.", "If both ends
# count, it is 43." (a condition on the reading; "If n = 1, it is 3" checks a case and states nothing)
_VALUE_AHEAD = r"(?=[-$\\\d])"
_ALONE = r"""(?=(?:\$[^$\n]{1,60}\$|\\\([^\n]{1,60}?\\\)|-?\d[\d,.]*(?:/\d+)?|\\[dt]?frac\{[^{}]*\}\{[^{}]*\})[ \t]*
    (?:[.!;,)(\n]|\u2014|\u2013|--|\Z|\s+(?:or|and)\b))"""  # a value that ends its sentence, or before a note or a list
_CORRECTION_ALONE = rf"""(?P<fix>\b(?:(?:correction|corrected|actually|oops|sorry|wait|on\s+(?:second\s+thought
      |reflection)|my\s+(?:mistake|bad)|I\s+meant|make\s+that|edit(?:ed)?|update[d]?|erratum|typo|fix(?:ed)?|revised
      |amended|{_RETRACTION})\b|(?:the\s+)?(?:correct|right|true|actual
      |corrected)\s+(?:final\s+)?(?:answer|value|result|one|count|total|number|sum)\s*(?:(?:is|are|would\s+be
      |should\s+be|must\s+be)\b|[=:])))
    (?:[\s,:;.!\u2013\u2014-]|\b(?:it'?s|it\s+is|is|I\s+meant|I\s+mean|make\s+that|make\s+it|(?:it\s+)?should\s+be
      |actually|no|rather)\b)*? (?P<fixed>){_ALONE}"""
_OTHER_READING = r"(?:under|with|in|for)\s+(?:the\s+)?(?:other|alternative|another|different|opposite)\b"
_ALTERNATIVE_LATER = rf"""(?:^|(?<=[\n(]))[ \t(]*(?:or|alternatively|maybe|perhaps|possibly|otherwise)\b
      [ \t\w,]{{0,30}}?{_VALUE_AHEAD}
  | \b(?:(?:it|this|that|the\s+(?:final\s+)?answer)\s+(?:could|might|may|can)\s+(?:also\s+|equally\s+)?be
      |(?:could|might|may|can)\s+(?:also|equally|as\s+well)\s+be)\s+(?:also\s+)?{_VALUE_AHEAD}
  | [\d$}})][ \t,)]*(?:(?:is|are|would\s+be|seems)\s+(?:(?:also|equally)\s+(?:possible|plausible|valid|likely
      |correct|right|acceptable|an?\s+(?:option|possibility|candidate))|(?:also\s+)?(?:another|an\s+alternative|one\s+
      more)\s+(?:possibility|option|candidate|answer|solution))|(?:would|could|might|may)\s+(?:also|equally)\s+(?:work
      |fit|hold|do)|also\s+works?|works?\s+(?:too|as\s+well))\b
  | (?:^|(?<=\n))[ \t(]*(?=(?:\$[^$\n]{{1,60}}\$|-?\d[\d,.]*)\s+(?:(?:if|unless|when|assuming)\b|{_OTHER_READING})
      [^\n=]*$)
  | (?:^|(?<=[\n(])|(?<=[.!?]\s))[ \t(]*(?:(?:but|and|so|wait|actually|hmm+|oh|well|no|then)\b[\s,]*)*
      (?:if|unless|when|assuming|in\s+case|{_OTHER_READING})\b(?:(?![.!?]\s)[^\n=]){{0,80}}?[,:]\s*(?:then\s+)?
      (?:(?:it|this|that|the\s+(?:answer|count|total|result|value|number|sum))\s*(?:'s|is|would\s+be|will\s+be|becomes
      |equals)\s*{_VALUE_AHEAD}|{_ALONE})"""
_LATER_ANSWER = re.compile(rf"""(?imx) \\(?:boxed|fbox)\s*\{{
  | \b(?:final\s+|correct\s+|right\s+|true\s+)?answer\s*(?:(?:is|should\s+be|must\s+be|would\s+be)\b|[:：])
  | \b(?P<cue>actually|wait|oops|correction|corrected|sorry|instead|hmm+|missed|forgot|overlooked
      |(?:over|under|mis|double[ -]?)count(?:ed)?|re-?(?:count|comput|calculat|check)(?:ed|ing)?|{_RETRACTION})\b
      (?:(?![.!?]\s|\b(?:if|unless|assuming)\b)[^\n]){{0,80}}?
      (?P<verb>\b(?:it'?s|it\s+is|is|be|gives?|to|equals|becomes))\s*{_VALUE_AHEAD}
  | {_CORRECTION_ALONE}
  | {_ALTERNATIVE_LATER}""")
# A box the reply labels a check (Check: 6 x 7 = \boxed{42}; as a check, ...) or an intermediate quantity (the partial
# sum \boxed{21}, \boxed{120} so far, \boxed{21} (intermediate)) is no answer; unless its sentence calls it the answer,
# corrects, or offers it too (Sanity check: \boxed{841} also works).
_CHECK_LABEL = re.compile(r"""(?ix)(?:^|[(\[])[\W_]*(?:[a-z]+\s+){0,2}?(?:check(?:ing)?|verif(?:y|ying|ied|ication))\s*
    (?:\*\*|__)?\s*[:.)\]\u2014-] | \b(?:as|for)\s+(?:a\s+)?(?:check|verification|sanity\s+check)\b
    | \bto\s+(?:check|verify)\b | \b(?:sanity|cross)[- ]check | \bstep\s+\d+\b""")  # in the box's sentence before it
_INTERMEDIATE_LABEL = re.compile(r"""(?ix)\b(?:intermediate|interim|auxiliary|preliminary|partial\s+(?:sum|product|count
    |total|result|value|answer)s?|sub-?(?:totals?|results?)|running\s+total|so\s+far(?!\s+as)|for\s+now|halfway|lemma
    |not\s+(?:yet\s+)?the\s+(?:final\s+)?answer)\b | ^\W*where\b""")  # in the box's clause before it
_INTERMEDIATE_AFTER = re.compile(r"""(?ix)^\W*(?:[a-z]+\s+){0,2}?(?:so\s+far(?!\s+as)|for\s+now)\b
    | ^\s*(?:[(,\u2014-]\s*)?(?:an?\s+|is\s+(?:only\s+|just\s+)?(?:an?\s+)?)?(?:intermediate|interim|partial
      |preliminary)\b(?!\s+fraction)(?![^:]*:\s*$)""")  # right after it; not "(intermediate: \boxed{21})", a label
# of what follows
_CHECK_AFTER = re.compile(r"(?i)^\s*(?:[(,\u2014-]\s*)?(?:as\s+a\s+|for\s+)?(?:check|verification|sanity\s+check)\b")
_OFFERED_TOO = re.compile(r"(?i)\b(?:also|too|as\s+well|alternatively|or|could|might|maybe|perhaps|possibly|equally)\b")
_ANSWER_WORD = re.compile(r"(?i)\b(?:answer|final(?:ly)?|actually|wait|oops|sorry|correct(?:ion|ed)?|instead|wrong)\b")
_UP_TO_VALUE = re.compile(r"(?:\$|\\[)\]])?(?:(?![.!?]\s)[^\n\d$\\])*")  # past the end of the box's math


def _working_label(text, box, close):
    """What the reply labels the box text[box:close]: "check", "intermediate" or None (_label): from its sentence
    before it and the words after it up to the sentence's end or the next value."""
    after = _UP_TO_VALUE.match(text, close, close + 80)[0]
    return _label(text[_sentence_start(text, box):box], after.lstrip("$\\)]"))


def _label(before, after):
    """"check" (Check: ..., as a check, to verify), "intermediate" (intermediate, the partial sum, so far: in the
    clause before the box, or right after it) or None, from the words of the box's sentence before it and after it;
    None where they call it the answer, correct, or offer it too (_ANSWER_WORD, _OFFERED_TOO)."""
    if _ANSWER_WORD.search(before) or _OFFERED_TOO.search(before) or _OFFERED_TOO.search(after):
        return None
    if _INTERMEDIATE_LABEL.search(re.split(r"[,;]", before)[-1]) or _INTERMEDIATE_AFTER.search(after):
        return "intermediate"
    return "check" if _CHECK_LABEL.search(before) or _CHECK_AFTER.match(after) else None


_SENTENCE_END = re.compile(r"[.!?](?=\s)")


def _sentence_start(text, i):
    """Where the sentence holding text[i] starts: after the last line break or sentence end before it."""
    line = text.rfind("\n", 0, i) + 1
    ends = [m.end() for m in _SENTENCE_END.finditer(text, line, i)]
    return ends[-1] if ends else line


def _later_statements(text, end):
    """The sentences after text[:end] that state an answer again (a box, "the answer is", "actually it's 43"), to
    the end of their box or line, each with whether the text between it and the statement before it re-examines
    (_REEXAMINED): a later answer corrects the statement only then (rule 6). Between a correction word and its value
    the words are left out: "missed n = 0, so the total should be 19" states 19."""
    spans, skips = [], []
    for found in _LATER_ANSWER.finditer(text, end):
        start = max(_sentence_start(text, found.start()), end)
        close = _closing_braces(text[found.start():]).get(found.end() - found.start()) if found[0].endswith("{") else 0
        if close is None or close and _working_label(text, found.start(), found.start() + close):
            continue  # a box cut off after the answer (the token limit) states nothing; a check is no answer
        stop = (text + "\n").find("\n", found.start() + (close or 0))
        if found["cue"] or found["fix"]:
            skips.append((found.end("cue"), found.start("verb"), " ") if found["cue"] else (
                found.start("fix"), found.start("fixed"), " correction "))  # My previous answer was wrong: 36
        if spans and start < spans[-1][1]:
            spans[-1] = (spans[-1][0], max(stop, spans[-1][1]))
        else:
            spans.append((start, stop))
    ends = [end] + [stop for _, stop in spans]
    statements = []
    for n, (start, stop) in enumerate(spans):
        kept = [(a, b, by) for a, b, by in skips if start <= a and b <= stop]
        piece = text[start:stop]
        for a, b, by in reversed(kept):
            piece = piece[:a - start] + by + piece[b - start:]
        if piece.strip():
            statements.append((piece.strip(), bool(_REEXAMINED.search(text[ends[n]:start]))))
    return statements


def _earlier_statement(text, markers, line_end):
    """The statement of the marker line before the last one, when it states mathematics and nothing between the two
    re-examines it: the last one then corrects nothing, and a different value in it is a second answer (rule 6)."""
    if len(markers) < 2:
        return None
    statement = text[markers[-2].end():line_end(markers[-2].end())].strip(" \t*_")
    between = text[line_end(markers[-2].end()):markers[-1].start()]
    return statement if _MATH_CONTENT.search(statement) and not _REEXAMINED.search(between) else None


def extract_final_answer(reply):
    """What the reply commits to, or None when it states no answer: the values read_answer finds in its answer text,
    joined by ", " (" or " before an assignment: score_answer reads them back the same), or that text when it commits
    to none ("not 42")."""
    text = answer_text(reply)
    if text is None:
        return None
    values = read_answer(text)
    # an assignment kept after the committed value was offered (42, unless n = 0): " or " keeps it offered when read
    joined = "".join((" or " if n and _witness(value) else ", " if n else "") + value for n, value in enumerate(values))
    return joined or text.replace(LATER, "\n")


# ---- Rule 1, the committed value: the words that belong to a value, then where it ends

_UNICODE = str.maketrans({"−": "-", "×": r" \times ", "÷": r" \div ", "·": r" \cdot ", "≤": r" \le ", "≥": r" \ge ",
                          "≠": r" \ne ", "π": r" \pi ", "√": r"\sqrt", "∞": r" \infty ", "±": r" \pm ", "°": r"^\circ ",
                          "≈": r" \approx ", "≃": r" \simeq ", "∼": r" \sim ", "≲": r" \lesssim ", "≳": r" \gtrsim ",
                          "≡": r" \equiv ", "∅": r" \emptyset ", "，": ", ", "；": "; ", "：": ": ", "。": ". ", "（": " (",
                          "）": ") ", "【": " [", "】": "] "})
# a bound is not a value: at least 45 answers x >= 45, not 45
_BOUND = re.compile(r"(?i)\b(?:(at\s+least|no\s+(?:less|fewer)\s+than|not\s+(?:less|fewer)\s+than)|(at\s+most|no\s+"
                    r"more\s+than|not\s+more\s+than|up\s+to)|((?:more|greater|larger|bigger)\s+than|above)|((?:less|"
                    r"fewer|smaller)\s+than|below|under))\s+(?=[-$\\\d])")
_UP_TO_RANGE = re.compile(r"(?i)(\d\$?)\s+up\s+to\s+(?=[-$\\\d])")
_BOUND_RELATIONS = (r"\ge", r"\le", ">", "<")
_BOUND_AFTER = re.compile(r"(?i)(?<![\w.])(\$?)(\d+(?:\.\d+)?)(\$?)\s+or\s+(?:(more|greater|higher|larger|above)|"
                          r"(?:less|fewer|lower|smaller|below))\b")  # 45 or more, $45$ or fewer
_SUPERSCRIPT = re.compile("[⁻⁺]?[⁰¹²³⁴⁵⁶⁷⁸⁹]+")  # 2¹⁰ is 2^{10}
_SUPERSCRIPT_DIGITS = str.maketrans("⁻⁺⁰¹²³⁴⁵⁶⁷⁸⁹", "-+0123456789")
_CARDINALS = dict(zip(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen seventeen "
    "eighteen nineteen twenty thirty forty fifty sixty seventy eighty ninety".split(),
    [*range(20), *range(20, 91, 10)]))
_SCALES = {"hundred": 100, "thousand": 10**3, "million": 10**6, "billion": 10**9, "dozen": 12}
_NUMBER_WORDS = re.compile(rf"(?i)\b(?:{'|'.join(_CARDINALS)})\b(?:[\s-]+(?:and[\s-]+)?(?:{'|'.join([*_CARDINALS, *_SCALES])})\b)*")
_DETERMINER = re.compile(r"(?i)\b(?:the|an?|this|that|these|those|each|every|any|all|both|which|only|same|no|its)\s+$")
# "one" after a determiner and a word or two (not a verb) is a pronoun: the right one: 42, the smallest such one
_PRONOUN_ONE = re.compile(r"(?i)\b(?:the|an?|this|that|which|each|every|any|only|same|its|my|our|another)\s+"
                          r"(?:(?!(?:is|was|are|were|be|equals)\b)[a-z]+\s+){1,2}$")
# words for an infinite count or an empty solution set, as the answer's first words: infinitely many, there are no
# real solutions, the empty set (not a note's: "42 (no solutions for n > 5)"; not "infinite" before a noun)
_SET_WORDS = re.compile(r"""(?ix)(?:^|(?<=[\n\ue000\ue001]))
    ([^\w\\]*(?:\\(?:text|textrm|mathrm|mbox)\s*\{\s*)?(?:(?:there\s+(?:is|are|exists?)|(?:it|the(?:\s+\w+){1,2})\s+
      (?:has|have|is)|the\s+answer\s+is)\s+)?)  # a statement's opening words
    (?:((?:countably\s+|uncountably\s+)?infinitely\s+many|(?:arbitrarily|unboundedly)\s+many|an?\s+infinite\s+
      (?:number|amount|count)|(?:countably\s+|uncountably\s+)?infinite(?![ \t]+[a-z]))
      |(no\s+(?:(?:real|integer|positive|valid|such)\s+)?(?:solutions?|roots?)|no\s+such\s+\w+|none(?!\s+of)
      |(?:the\s+)?empty(?:\s+set\b|(?![ \t]+[a-z]))))\b""")
# the constants and roots as math-verify reads them: \mathrm{i} is the imaginary unit, \mathrm{e} Euler's number;
# a root's argument without braces is one token, as in LaTeX (\sqrt[3]2 is \sqrt[3]{2}); 3{:}45 is the time 3:45
_UPRIGHT_CONSTANT = re.compile(r"\\(?:mathrm|operatorname|mathit|textrm|rm|text)\s*\{\s*([ie])\s*\}"
                               r"|\\(?:mathrm|rm)\s+([ie])(?![A-Za-z])")
_UNBRACED_ROOT = re.compile(r"\\sqrt\s*(\[[^\[\]{}]*\])?\s*(\d(?!\d)|[A-Za-z](?![A-Za-z])|\\(?:pi|alpha|beta|gamma|"
                            r"theta|phi|omega|lambda|mu|sigma|tau)(?![A-Za-z]))")
# a leading name before \equiv is dropped as before =: n \equiv 5 \pmod 8 commits to 5
_EMPTY_BRACES = re.compile(r"\\\{(?:\s|\\[,;:! ])*\\\}")
_CONGRUENT_NAME = re.compile(r"(?<![\w\\}])([A-Za-z](?:_\{?\w+\}?)?)\s*\\equiv(?![A-Za-z])")


def _latex_forms(text):
    """\\mathrm{i} and \\mathrm{e} as i and e, \\sqrt[3]2 as \\sqrt[3]{2}, \\varnothing and \\{\\,\\} as \\emptyset,
    3{:}45 as 3:45 (the answer's and the gold's: math-verify parses neither form)."""
    if "\\" in text:  # each pattern only where its command is (the reading's cost)
        text = _UPRIGHT_CONSTANT.sub(lambda m: m[1] or m[2], text) if "rm" in text or "\\text" in text or \
            "\\operatorname" in text or "\\mathit" in text else text
        if "\\sqrt" in text:
            text = _UNBRACED_ROOT.sub(lambda m: rf"\sqrt{m[1] or ''}{{{m[2]}}}", text)
        if "\\{" in text:
            text = _EMPTY_BRACES.sub(r"\\emptyset", text)  # \{\,\}
        text = text.replace(r"\varnothing", r"\emptyset")
    return text.replace("{:}", ":")


def _set_words(text):
    """Words for an infinite count as \\infty and for an empty solution set as \\emptyset (_SET_WORDS)."""
    return _SET_WORDS.sub(lambda m: m[1] + (r"\infty " if m[2] else r"\emptyset "), text)


_ORDINAL_STEMS = {"half": "two", "halve": "two", "third": "three", "quarter": "four", "fif": "five", "eigh": "eight",
                  "nin": "nine", "twelf": "twelve"}
_SCALED = re.compile(r"(\d+(?:\.\d+)?|\ban?\b)[\s-]*(?:(\w*?(?:th|half|halve|third|quarter))s?|(hundred|thousand|"
                     r"million|billion|dozen)s?)\b", re.IGNORECASE)
_WORD_LATEX = {"minus": "-", "negative": "-", "plus": "+", "positive": "", "times": r"\times ", "infinity": r"\infty",
               "factorial": "!", "squared": "^{2}", "cubed": "^{3}", **{word: f"\\{word} " for word in (
                   "pi theta alpha beta gamma delta epsilon phi omega lambda sigma tau sin cos tan cot sec csc arcsin "
                   "arccos arctan sinh cosh tanh log ln exp sqrt infty").split()}}
_MATH_WORD = re.compile(rf"\s*(?<![\\\w])({'|'.join(_WORD_LATEX)})\b\s*", re.IGNORECASE)  # minus 42, 2 pi, 5 factorial


def _cardinal(words):
    """The integer that number words name ("forty-two" 42, "one hundred twenty" 120, "thousand" 1000), else None."""
    total = current = 0
    for word in re.split(r"[\s-]+(?:and[\s-]+)?", words.lower()):
        if word not in _CARDINALS and word not in _SCALES:
            return None
        current = (current or 1) * _SCALES[word] if word in _SCALES else current + _CARDINALS[word]
        if word in _SCALES and word != "hundred":
            total, current = total + current, 0
    return total + current


def _scaled(match):
    """A number and the word after it that changes its value: 42 thousandths, 5 twelfths, 3 million, a dozen."""
    from decimal import Decimal

    number, ordinal, scale = match.groups()
    number = "1" if number.lower() in ("a", "an") else number
    if scale:
        return format((Decimal(number) * _SCALES[scale.lower()]).normalize(), "f")
    stem = re.sub(r"ie$", "y", ordinal.lower().removesuffix("th"))
    denominator = _cardinal(_ORDINAL_STEMS.get(stem, stem))
    return rf"\frac{{{number}}}{{{denominator}}}" if denominator and denominator > 1 else match[0]


_TRIG_DEGREES = re.compile(r"(\\(?:sin|cos|tan|cot|sec|csc)(?:\^\{?\d\}?)?)\s*\(?\s*(-?\d+(?:\.\d+)?)\s*"
                           r"(?:\^\s*(?:\{\s*\\circ\s*\}|\\circ)|\\degree)\s*\)?")
_FUNCTION_NAME = re.compile(r"\\(?:mathrm|text|textrm|operatorname)\s*\{\s*([A-Za-z]{2,})\s*\}(?=\s*\()")
_WRAPPER = re.compile(r"\\(?:boldsymbol|bm|pmb|underline|mathbf|textbf|emph|textit|mathit|bf)\s*(?=\{)"
                      r"|\\(?:color|textcolor)\s*\{[^{}]*\}")


_REPEATING = re.compile(r"(\d*)\.(\d*)\\(?:overline|dot)\s*\{(\d+)\}")


def _repeating(match):
    """A repeating decimal as the fraction it is: 0.\\overline{3} is \\frac{1}{3}, 1.2\\overline{45} is \\frac{137}{110}."""
    whole, fixed, period = match.groups()
    value = (int(whole or 0) + Fraction(int(fixed or 0), 10 ** len(fixed))
             + Fraction(int(period), (10 ** len(period) - 1) * 10 ** len(fixed)))
    return rf"\frac{{{value.numerator}}}{{{value.denominator}}}"


_CHINESE_DIGITS = {c: n for n, c in enumerate("零一二三四五六七八九")} | {"〇": 0, "两": 2}
_CHINESE_UNITS = {"十": 10, "百": 100, "千": 1000, "万": 10**4, "亿": 10**8}
_CHINESE_NUMBER = re.compile(f"[{''.join(_CHINESE_DIGITS)}{''.join(_CHINESE_UNITS)}]+")


def _chinese_number(text):
    """The integer that Chinese numerals name: 三十六 36, 一百零五 105, 十二 12, 两万 20000."""
    total = section = digit = 0
    for char in text:
        if char in _CHINESE_DIGITS:
            digit = _CHINESE_DIGITS[char]
        elif _CHINESE_UNITS[char] >= 10**4:
            total, section, digit = (total + section + digit) * _CHINESE_UNITS[char], 0, 0
        else:
            section, digit = section + (digit or 1) * _CHINESE_UNITS[char], 0
    return total + section + digit


def _unwrapped(text):
    """Without formatting around a value: \\boldsymbol{12}, \\underline{12}, \\textbf{(C)}, \\color{red}{12}."""
    while wrapper := _WRAPPER.search(text):
        end = wrapper.end()
        if wrapper[0].startswith(("\\color", "\\textcolor")) or (close := _closing_braces(text[end:]).get(1)) is None:
            text = text[:wrapper.start()] + text[end:]
        else:
            text = text[:wrapper.start()] + text[end + 1:end + close - 1] + text[end + close:]
    return text


def _normalized(text):
    """The answer in the form the tokens below read: no markdown emphasis, currency or degree signs; i.e. and e.g.
    as words; number words as digits (not after a determiner: the same one, the two roots); words that change a
    number's value, sign words and math words as LaTeX; Unicode math and full-width punctuation as ASCII and LaTeX."""
    text = re.sub(r"√\s*(\d+(?:\.\d+)?|\w)", r"\\sqrt{\1}", re.sub(r",\\!\s*", ",", text))  # √2, 11,\! 111
    text = _SUPERSCRIPT.sub(lambda m: "^{" + m[0].translate(_SUPERSCRIPT_DIGITS) + "}", text)
    text = _TRIG_DEGREES.sub(r"\1(\2 \\pi/180)", _latex_forms(_unwrapped(text.translate(_UNICODE))))  # \sin 30^\circ
    text = _CONGRUENT_NAME.sub(r"\1 =", text) if "\\equiv" in text else text  # n \equiv 5 \pmod 8: 5, as n = 5
    text = re.sub(r"\\\$|\\displaystyle|\\!|\*\*|__|`|\^\s*(?:\{\s*\\circ\s*\}|\\circ)|\\degree", "", text)
    text = _FUNCTION_NAME.sub(r"\\operatorname{\1}", text)  # \mathrm{lcm}(4,6) is 12
    text = _REPEATING.sub(_repeating, text)  # 0.\overline{3} is 1/3
    text = _CHINESE_NUMBER.sub(lambda m: str(_chinese_number(m[0])), text)  # 三十六 is 36
    text = re.sub(r"~~[^~\n]*~~", " ", text)  # a struck-through value is withdrawn: ~~41~~ 42
    text = re.sub(r"(\d)[ \t]*[~\uff5e][ \t]*(?=\d)(?!\d{3}(?!\d))", "\\1\u2013", text)  # 7034 ~ 7035, not 1~000
    text = re.sub(r"(?:(?<=\s)|^)~(?=\s*(?:\d|\$|\\(?:boxed|fbox)\b))", "about ", text)  # ~45, ~\boxed{45}: about
    text = text.replace("~", " ")  # else a space
    text = re.sub(r"(?<![\\\w])sqrt\s*\(([^()]*)\)", r"\\sqrt{\1}", text)  # sqrt(12)
    text = re.sub(r"(\d+(?:\.\d+)?)\s+over\s+(\d+(?:\.\d+)?)\b", r"\\frac{\1}{\2}", text)  # 3 over 4
    text = re.sub(r"(?i)\bin which case\b", " or ", text)  # 256, unless ..., in which case 512
    if "up" in text or "Up" in text:  # 12 up to 15 is a range, not a bound
        text = _UP_TO_RANGE.sub(r"\1 to ", text)
    text = _BOUND.sub(lambda m: next(f" x {relation} " for relation, word in zip(_BOUND_RELATIONS, m.groups()) if word),
                      text)  # at least 45 is no value: x \ge 45
    text = _BOUND_AFTER.sub(lambda m: f"{m[1]}x {_BOUND_RELATIONS[0] if m[4] else _BOUND_RELATIONS[1]} {m[2]}{m[3]}",
                            text)
    text = re.sub(r"\b([ie])\.\s?([eg])\.", r" \1\2 ", re.sub(r",\s*(?:\.\.\.|…)", r", \\ldots", text.strip(" *")))
    text = _set_words(text)  # infinitely many, no solution
    text = _NUMBER_WORDS.sub(lambda m: m[0] if _DETERMINER.search(text[:m.start()][-9:]) or m[0].lower() == "one" and
                             _PRONOUN_ONE.search(text[:m.start()][-40:]) else str(_cardinal(m[0])), text)
    text = _SCALED.sub(_scaled, re.sub(r"(\d)\s*(?:per\s?cent(?:age)?|pct)\b|(?<!\\)%", r"\1\\%", text))
    return _MATH_WORD.sub(lambda m: _WORD_LATEX[m[1].lower()], text)


_TOKEN = re.compile(r"""
    (?P<later>[\ue000\ue001]) | (?P<space>(?:\s|\\[,;:!\ ]|~)+)
  | (?P<box>\\(?:boxed|fbox)\s*\{) | (?P<text>\\(?:text\w*|mbox|math(?:rm|bf|it|sf|tt))\s*\{)
  | (?P<env>\\begin\{(?P<name>\w+\*?)\}.{0,2000}?\\end\{(?P=name)\})
  | (?P<delim>\$\$?|\\[()\[\]])
  | (?P<num>(?:\d{1,3}(?:(?:,|\{,\}|\\[,;:\ ]|[\ ~\u00a0\u2009\u202f])\d{3}(?!\d))+|\d+)(?:\.\d+)?
            (?:[eE][+-]?\d{1,2}(?![\w.]))? | \.\d+)
  | (?P<open>[(\[{]|\\\{) | (?P<close>[)\]}]|\\\}) | (?P<sep>[,;&]|\\\\|\\q?quad\b)
  | (?P<cmd>\\[A-Za-z]+|\\%) | (?P<word>[^\W\d_]+(?:['\u2019-][^\W\d_]+)*)
  | (?P<op><=|>=|!=|[-+*/^_=<>|']|:(?!\s|$)) | (?P<stop>[.?:!]) | (?P<dash>--+|[\u2013\u2014]) | (?P<other>.)
""", re.VERBOSE | re.DOTALL)
_WORD_KINDS = {**dict.fromkeys("or nor either else otherwise alternatively maybe perhaps possibly could might vs "
                               r"versus though although ie equivalently \lor \vee".split(), "alt"),
               **dict.fromkeys("if when unless whether".split(), "if"),
               **dict.fromkeys("since because as which that so thus hence therefore by from with via using per where "
                               r"see eg after given verified checked confirmed computed calculated found obtained "
                               r"according \pmod \bmod \mod \implies \rightarrow \longrightarrow".split(), "explain"),
               "或": "alt", "或者": "alt", "not": "not", "never": "not", "isn't": "not", "isn\u2019t": "not", "is": "is", "equals": "is",
               "and": "and"}
_BINARY_COMMANDS = {r"\times", r"\cdot", r"\div", r"\pm", r"\mp", r"\le", r"\leq", r"\ge", r"\geq", r"\ne", r"\neq",
                    r"\lt", r"\gt", r"\in", r"\notin", r"\cup", r"\cap", r"\setminus", r"\to", r"\equiv", r"\approx"}


class _Token(NamedTuple):
    kind: str     # a _TOKEN group; a word's: alt, if, explain, not, is, and (_WORD_KINDS), name (math), letter, prose
    text: str
    spaced: bool  # whitespace before it
    math: bool    # inside $...$, \(...\), \[...\] or a box, where letters are variables
    close: int = 0  # of an opening bracket: the index after the bracket that closes it (the end when none does)
    wordy: bool = False  # of an opening bracket: words between it and its closing bracket (a note, not math)
    cut: bool = False    # of a box: never closed (the reply was cut: more may have followed)


def _tokens(text, math=False):
    """The answer's tokens (_TOKEN); math: the text is LaTeX (a box's content). Every math region ($...$, $$...$$,
    \\(...\\), \\[...\\], a box's content) is read by _math_tokens: its expressions whole, its \\text{} as prose."""
    tokens = _math_tokens(text, in_box=True) if math else _text_tokens(text)
    opened, words = [], 0  # (index, words before it) of each bracket not closed yet
    for i, token in enumerate(tokens):
        if token.kind == "close" and opened:
            start, before = opened.pop()
            tokens[start] = tokens[start]._replace(close=i + 1, wordy=words > before)
        opened += [(i, words)] if token.kind == "open" else []
        words += token.kind in ("prose", "explain", "not", "alt", "if")
    for start, before in opened:
        tokens[start] = tokens[start]._replace(close=len(tokens), wordy=words > before)
    return tokens


_CLOSING_DELIMITER = {"$": re.compile(r"(?<!\\)\$"), "$$": re.compile(r"\$\$"), "\\(": re.compile(r"\\\)"),
                      "\\[": re.compile(r"\\\]")}


def _text_tokens(text):
    """Tokens of text outside math: words, numbers, operators and brackets as _TOKEN reads them; a box one token
    holding its content; each math region's tokens from _math_tokens."""
    tokens, i, spaced, closing, depth = [], 0, False, _closing_braces(text), 0
    while i < len(text):
        match = _TOKEN.match(text, i)
        kind, i = match.lastgroup, match.end()
        if kind in ("box", "text"):  # a box's content is read on its own; \text{...} is prose
            end = closing.get(i, len(text) + 1)
            if kind == "text":
                tokens += [token._replace(spaced=token.spaced or n == 0)
                           for n, token in enumerate(_text_tokens(text[i:end - 1]))]
            else:
                tokens.append(_Token("box", text[i:end - 1], spaced, True, cut=i not in closing))
            i = end
        elif kind == "delim":
            if match[0] in _CLOSING_DELIMITER:  # a region left open runs to the end
                closer = _CLOSING_DELIMITER[match[0]].search(text, i)
                tokens += [token._replace(spaced=token.spaced or spaced) for token in
                           _math_tokens(text[i:closer.start() if closer else len(text)])]
                i = closer.end() if closer else len(text)
        elif kind != "space":
            if kind == "num" and depth and "," in match[0]:  # (12,102) holds two numbers
                i = match.start() + match[0].index(",")
            depth += (kind == "open") - (kind == "close")
            word = kind == "word" and ("letter" if len(match[0]) == 1 else "prose")
            token = text[match.start():i]
            tokens.append(_Token(_WORD_KINDS.get(token.lower()) or word or kind, token, spaced, False))
        spaced = kind in ("space", "text")
    return tokens


_MATH_TEXT = re.compile(r"\\(?:text\w*|mbox|hbox)\s*\{")
_MATH_SEPARATOR = re.compile(r"[,;&]|\\\\|\\q?quad(?![A-Za-z])|\\(?:lor|vee)(?![A-Za-z])")
_ENVIRONMENT = re.compile(r"\\begin\{(\w+\*?)\}.*?\\end\{\1\}", re.DOTALL)
_DIGIT_GROUP_END = re.compile(r"\d{3}(?!\d)")  # after a digit and a comma: 1,000
_LEADS_UP = re.compile(r"(?:=|:|<|>|\\(?:in|equiv|approx|to|le|ge|leq|geq|sim|cong|Rightarrow|implies))\s*$")
# a modulus after a residue is a note: 3 \pmod{7}, n \equiv 5 \pmod 8, 3 \ (\mathrm{mod}\ 7); in math \bmod splits
# nothing (17 \bmod 5 is an operation)
_MODULUS = re.compile(r"\\(?:pmod|bmod|mod)(?![A-Za-z])|\(\s*(?:\\(?:mathrm|text|operatorname|rm)\s*\{\s*mod\s*\}"
                      r"|\\?mod(?![A-Za-z]))")
_TRAILING_SPACE = re.compile(r"(?:\\[ ,;:!]|\s)*$")
_NESTED_BOX = re.compile(r"\\(?:boxed|fbox)\s*(?=\{)")


def _math_tokens(latex, in_box=False):
    """The tokens of a math region: each expression between its top-level separators (, ; & \\\\ \\quad, \\lor and a
    \\text{} piece) one "math" token that math-verify reads whole (4 k + 1, \\log_2 8, |-3|, \\cos^2 x); a separator
    a sep token (\\lor an alternative word); a \\text{} piece its words as prose (or, cm, when); a digit group's
    comma (1,000) and everything inside brackets or an environment part of the expression; an exponent right after a
    \\text{} unit belongs to the unit (5 \\text{ cm}^2). A box in a box is its content; a box in a region is a box,
    and what leads up to it there is work ($x \\in \\boxed{...}$, $(p, q) = \\boxed{...}$)."""
    latex, tokens = re.sub(r"(?<!\\)\$|\\[()\[\]]", " ", _NESTED_BOX.sub("", latex) if in_box else latex), []
    closing, depth, start, i = _closing_braces(latex), 0, 0, 0

    def flush(end, spaced=True):
        expression = latex[start:end].strip()
        after_text = tokens and tokens[-1].kind not in ("sep", "alt", "math")
        if _MODULUS.match(expression):  # \pmod{11} after the value: a note
            tokens.append(_Token("explain", expression, spaced, True))
        elif re.search(r"[\w\\]", expression) and not (after_text and expression[0] in "^_"):
            tokens.append(_Token("math", expression, spaced, True))
        elif expression:  # punctuation after the value: 42.
            tokens.append(_Token("stop", expression, spaced, True))

    while i < len(latex):
        if depth == 0 and i > start and latex[i] in "\\(" and (modulus := _MODULUS.match(latex, i)) and not \
                modulus[0].startswith("\\bmod"):  # the residue before it is the value, the modulus a note
            flush(_TRAILING_SPACE.search(latex, start, i).start())
            start = i
        if depth == 0 and (text := _MATH_TEXT.match(latex, i)):
            flush(i)
            end = closing.get(text.end(), len(latex) + 1)
            tokens += [token._replace(spaced=token.spaced or n == 0)
                       for n, token in enumerate(_text_tokens(latex[text.end():end - 1]))]
            i = start = end
        elif depth == 0 and (separator := _MATH_SEPARATOR.match(latex, i)) and not (
                separator[0] == "," and i and latex[i - 1].isdigit() and _DIGIT_GROUP_END.match(latex, i + 1)):
            flush(i)
            alternative = separator[0] in ("\\lor", "\\vee")
            tokens.append(_Token("alt" if alternative else "sep", separator[0], True, True))
            i = start = separator.end()
        elif depth == 0 and (box := _BOXED.match(latex, i)):
            if not _LEADS_UP.search(latex[start:i]):
                flush(i)
            end = closing.get(box.end(), len(latex) + 1)
            tokens.append(_Token("box", latex[box.end():end - 1], True, True, cut=box.end() not in closing))
            i = start = end
        elif environment := _ENVIRONMENT.match(latex, i):
            i = environment.end()
        elif command := re.compile(r"\\(?:[A-Za-z]+|.)").match(latex, i):
            depth += {"\\{": 1, "\\}": -1}.get(command[0], 0)
            i = command.end()
        else:
            depth = max(0, depth + (latex[i] in "([{") - (latex[i] in ")]}"))
            i += 1
    flush(len(latex))
    return tokens


def _operator(token):
    return token.kind in ("op", "is") and token.text not in "!'" or token.text in _BINARY_COMMANDS


def _operand_end(tokens, i, after_operator):
    """The index after an operand that starts at tokens[i], or i when none does. Outside math a letter is a variable
    after an operator or before one (x = 5, f(3)) unless it follows a number (a unit), a short word after an
    operator too (x^2 - xy); a bracket holding words, or opening with a relation, is a note, not an operand."""
    token, following = tokens[i], tokens[i + 1] if i + 1 < len(tokens) else None
    if token.kind in ("num", "math", "env") or token.kind == "cmd" and not _operator(token):
        return i + 1
    if token.kind == "open":  # (= 6 \times 7) after a value restates it in a note
        return i if token.wordy or following and _operator(following) and following.text not in "+-" else token.close
    unit = token.spaced and i and tokens[i - 1].kind in ("num", "close")  # 42 m^2, 42 \text{ cm}, 3 (mod 7) m
    if token.kind == "letter" and not unit and (after_operator or not following or _operator(following)
                                                or following.kind in ("open", "sep")):
        return i + 1
    short_word = token.kind == "prose" and len(token.text) <= 3 and token.text.isascii()
    ends = not following or _operator(following) or following.kind in ("close", "sep", "stop")
    return i + 1 if after_operator and short_word and ends else i


def _value_end(tokens, i):
    """The index after the complete mathematical expression that starts at tokens[i], or i when none does: operands
    joined by operators ("is" and "equals" too) or side by side (2\\sqrt{3}, 2 \\pi, 2x, f(x)), with signs and
    postfixes (5!, 28\\%). A space before a number, a word or a bracket ends it; so do a box and a unit (42 cm)."""
    end, j, expecting = i, i, True
    while j < len(tokens):
        token = tokens[j]
        if token.kind == "math" and not expecting:  # a math region's expression is whole: $n$ is 34, not $2$ $x$
            break
        side_by_side = token.kind in ("cmd", "env") or token.text == "{" \
            or (not token.spaced or tokens[j - 1].kind == "cmd") and token.kind in ("open", "num", "letter")
        if expecting and token.text in ("+", "-", r"\pm", r"\mp"):
            j += 1  # a sign
        elif expecting or side_by_side and not _operator(token):
            if (operand_end := _operand_end(tokens, j, j > i and (expecting or tokens[j - 1].kind == "cmd"))) == j:
                break
            end = j = operand_end
            expecting = False
        elif token.text in ("!", "'") and not token.spaced or token.text == r"\%":
            end = j = j + 1
        elif _operator(token):
            j, expecting = j + 1, True
        else:
            break
    return end


def _render(tokens, depth=0):
    """A value as text: digit groups joined (1,000 is 1000), "is" as =; a math region's expression in $...$ where
    read outside math it would read otherwise (4 k + 1 is no number and a unit)."""
    text = re.sub(r"\s+", " ", "".join(" " * (token.spaced and n > 0) + (
        re.sub(r"[^\d.eE+-]", "", token.text) if token.kind == "num" else "=" if token.kind == "is" else token.text)
        for n, token in enumerate(tokens))).strip()
    math = any(token.kind == "math" for token in tokens)
    return f"${text}$" if math and depth < 8 and read_answer(text, depth=8) != [text] else text


# ---- Rules 2 to 4: after the value, a note; beside it or as its alternative, other values it offers

_PHRASE = ("prose", "letter", "name", "not")  # the words of an answer without math
# an estimate or a doubt right before the committed value commits to nothing: about 45, likely around 245, maybe 45
_DOUBT = frozenset("approximately approx about around roughly nearly almost likely probably presumably maybe perhaps "
                   "possibly guess close circa ca estimated est".split()) | {
    r"\approx", r"\sim", r"\simeq", r"\thickapprox", r"\lesssim", r"\gtrsim"}  # \approx 45, \sim 45
_ESTIMATE = re.compile(r"\$?\s*(?:\\?[A-Za-z]+(?:_\{?\w+\}?)?(?:\([^()=]*\))?\s*)?\\(?:approx|sim|simeq|thickapprox|"
                       r"lesssim|gtrsim)(?![A-Za-z])")  # \approx 7034, x \approx 7034: an estimate, no value
# a range offers both its ends: 7034-7035 (a dash), 7034 to 7035 (not: 3.14 to 2 decimal places)
_RANGE_WORDS = frozenset("to through thru till until".split())
_PRECISION = frozenset("decimal significant sig place places digit digits dp sf".split())


def _listed(glue):
    """Whether a value with these tokens before it is listed beside the one before it: nothing but separators, "and"
    or an alternative word between them (42, 43  42 43  42 and 43  42 or 43  42 (43?), where (43?) is one value)."""
    return all(token.kind in ("sep", "and", "alt") for token in glue)


def _ranged(glue, following):
    """Whether a value with these tokens before it and these after it is the other end of a range that starts at the
    value before it: a dash or a range word alone between them (7034\u20137035, 7034 to 7035)."""
    if len(glue) != 1:
        return False
    if glue[0].kind == "dash":  # 7034\u20137035 ways; not 42 \u2014 6 more than the naive count (a note)
        return not (glue[0].spaced and following and following[0].kind == "prose")
    return glue[0].text.lower() in _RANGE_WORDS and not (following and following[0].text.lower() in _PRECISION)


def _conditional_sentence(glue):
    """Whether these tokens before a value end in a sentence of its own that opens with a condition and states the
    value with a verb or after a comma (42. If both ends count, it is 43.  42. If the corners count, 43.): a value
    under another reading, offered; not when the condition names a value (If n = 1, it is 3: a check)."""
    stop = max((n for n, token in enumerate(glue) if token.kind == "stop" and token.text in ".!?"), default=None)
    sentence = [token for token in glue[stop + 1:] if token.kind != "open"] if stop is not None else []
    while sentence and sentence[0].text.lower() in ("but", "and", "so"):
        sentence = sentence[1:]
    return len(sentence) > 1 and (sentence[0].kind == "if" or sentence[0].text.lower() == "assuming") and (
        sentence[-1].kind == "is" or sentence[-1].text.lower() in ("be", "becomes", ",", ":")) and not any(
        token.text == "=" for token in sentence)


def _offered_as_alternative(glue, after_committed):
    """Whether a value with these tokens before it is offered as an alternative: at most three words after an
    alternative word (42, maybe 43  17 but could also be eighteen  42 (checked), or 43), no separator; or after a
    condition right after the committed value (42 if n is odd  42, unless n = 3; not: 42, attained when n = 6)."""
    kinds = [token.kind for token in glue]
    condition = kinds.index("if") if after_committed and "if" in kinds else None
    if condition is not None and all(kind in ("sep", "open", "dash") for kind in kinds[:condition]):
        kinds[condition] = "alt"
    after = kinds[len(kinds) - kinds[::-1].index("alt"):] if "alt" in kinds else None
    after = after[after[:1] == ["sep"]:] if after else after  # alternatively, 43
    return after is not None and len(after) <= 3 and all(k in ("prose", "letter", "is", "and") for k in after)


# A correction supersedes what came before it: one of these words, then at most four bridge words, then the value
# (no, corrected: 42  the correct answer is 42  wait, actually it's 43); "instead of" and "rather than" contrast.
_CORRECTION = frozenset("actually wait oops sorry correction corrected correcting instead rather revised recheck "
                        "rechecked recomputed recalculated recounted fix fixed mistake wrong incorrect typo erratum "
                        "update updated correct right true".split())
_BRIDGE = frozenset("it it's its is be the a an answer value result final correct right true should would was "
                    "make that this now here no actually sorry oops".split())
# A withdrawn value is followed by what says it is wrong: 24 is wrong, 41 was a typo, 43 is not correct
_WITHDRAWN = re.compile(r"(?i)^[\s)\]]*(?:is|was|were|are|=)\s+(?:(?:a|an|just|clearly|actually|definitely|simply|"
                        r"obviously)\s+)*(?:wrong|incorrect|mistaken|mistake|error|erroneous|invalid|typo|off|false|"
                        r"not\s+(?:correct|right|valid)|(?:my|the|a|an)\s+(?:first|initial|earlier|previous|original|naive|wrong)\s+"
                        r"(?:guess|attempt|try|value|answer|estimate|result|count))\b")
# A value told as a past attempt is withdrawn too: earlier I got 8, my initial value 24, at first 30
_RETROSPECT = re.compile(r"(?i)\b(?:earlier|initial(?:ly)?|previous(?:ly)?|original(?:ly)?|at first|my first|before that)\b")
# A value after the committed one that is said to be possible too is offered: 16 is also possible
_ALSO_POSSIBLE = re.compile(r"""(?ix)^\s*(?:(?:is|are|seems|would|could|might|may)\s+)?(?:be\s+)?(?:also|equally|too)\s+
    (?:be\s+)?(?:possible|plausible|valid|likely|correct|right|works?|fits?|holds?|an?\s+(?:option|possibility
      |candidate))\b
  | ^\s*(?:is|are)\s+(?:possible|plausible|valid)\s+(?:too|as\s+well)\b
  | ^\s*(?:is|are|would\s+be)\s+(?:another|an\s+alternative|one\s+more)\s+(?:possibility|option|candidate|answer
      |solution)\b
  | ^\s*instead\b""")
_ASSIGNMENT = re.compile(r"\s*\\?[A-Za-z]+(?:_\{?\w+\}?)?'*\s*=\s*([^=]+)")  # n = 3, a_1 = 5, m=5


def _witness(value):
    """Whether a value only names where the answer holds: assignments of constants to names (x = 3, (m=5, n=7))."""
    parts = re.split(r",|;", _strip_outer_braces(value.strip(" $").removeprefix("(").removesuffix(")")))
    return all((part := _ASSIGNMENT.fullmatch(p)) and not re.search(r"[A-Za-z]", re.sub(r"\\[A-Za-z]+", "", part[1]))
               for p in parts)


# a later statement that opens with a condition, after interjections: Wait, actually, if both ends count, it is 43
_CONDITION_OPENS = re.compile(r"(?i)^\W*(?:(?:wait|actually|hmm+|oh|no|so|but|and|well|then|sorry|oops)\b\W*)*"
                              r"(?:if|unless|when|assuming|in case)\b")


def _later_condition(glue):
    """Whether these tokens before a value hold a later statement that opens with a condition (If rotations are the
    same, the answer is \\boxed{120}): an alternative to the answer, not a correction of it."""
    later = max((n for n, token in enumerate(glue) if token.kind == "later"), default=None)
    return later is not None and bool(_CONDITION_OPENS.match(" ".join(token.text for token in glue[later + 1:])))



def _corrects(glue):
    """Whether a value with these tokens before it corrects the values before it: a later statement (LATER), or a
    correction word (_CORRECTION; correct, right, true before answer, value or result) followed by at most four
    bridge words, commas, colons and dashes (no, corrected: 42  the correct answer is 42  wait, actually it's 43);
    never inside a bracket (a note)."""
    if later := [n for n, token in enumerate(glue) if token.kind == "later"]:
        own = " ".join(token.text for token in glue[later[-1] + 1:])  # the later statement's words before its value
        return not _later_condition(glue) and (glue[later[-1]].text == CORRECTED or bool(_REEXAMINED.search(own)))
    if any(token.kind == "open" for token in glue):
        return False
    words = [token.text.lower() for token in glue]
    adjective = lambda n: words[n] in ("correct", "right", "true") and words[n + 1:n + 2] not in (
        ["answer"], ["value"], ["result"])
    cue = max((n for n, word in enumerate(words) if word in _CORRECTION and not adjective(n)), default=None)
    if cue is None or words[cue + 1:cue + 2] in (["of"], ["than"]):
        return False
    after = glue[cue + 1:]
    return sum(token.kind not in ("sep", "stop", "dash") for token in after) <= 4 and all(
        token.text.lower() in _BRIDGE or token.text in (",", ":", "\uff1a") or token.kind == "dash" for token in after)


def read_answer(text, math=False, depth=0):
    """The values an answer commits to, the committed one first; [] when it commits to none (_read_answer)."""
    return list(_read_answer(text[:20000], math, depth))


@functools.lru_cache(maxsize=4096)  # a pure function; the values it renders are read again (_render)
def _read_answer(text, math, depth):
    """read_answer, as a tuple (rules 1-6); math: the
    text is LaTeX (a box's content, read 8 boxes deep). A value that a "not" precedes or that is said to be wrong is
    withdrawn; a correction or a later statement supersedes the values before it. The committed value is then the
    first box, else the first value; the values listed beside it, those offered as alternatives or under a condition
    after it (127 if n is odd) and the other boxes come with it, except witnesses of where it holds (x = 3); all
    else is a note. Without math, phrases are the values."""
    tokens = _tokens(_normalized(text), math)
    phrase_end = lambda i: next((j for j in range(i, len(tokens)) if tokens[j].kind not in _PHRASE), len(tokens))
    for prose, end_of in ((False, lambda i: i + 1 if tokens[i].kind == "box" else _value_end(tokens, i)),
                          (True, phrase_end)):
        units, i = [], 0  # (start, end) of each value, box or phrase, in order
        while i < len(tokens):
            end = end_of(i)
            units += [(i, end)] if end > i else []
            i = max(end, i + 1)
        if units:
            break
    render = lambda n: _render(tokens[units[n][0]:units[n][1]], depth)
    for n in range(len(units) - 1):  # a choice and its value are one answer: (C) 12
        if n + 1 < len(units) and units[n][1] == units[n + 1][0] and _CHOICE_LABEL.fullmatch(
                "".join(token.text for token in tokens[units[n][0]:units[n][1]])):
            units[n:n + 2] = [(units[n][0], units[n + 1][1])]
    glue = lambda n: tokens[units[n - 1][1] if n else 0:units[n][0]]  # the tokens before unit n
    after = lambda n: " ".join(token.text for token in tokens[units[n][1]:units[n][1] + 8])
    before = lambda n: " ".join(token.text for token in glue(n)[-8:])
    withdrawn = [not prose and (start > 0 and tokens[start - 1].kind == "not" or bool(_WITHDRAWN.match(after(n)))
                                or bool(_RETROSPECT.search(before(n).rsplit(".", 1)[-1])))
                 for n, (start, end) in enumerate(units)]
    superseded = max((n for n in range(1, len(units)) if _corrects(glue(n)) and not withdrawn[n] and not
                      _offered_as_alternative(glue(n), False) and not _ALSO_POSSIBLE.match(after(n))), default=0)
    units = [unit for n, unit in enumerate(units) if n >= superseded and not withdrawn[n]]
    boxes = [n for n, (start, _) in enumerate(units) if tokens[start].kind == "box"]
    if not units:
        return []
    if len(boxes) > 1:  # a box labelled a check or an intermediate quantity is none: 8 (intermediate: \boxed{4})
        sentence = lambda n: " ".join(t.text for t in glue(n)[-8:]).rsplit(" . ", 1)[-1].rsplit(LATER, 1)[-1]
        up_to_next = lambda n: " ".join(t.text for t in glue(n + 1)[:8]) if n + 1 < len(units) else after(n)
        boxes = [n for n in boxes if not _label(sentence(n), up_to_next(n).split(" . ", 1)[0])] or boxes
    committed = first = last = (boxes or [0])[0]
    committed_value = render(committed)
    if _DOUBT & {token.text.lower() for token in glue(committed)[-3:]} or _ESTIMATE.match(committed_value) or tokens[
            units[committed][0]].cut:  # about 45, x \approx 45; a box never closed: more digits may have followed
        return ()
    conditional = lambda n: next((t.kind for t in tokens[units[n][1]:units[n][1] + 3] if t.kind != "sep"), "") == "if"
    ranged = lambda n: _ranged(glue(n), tokens[units[n][1]:units[n][1] + 1]) and all(
        read_number(render(m)) is not None for m in (n - 1, n))
    while first > 0 and (_listed(glue(first)) or ranged(first)):
        first -= 1
    while last + 1 < len(units) and (_listed(glue(last + 1)) or ranged(last + 1)):
        last += 1
    witness = lambda n: n > committed and _witness(render(n)) and not _witness(committed_value) and not any(
        token.kind == "alt" or token.kind == "if" and token.text.lower() != "when" for token in glue(n))
    values = []
    for n in [committed] + [n for n in range(len(units)) if n != committed and (first <= n <= last or n in boxes or (
            n > committed and (_offered_as_alternative(glue(n), n == committed + 1) or conditional(n)
                               or _conditional_sentence(glue(n))  # 42. If both ends count, it is 43.
                               or any(token.kind == "later" for token in glue(n))  # a second answer (rule 6)
                               or _ALSO_POSSIBLE.match(after(n)) or _later_condition(glue(n)))))]:
        start, end = units[n]
        if witness(n):
            continue
        box = tokens[start].kind == "box" and depth < 8
        values += read_answer(tokens[start].text, True, depth + 1) if box else [render(n)]
    return tuple(dict.fromkeys(values))


# ---- Comparing the committed value with the gold: pure functions

_IN_SCORER_WORKER = False  # True in a scorer worker process (_scorer_worker_main)


def _math_verify_timeout():
    """math_verify's timeouts use signal.alarm, which only works in the main thread; elsewhere run without them. A
    scorer worker runs without them too: there the pool's hard kill (SCORE_TIMEOUT_S) is the one limit."""
    return 5 if threading.current_thread() is threading.main_thread() and not _IN_SCORER_WORKER else None


# math-verify drops letters it takes for a unit after a number (5t, 2 m, 3ab); in a math region letters after a
# number are variables, a product, unless they name a unit or a function (7 kg, 3 mod 5; \text{} units are gone)
_LETTERS_AFTER_NUMBER = re.compile(r"(?<![\w\\.])(?<![\^_]\{)(\d+(?:\.\d+)?\}?)(?:\s*([A-Za-z])|([A-Za-z]{2,3}))"
                                   r"(?![A-Za-z])(?!(?<=[eE])[-+\d])")
_UNIT_NAMES = frozenset("mm cm dm km kg mg ml mL min hr hrs ft yd mi lb lbs oz in sec deg rad mph kph kmh pi mod "
                        "ln log lg sin cos tan cot sec csc exp".split())


def _letters_as_variables(latex):
    """3ab as 3 \\cdot a \\cdot b, so that math-verify reads no unit: letters after a number (_LETTERS_AFTER_NUMBER)."""
    return _LETTERS_AFTER_NUMBER.sub(lambda m: m[0] if (m[2] or m[3]) in _UNIT_NAMES else m[1] + "".join(
        f" \\cdot {letter}" for letter in m[2] or m[3]), latex)


def _math_verify(prediction, gold):
    """True/False when math_verify decides, None when it cannot (error or nothing parsed). The prediction, a value
    read_answer found, is read as LaTeX alone, with its decimals exact (_exact_decimals)."""
    from math_verify import LatexExtractionConfig, parse, verify  # here: seconds to import
    from math_verify.errors import TimeoutException as MathVerifyTimeout

    timeout = _math_verify_timeout()
    prediction = _letters_as_variables(re.sub(r"(?<!\\)\$", "", prediction))
    gold = _letters_as_variables(gold)
    try:  # $...$ makes bare LaTeX such as \frac{1}{2} parse
        gold_parsed = parse(f"${gold.strip('$')}$", parsing_timeout=timeout, raise_on_error=True)
        pred_parsed = parse(f"${prediction}$", [LatexExtractionConfig()], parsing_timeout=timeout, raise_on_error=True)
        if not gold_parsed or all(isinstance(p, str) for p in pred_parsed):
            return None
        gold_parsed, pred_parsed = [_imaginary(g) for g in gold_parsed], [_imaginary(_exact_decimals(p)) for p in pred_parsed]
        return bool(verify(gold_parsed, pred_parsed, allow_set_relation_comp=True, timeout_seconds=timeout,
                           raise_on_error=True))
    except (Exception, MathVerifyTimeout):  # sympy errors, recursion, its timeout (a BaseException): "cannot decide"
        return None


def _union_of_relations(values, gold):
    """Whether values that are each an inequality in one and the same variable (x \\le 1, x \\ge 3, offered together)
    are as a union the gold set ((-\\infty, 1] \\cup [3, \\infty)): math-verify compares one relation with a set."""
    from math_verify import parse
    from sympy import Set, Union
    from sympy.core.relational import Relational

    try:
        read = lambda text: (parse(f"${text.strip('$')}$", parsing_timeout=_math_verify_timeout()) or [None])[0]
        relations, gold_set = [read(value) for value in values], read(gold)
        if not isinstance(gold_set, Set) or not all(isinstance(r, Relational) for r in relations):
            return False
        if len({symbol for r in relations for symbol in r.free_symbols}) != 1:
            return False
        return bool(Union(*[r.as_set() for r in relations]) == gold_set)
    except Exception:  # sympy cannot say: no match
        return False


def _imaginary(expr):
    """i as the imaginary unit (math_verify reads it as a variable): e^{i\\pi} is -1, as the gold -1 means."""
    from sympy import I

    units = {symbol: I for symbol in getattr(expr, "free_symbols", ()) if str(symbol) == "i"}
    return expr.xreplace(units).simplify() if units else expr


def _exact_decimals(expr):
    """A parsed prediction with each decimal as the exact rational it names (0.333333 -> 333333/1000000): math_verify
    rounds floats to 6 places, making a truncated 1/3 equal 1/3; the gold's decimals keep it (a gold may be rounded)."""
    from sympy import Float, Rational

    floats = expr.atoms(Float) if hasattr(expr, "atoms") else set()
    return expr.xreplace({f: Rational(str(f)) for f in floats}) if floats else expr


def _strip_outer_braces(text):
    while text.startswith("{") and _closing_braces(text).get(1) == len(text):  # "{a}{b}" is not wrapped
        text = text[1:-1]
    return text


def normalize_answer(text):
    """Exact-match form: no box, $, outer braces, commas, spaces (LaTeX spacing too) or trailing period; lowercase."""
    text = re.sub(r"\\[,;:! ]|[\s,$]", "", text).rstrip(".")
    return _strip_outer_braces(re.sub(r"^\\boxed\{(.*)\}$", r"\1", text, flags=re.DOTALL)).rstrip(".").lower()


def numbers_agree(predicted, gold):
    """Numeric equality within 1e-8, except that a finite decimal never equals a gold without one (0.333333 and
    0.3333333333 are truncations of 1/3, not its value); 0.5 and 1/2 are equal."""
    finite = lambda x: pow(10, x.denominator.bit_length(), x.denominator) == 0  # its denominator divides a 10^k
    if predicted == gold:
        return True
    if finite(predicted) and not finite(gold):
        return False
    return abs(predicted - gold) <= Fraction(1, 10**8)


_DECIMAL = r"[+-]?\s*(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d{1,2})?"  # a short exponent: writing it out stays cheap
_NUMBER = re.compile(rf"([+-]?)\s*(?:({_DECIMAL})(?:\s*/\s*({_DECIMAL}))?"
                     rf"|\\[dtc]?frac\s*\{{({_DECIMAL})\}}\{{({_DECIMAL})\}})")  # 42  -0.5  3/4  \frac{3}{4}
_DIGIT_GROUP = re.compile(r"(?<=\d)(?:,|\{,\}|\\[,;: ]|[ ~\u00a0\u2009\u202f])(?=\d{3}(?!\d))")  # 1,000  1\,000  1 000
_NAME = r"\\?[A-Za-z]+(?:_\{?\w+\}?)?(?:\([^()=]*\))?"  # x  f(3)  a_1  \theta
_ASSIGNED = re.compile(rf"^\s*(?:{_NAME}\s*=(?!=)\s*)+")


def read_number(text):
    """An exact Fraction for a value that is one number (integer, decimal, e-notation, a/b or \\frac{a}{b}, in
    digit groups, after a leading name =), else None."""
    if text is None or len(text) > 1000:  # a number is short; the regexes stay cheap
        return None
    match = _NUMBER.fullmatch(_strip_outer_braces(_ASSIGNED.sub("", _DIGIT_GROUP.sub("", text.strip(" $")))))
    if not match:
        return None
    from decimal import Decimal

    numerator, denominator = (match[2], match[3] or "1") if match[2] else match.group(4, 5)
    number = lambda text: Fraction(Decimal(re.sub(r"\s", "", text)))
    return None if number(denominator) == 0 else (-1) ** (match[1] == "-") * number(numerator) / number(denominator)


def _false_equation(value):
    """An equation of constants whose sides differ (41 = 42, 2 + 2 = 5): it states nothing true, so it commits to
    nothing. An equation with a variable is compared as an equation."""
    sides = re.split(r"(?<![<>!])=", value)
    if len(sides) < 2 or re.search(r"[A-Za-z]", re.sub(r"\\[A-Za-z]+", "", value)):
        return False
    return any(_math_verify(side, sides[0]) is False for side in sides[1:])


_CHOICE_LABEL = re.compile(r"\([A-E]\)")
_CHOICE = re.compile(r"\(([A-Ea-e])\)\s*(?:\\[ ,;:]|~|\s)*(\S.*)", re.DOTALL)  # a choice with its value
_CHOICE_GOLD = re.compile(r"\(?(?:\\text(?:bf)?\{)?\(?([A-Ea-e])\)?\}?\)?")  # C  (C)  \text{C}  \textbf{(C)}


# a gold that is a residue with its modulus is answered by the residue (3 \pmod{7}, x \equiv 3 \ (\text{mod } 7))
_GOLD_RESIDUE = re.compile(r"""(?x)\s*\$?\s*(?:[A-Za-z](?:_\{?\w+\}?)?\s*(?:\\equiv|=)\s*)?(-?\d+)\s*
    (?:\\[pb]?mod\s*\{?\s*\d+\s*\}?|\(\s*(?:\\(?:mathrm|text|operatorname)\s*\{\s*mod\s*\}|\\?mod)\s*(?:\\\s)?\s*\d+
      \s*\))
    \s*\$?\s*""")
# a clock time is compared as a time, hours and minutes (3:45, 3{:}45, 3:45 PM, 15:45 for 3:45 PM), never as a ratio
_CLOCK = re.compile(r"(?i)\s*\$?\s*(?:\\text\s*\{\s*)?(\d{1,2})\s*:\s*([0-5]\d)\s*(?:\\?\s*([ap])\.?\s*m\.?)?\s*\}?\s*"
                    r"\$?\s*")


def _clock_match(prediction, clock):
    """Whether the prediction reads as the gold's time (a _CLOCK match): its minutes, and its hours as written or
    on the 24-hour clock."""
    time = _CLOCK.fullmatch(prediction)
    hours = int(clock[1]) % 12 + (12 if (clock[3] or "").lower() == "p" else 0) if clock[3] else int(clock[1])
    return bool(time) and int(time[2]) == int(clock[2]) and int(time[1]) in (int(clock[1]), hours)


def score_answer(prediction, gold):
    """(score 0.0 or 1.0, method) of an answer (its text, or what extract_final_answer made of it) against the gold,
    by docs/scoring.md (rules 3 and 4, then "Comparing"). A pure function; it may run for a long time on adversarial input
    (sympy), so the episode loop calls it through score_answer_isolated."""
    if prediction is None or not prediction.strip():
        return 0.0, "missing_final_answer"
    values = read_answer(prediction)
    if not values:
        return 0.0, "no_value"
    if any(_false_equation(value) for value in values):
        return 0.0, "false_equation"
    gold = _set_words(_latex_forms(gold))  # the gold's forms as the answer's are read: \mathrm{i}, infinitely many
    gold = residue[1] if (residue := _GOLD_RESIDUE.fullmatch(gold)) else gold
    gold_number, prediction = read_number(gold), ", ".join(values)
    sides = re.split(r"(?<![<>!])=", gold.strip(" $"))  # a + 3z = 0 is no number (math_verify: x + y = 0 is x + y := 0)
    one_equation = len(sides) > 1 and not re.search(r",|\b(?:or|and)\b", gold)
    if one_equation and not re.fullmatch(_NAME, sides[-2].strip()) and "=" not in prediction:
        return 0.0, "not_an_equation"
    if len(values) > 1:  # the answer when the gold is several values (rule 4), else a hedge unless a restatement
        if gold_number is None and (_math_verify(prediction, gold) or _union_of_relations(values, gold)):
            return 1.0, "math_verify"
        if not all(value == values[0] or _math_verify(value, values[0]) for value in values[1:]):
            return 0.0, "hedge"
        prediction = values[0]
    if clock := _CLOCK.fullmatch(gold):
        return float(_clock_match(prediction, clock)), "clock_time"
    if choice := _CHOICE.fullmatch(prediction.strip(" $")):  # (C) 12: the letter for a letter gold, else the value
        if letter := _CHOICE_GOLD.fullmatch(gold.strip(" $")):
            return float(choice[1].upper() == letter[1].upper()), "choice"
        prediction = choice[2]
    if gold_number is not None:
        integer_gold = gold_number.denominator == 1
        percent = read_number(prediction.strip(" $").removesuffix(r"\%")) if prediction.strip(" $").endswith(
            r"\%") else None  # 37.5\% answers 37.5 (and, by math-verify, 0.375)
        if percent is not None and percent == gold_number:
            return 1.0, "integer_match" if integer_gold else "numeric_match"
        predicted_number = read_number(prediction)
        if predicted_number is not None and integer_gold:
            return float(predicted_number == gold_number), "integer_match"
        if predicted_number is not None and numbers_agree(predicted_number, gold_number):
            return 1.0, "numeric_match"
    if (decided := _math_verify(prediction, gold)) is not None:
        return float(decided), "math_verify"
    if normalize_answer(prediction) == normalize_answer(gold):
        return 1.0, "exact_match"
    if (predicted_number := read_number(prediction)) is not None and gold_number is not None:
        return float(numbers_agree(predicted_number, gold_number)), "numeric_match"
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
# does not answer within SCORE_TIMEOUT_S is killed and the answer scored again in a fresh worker, which has just
# scored the known answers, with SCORE_RETRY_FACTOR times the limit: an answer that keeps that one busy too is the
# model's doing (0, "answer_timeout"), not the machine's. A worker that dies or garbles its reply is killed
# (0, "score_error"), and a replacement starts at once. Workers are fresh interpreters (subprocess: no fork of the
# vLLM process and its threads) running this file, `python agentic_es/scoring.py PARENT_PID`, which imports neither torch nor
# vLLM. They die with the pool thread that started them (PR_SET_PDEATHSIG; pool threads live as long as the pool), so
# with the process, even a killed one.
#
# A scorer that cannot work would score every answer 0 and the stage would go on (docs/scoring.md, "A scorer that
# fails stops the stage"): each worker scores the known answers of WARM_UP_ANSWERS before it says it is ready, and a
# stage calls warm_up() before its episodes run, which raises ScorerBroken saying what failed.

SCORE_TIMEOUT_S = 20.0            # wall-clock limit of one scoring call in a worker (normal answers take ms)
SCORE_RETRY_FACTOR = 3.0          # an answer past the limit: scored again, in a fresh worker, with this times it
SCORER_PROCESSES = 4              # at most this many workers (and scoring calls at once), started lazily
SCORER_START_TIMEOUT_S = 300.0    # a worker's start-up (imports of sympy and math_verify); not part of the limit
SCORER_MEMORY_BYTES = 4 * 1024**3  # RLIMIT_AS of a worker: a runaway sympy allocation ends in MemoryError

_SCORER_SCRIPT = str(Path(__file__).resolve())  # what a worker runs (the __main__ block at the end)

# (prediction, gold, score) that every worker must give: right answers 1, wrong ones 0, through the number reading and
# math-verify (whose grammar and sympy's lazy modules they load, seconds, before any clock runs)
WARM_UP_ANSWERS = ((r"\frac{1}{2}", "0.5", 1.0), (r"2^{10}", "1024", 1.0), ("41", "42", 0.0), ("x + 1", "y", 0.0))


class ScorerBroken(RuntimeError):
    """The scorer workers cannot start, or score known answers wrongly: every answer would score 0."""


def warm_up_problem(prediction, gold, expected, result):
    """What is wrong with a warm-up answer's (score, method), or None."""
    score, method = result
    if score == expected:
        return None
    return f"the known answer {prediction!r} against the gold {gold!r} scored {score:g} ({method}), not {expected:g}"


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
    for prediction, gold, expected in WARM_UP_ANSWERS:  # instead of "ready", what went wrong; then the worker ends
        try:
            problem = warm_up_problem(prediction, gold, expected, score_answer(prediction, gold))
        except BaseException as exc:  # a missing or broken math_verify or sympy
            problem = f"scoring {prediction!r} raised {type(exc).__name__}: {' '.join(str(exc).split())}"
        if problem:
            replies.write((json.dumps({"warm_up_failed": problem}) + "\n").encode())
            return
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

    def wait_ready(self):
        """Returns once the worker has passed its warm-up; ScorerBroken says why it did not."""
        what = f"a scorer worker ({Path(sys.executable).name} {_SCORER_SCRIPT})"
        try:
            reply = self.read_line(SCORER_START_TIMEOUT_S)
        except TimeoutError:
            raise ScorerBroken(f"{what} was not ready within {SCORER_START_TIMEOUT_S:g} s") from None
        except EOFError:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=5)
            raise ScorerBroken(f"{what} ended before it was ready (exit status {self.process.returncode})") from None
        except ValueError:
            raise ScorerBroken(f"{what} wrote something else than its ready line") from None
        if reply != "ready":
            failed = reply.get("warm_up_failed") if isinstance(reply, dict) else None
            raise ScorerBroken(f"{what} failed its warm-up: {failed}" if failed else
                               f"{what} answered {reply!r} instead of its ready line")
        self.ready = True

    def score(self, prediction, gold, timeout_s):
        if not self.ready:
            self.wait_ready()
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
        self.checked = False  # warm_up passed

    def check(self):
        """Runs in a pool thread: a worker (idle, or started) scores WARM_UP_ANSWERS through its pipes as they must
        be scored, and goes back to the pool; ScorerBroken says what failed (and the worker is killed)."""
        worker = self.take()
        try:
            for prediction, gold, expected in WARM_UP_ANSWERS:
                try:
                    result = worker.score(prediction, gold, SCORE_TIMEOUT_S)
                except TimeoutError:
                    raise ScorerBroken(f"a scorer worker gave no score for the known answer {prediction!r} within "
                                       f"{SCORE_TIMEOUT_S:g} s") from None
                except (EOFError, OSError):
                    raise ScorerBroken(f"a scorer worker ended while scoring the known answer {prediction!r}") from None
                except ScorerBroken:
                    raise
                except Exception as exc:
                    raise ScorerBroken(f"a scorer worker garbled its reply for the known answer {prediction!r} "
                                       f"({type(exc).__name__})") from None
                if problem := warm_up_problem(prediction, gold, expected, result):
                    raise ScorerBroken(f"a scorer worker gave a wrong score: {problem}")
        except BaseException:
            self.discard(worker)
            raise
        self.give_back(worker)

    def score(self, prediction, gold):
        """Runs in a pool thread. Never raises. An answer that keeps its worker past SCORE_TIMEOUT_S is scored again
        in a fresh worker (its warm-up has just scored the known answers) with SCORE_RETRY_FACTOR times the limit:
        its score, or where that one times out too (0, "answer_timeout"), the model's answer's doing. A broken
        worker scores 0 (score_error). A worker that failed is killed and its replacement starts at once (its
        start-up overlaps what comes next)."""
        worker = None
        try:
            worker = self.take()
            return self._scored(worker, worker.score(prediction, gold, SCORE_TIMEOUT_S))
        except TimeoutError:
            with contextlib.suppress(Exception):
                self.discard(worker)
            worker = None
            try:
                worker = self.take(fresh=True)
                return self._scored(worker, worker.score(prediction, gold, SCORE_RETRY_FACTOR * SCORE_TIMEOUT_S))
            except TimeoutError:
                result = 0.0, "answer_timeout"
            except Exception:  # the fresh worker did not start, died or garbled its reply
                result = 0.0, "score_error"
        except Exception:  # a worker that died or garbled its reply, a failed start: this answer only scores 0
            result = 0.0, "score_error"
        with contextlib.suppress(Exception):
            self.replace(worker)
        return result

    def _scored(self, worker, result):
        self.give_back(worker)
        return result

    def take(self, fresh=False):
        """An idle worker, or a new one (fresh: always a new one)."""
        with self.lock:
            if self.closed:
                raise RuntimeError("the scorer pool is shut down")
            while self.idle and not fresh:
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

    def discard(self, worker):
        worker.kill()
        with self.lock:
            self.busy.discard(worker)

    def replace(self, worker):
        if worker is not None:
            self.discard(worker)
        with self.lock:
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


def warm_up():
    """Checks the process's scorer pool once, before a stage's episodes run (_ScorerPool.check): ScorerBroken says
    what failed. The worker it starts stays in the pool for the episodes."""
    pool = _scorer_pool()
    if not pool.checked:
        pool.threads.submit(pool.check).result()
        pool.checked = True


async def score_answer_isolated(prediction, gold):
    """score_answer(prediction, gold) in a scorer worker, awaited without blocking the event loop. At most
    SCORE_TIMEOUT_S of scoring, and for an answer past it (1 + SCORE_RETRY_FACTOR) times that (plus a worker's
    start-up); never raises."""
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
