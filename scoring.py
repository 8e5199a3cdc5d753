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
    """(start, content, closed) of every \\boxed{ that is not inside an earlier closed box, in order. A box whose
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
            boxes.append((match.start(), text[match.end():i - 1], True))
            inside_until = i
        else:
            line_end = text.find("\n", match.end())
            boxes.append((match.start(), text[match.end():None if line_end == -1 else line_end], False))
    return boxes


# A note after the committed value, in parentheses or after a dash: "42 (checked with the tool)", "42 — verified".
# It is dropped only when it is prose that names no other candidate answer: no digit, no math, no number word and
# no "or" ("42 (or 43)" stays a hedge).
_TRAILING_NOTE = re.compile(r"\s+(?:\(([^()]*)\)|[\u2013\u2014]\s*([^\u2013\u2014]*))$")
_CANDIDATE_ANSWER = re.compile(
    r"[\d\\$^_=+*/<>{}]|\b(?:or|pi|zero|one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|\w+teen|"
    r"twenty|thirty|forty|fifty|sixty|seventy|eighty|ninety|hundred|thousand|million|billion|half|third|quarter)\b",
    re.IGNORECASE)


def _drop_trailing_note(text):
    note = _TRAILING_NOTE.search(text)
    if note and text[:note.start()].strip():
        remark = note.group(1) if note.group(1) is not None else note.group(2)
        if _PROSE.search(remark) and not _CANDIDATE_ANSWER.search(remark):
            return text[:note.start()]
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


def extract_final_answer(text):
    """The answer the reply commits to, or None. Last line that starts with `Final answer:`/`Answer:` (after optional
    markdown such as `**`, `>`, `-`; ASCII or full-width colon): the content of the boxes that open on that line
    (one cut off before its closing brace holds the rest of the line), else the rest of the line without a trailing
    prose note. Without such a line (or with an empty one), the balanced boxes on the line of the last one
    anywhere. Several different values on the committing line are a hedge (see _one_answer)."""
    text = strip_think(text)
    boxes = _boxes(text)
    markers = list(_ANSWER_MARKER.finditer(text))
    if markers:
        start = markers[-1].end()
        line_end = text.find("\n", start)
        line_end = len(text) if line_end == -1 else line_end
        on_line = [content.strip() if closed else _clean_answer_text(content)
                   for box_start, content, closed in boxes if start <= box_start < line_end]
        answer = _one_answer(on_line) if on_line else _clean_answer_text(text[start:line_end])
        if answer:
            return answer
    closed = [(box_start, content) for box_start, content, is_closed in boxes if is_closed]
    if closed:
        line_start = text.rfind("\n", 0, closed[-1][0]) + 1
        return _one_answer([content.strip() for box_start, content in closed if box_start >= line_start])
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
        # text ("42 (i.e. 43)" -> 43, 42\text{, }43 -> 42), and an answer holding several values is none of them
        pred_parsed = mv_parse(f"${prediction.strip('$')}$", extraction_config=[LatexExtractionConfig()],
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
_TRAILING_QUALIFIER = re.compile(
    r"(?:\s*\(?\s*\\?[pb]?mod(?:ulo)?\s*\{?\s*\d+\s*\}?\s*\)?"          # 12 \pmod{20}, 12 (mod 20)
    r"|\s*(?:\^\s*\{?\s*\\circ\s*\}?|°|\\degree)"                        # 5^\circ, 5°
    r"|\s*\\?%"                                                          # 25\%
    r"|(?:\s|\\[,;: ]|~)+(?!pi\b)[A-Za-z]{2,}\.?(?:\^\{?[23]\}?)?)$",    # 1000 dollars, 12 cm^2 (not "2 pi")
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
_ALTERNATIVES = re.compile(r"\b(?:or|either|alternatively)\b|\\(?:lor|vee)(?![A-Za-z])", re.IGNORECASE)
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
