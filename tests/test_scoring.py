"""Answer extraction and scoring."""

import asyncio
import os
import subprocess
import sys
import threading
import time
from fractions import Fraction
from pathlib import Path

import pytest

import common
from agentic_es import actions, scoring
from test_agent_loop import ScriptedPolicy, action, run

# (model output, gold, expected score)
CASES = [
    # plain boxed answers
    (r"Final answer: \boxed{42}", "42", 1),
    (r"Final answer: \boxed{41}", "42", 0),
    (r"Final answer: \boxed{ 42 }", "42", 1),
    (r"Final answer: \boxed{-7}", "-7", 1),
    (r"Final answer: \boxed{-7}", "7", 0),
    # nested braces, LaTeX fractions, fractions vs decimals
    (r"Final answer: \boxed{\frac{1}{2}}", r"\frac{1}{2}", 1),
    (r"Final answer: \boxed{\frac{1}{2}}", "0.5", 1),
    (r"Final answer: \boxed{0.5}", r"\frac{1}{2}", 1),
    (r"Final answer: \boxed{3/4}", "0.75", 1),
    (r"Final answer: \boxed{\dfrac{3}{4}}", "0.75", 1),
    (r"Final answer: 3/4", r"\frac{3}{4}", 1),
    (r"Final answer: \boxed{\frac{3}{4}}", r"\frac{4}{3}", 0),
    (r"Final answer: \boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt{3}}{2}", 1),
    (r"Final answer: \boxed{2.50}", "2.5", 1),
    (r"Final answer: \boxed{10^{3}}", "1000", 1),
    # thousands separators, dollar signs, trailing period, markdown
    (r"Final answer: \boxed{1,000}", "1000", 1),
    (r"Final answer: $\boxed{17}$", "17", 1),
    ("Final answer: $17$.", "17", 1),
    ("Answer: 12.", "12", 1),
    (r"**Final Answer:** \boxed{101}", "101", 1),
    (r"**Final answer**: \boxed{101}", "101", 1),
    # which answer counts: the last Final answer / Answer line, think blocks ignored
    (r"<think>Final answer: \boxed{7}</think>Final answer: \boxed{8}", "8", 1),
    (r"<think>Final answer: \boxed{7}</think>Final answer: \boxed{8}", "7", 0),
    (r"<think>so the answer is \boxed{7}</think>I checked it. Final answer: \boxed{9}", "7", 0),
    (r"Final answer: \boxed{3}" "\nOn reflection it is wrong.\nFinal answer: \\boxed{4}", "4", 1),
    (r"Final answer： \boxed{9}", "9", 1),  # full-width colon
    ("Answer：9", "9", 1),
    ("Answer: -5", "-5", 1),
    (r"Answer: \boxed{5} since 2+3 = \boxed{5}", "5", 1),
    # no marker line: the boxes on the line of the last balanced \boxed{} anywhere
    ("first \\boxed{5}\nthen \\boxed{6}", "6", 1),
    ("first \\boxed{5}\nthen \\boxed{6}", "5", 0),
    (r"so \boxed{\frac{1}{3}} and a broken \boxed{2", "1/3", 1),
    ("Final answer:\n\\boxed{11}", "11", 1),  # empty marker line: fall back to the box
    # other math objects
    (r"Final answer: \boxed{\sqrt{2}}", r"\sqrt{2}", 1),
    (r"Final answer: \boxed{x^2+1}", "x^2 + 1", 1),
    (r"Final answer: \boxed{2\pi}", r"2\pi", 1),
    (r"Final answer: \boxed{\text{B}}", "B", 1),
    # missing answers never score
    ("I think it is 42 but I am not sure.", "42", 0),
    ("", "42", 0),
    (r"Final answer: \boxed{}", "42", 0),
]


# A line that commits to several different values is a hedge and scores 0 whichever value is right, across boxes
# as inside one box; boxes that repeat one value commit to it.
HEDGES = [
    (r"Final answer: \boxed{42} or \boxed{43}", "43", 0),
    (r"Final answer: \boxed{42} or \boxed{43}", "42", 0),
    (r"Final answer: \boxed{42}, \boxed{43}", "43", 0),
    (r"Final answer: \boxed{42} (or \boxed{43})", "42", 0),
    (r"Final answer: \boxed{\frac{1}{2}} or \boxed{\frac{1}{3}}", r"\frac{1}{3}", 0),
    (r"Final answer: \boxed{x = 2} or \boxed{x = 3}", "3", 0),
    (r"Final answer: \boxed{42} or \boxed{43", "42", 0),  # the second box cut off: still a second value
    (r"first \boxed{42} then \boxed{43}", "43", 0),  # no marker: the boxes on the last box's line
    (r"so it is \boxed{5} or maybe \boxed{6}.", "6", 0),
    (r"Final answer: \boxed{42 or 43}", "43", 0),  # inside one box, as before
    (r"Final answer: \boxed{42, 43}", "42", 0),
    ("Final answer: 42 or 43", "43", 0),
    # however it is written: math_verify must not pick one value out of several
    ("Final answer: 42 (or 43)", "43", 0),
    (r"Final answer: 42 \text{(or } 43\text{)}", "42", 0),
    (r"Final answer: \boxed{42 \lor 43}", "43", 0),
    ("Final answer: 42 (i.e. 43)", "43", 0),
    ("Final answer: 42 (43?)", "42", 0),
    (r"Final answer: 42\text{, }43", "42", 0),
    (r"Final answer: 42 \\ 43", "42", 0),
    ("Final answer: 42; 43", "43", 0),
    # alternatives are the answer when the gold is a set of values
    ("Final answer: 1 or 2", "1, 2", 1),
    ("Final answer: x = 1 or x = 2", "x = 1 or x = 2", 1),
    (r"Final answer: \boxed{1} and \boxed{2}", "1, 2", 1),
    # the first value after the marker is committed (rule 1), and a note never supplies it (rule 2)
    ("Final answer: We found 3 cases; thus the answer is 42", "42", 0),
    ("Final answer: We found 3 cases; thus the answer is 42", "3", 1),
    # one value in several boxes is one answer
    (r"Final answer: \boxed{42} and again \boxed{42}", "42", 1),
    (r"Final answer: \boxed{42} (that is, \boxed{42.0})", "42", 1),
    (r"Final answer: \boxed{\frac{1}{2}} = \boxed{0.5}", "0.5", 1),
    (r"Final answer: \boxed{\boxed{42}}", "42", 1),  # a box inside a box is its value, not a second one
    (r"so \boxed{x = \boxed{5}}", "5", 1),
    ("earlier \\boxed{41}\nso it is \\boxed{42}", "42", 1),  # earlier lines are work, not the commitment
]

# What a careful grader accepts: a short prose note after the value, e-notation; never a hedge, nor a box cut off by
# the token limit (more digits may have followed: issue 67).
ACCEPTED_FORMS = [
    ("Final answer: 42 (checked with the tool)", "42", 1),
    ("Final answer: 42 (checked with the tool).", "42", 1),
    ("Final answer: **42** (verified by running the script)", "42", 1),
    ("Final answer: $42$ (checked)", "42", 1),
    ("Final answer: 42 \u2014 verified with Python", "42", 1),
    (r"Final answer: \frac{1}{2} (simplified)", r"\frac{1}{2}", 1),
    ("Final answer: 41 (checked with the tool)", "42", 0),
    ("Final answer: 42 (or 43)", "42", 0),
    ("Final answer: 42 (or 43)", "43", 0),
    ("Final answer: 42 (or maybe forty-three)", "42", 0),
    ("Final answer: 42 (checked with 3 runs)", "42", 1),  # the numbers of a note offer no value (rule 2)
    ("Final answer: 42 (not 43)", "42", 1),  # nor does a value it negates
    ("Final answer: f(x)", "f(x)", 1),  # brackets that belong to the answer stay
    ("Final answer: 1.5e3", "1500", 1),
    ("Final answer: 1.5E+03", "1500", 1),
    ("Final answer: 2e-3", "0.002", 1),
    ("Final answer: 2e-3", r"\frac{1}{500}", 1),
    ("Final answer: 2e-3", "0.003", 0),
    ("Final answer: 1.5e3", "1501", 0),
    ("Final answer: 1e99", "1", 0),
    (r"Final answer: \boxed{42", "42", 0),
    (r"Final answer: \boxed{\frac{1}{3}", r"\frac{1}{3}", 0),
    (r"Final answer: \boxed{43", "42", 0),
    (r"Final answer: \boxed{42 or 43", "42", 0),
    (r"so \boxed{7} and a broken \boxed{8", "8", 0),  # without a marker only a closed box commits
]

# A note after the committed value, in any common form (docs/scoring.md, rule 2); a second value listed beside it or
# offered as an alternative after it (a number, a number word, math after "or", "maybe", "unless") is a hedge or,
# for a gold of several values, the answer (rules 3 and 4).
NOTE_FORMS = [
    ("Final answer: 42 - verified with bash", "42", 1),  # hyphen
    ("Final answer: 42 -- verified with bash", "42", 1),
    ("Final answer: 42 \u2013 checked by brute force", "42", 1),  # en dash
    ("Final answer: 42\u2014verified", "42", 1),  # em dash without spaces
    ("Final answer: 42 [computed by the tool]", "42", 1),  # brackets
    ("Final answer: 42, as the script printed", "42", 1),  # comma + words
    ("Final answer: 42 which matches the script's output", "42", 1),  # bare words
    ("Final answer: 42 since the loop counts every case once", "42", 1),
    ("Final answer: 42 because the simulation agrees", "42", 1),
    ("Final answer: 42 as computed by the script", "42", 1),
    ("Final answer: 42 verified with bash", "42", 1),
    ("Final answer: 42: confirmed by brute force", "42", 1),  # colon
    ("Final answer: 42; the script agrees", "42", 1),  # semicolon
    ("Final answer: 42. Verified with bash.", "42", 1),  # a sentence after it
    ("Final answer: 42 (checked), as the script printed", "42", 1),  # two notes
    ("Final answer: 42 - the same one the script printed", "42", 1),  # "one" as a pronoun, not a value
    ("Final answer: -3, because the root is negative", "-3", 1),
    ("Final answer: 17\uff08\u5df2\u9a8c\u8bc1\uff09", "17", 1),  # full-width brackets, no space
    ("Final answer: 41 - verified with bash", "42", 0),  # the value still decides
    ("Final answer: 42, as the script printed", "43", 0),
    # other values: fractions, negatives, decimals, LaTeX expressions, tuples, intervals, sets, equations, \text{}
    (r"Final answer: \frac{3}{4}, as the script printed", r"\frac{3}{4}", 1),
    (r"Final answer: \frac{3}{4} -- exact, not rounded", "0.75", 1),
    ("Final answer: -17 - confirmed by brute force", "-17", 1),
    ("Final answer: -17, since the sum is negative", "17", 0),
    ("Final answer: 3.25 since the series telescopes", "13/4", 1),
    (r"Final answer: 2\sqrt{3} because the triangle is equilateral", r"2\sqrt{3}", 1),
    (r"Final answer: 2\sqrt{3} because the triangle is equilateral", r"3\sqrt{2}", 0),
    ("Final answer: (3, 4) - the only lattice point", "(3, 4)", 1),
    ("Final answer: (1, 2], since the left endpoint is excluded", "(1, 2]", 1),
    (r"Final answer: \{1, 2\}, as listed by the script", r"\{1, 2\}", 1),
    ("Final answer: x = 5, as expected", "5", 1),
    (r"Final answer: \text{Yes}, since the sum is even", "Yes", 1),
    ("Final answer: Yes, because the sum is even", "Yes", 1),
    ("Final answer: 1000 dollars, as the script printed", "1000", 1),
    ("Final answer: 2 and 3, as the script found", "2, 3", 1),  # a set answer keeps its "and"
    (r"Final answer: \begin{pmatrix} 1 \\ 2 \end{pmatrix}, as computed", r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", 1),
    # boxes, Answer: lines, full-width punctuation, markdown
    (r"Final answer: \boxed{\frac{1}{2}} - verified numerically", r"\frac{1}{2}", 1),
    (r"so the answer is \boxed{7}, which the tool confirmed", "7", 1),
    ("Answer: 42 - verified with bash", "42", 1),
    ("Final answer\uff1a 42\uff0cas the script printed", "42", 1),
    ("Answer\uff1a256\uff0c\u5df2\u9a8c\u8bc1", "256", 1),
    ("**Final answer:** $42$ - checked with bash", "42", 1),
    # a second value after the first is a hedge, however it is joined
    ("Final answer: 42, maybe 43", "42", 0),
    ("Final answer: 42, maybe 43", "43", 0),
    ("Final answer: 42 and 43", "42", 0),
    ("Final answer: 42 / 43", "42", 0),
    ("Final answer: 42 - or 43", "43", 0),
    ("Final answer: 42 [or 43]", "42", 0),
    ("Final answer: 42, or maybe later", "42", 1),  # an alternative word that offers no value is a note (rule 3)
    ("Final answer: 42, maybe forty-three", "42", 0),
    ("Final answer: 17 but could also be eighteen", "17", 0),  # nor do number words go as units
    ("Final answer: $42$, maybe 43", "42", 0),  # nor does math_verify read the first $...$ span alone
    ("Final answer: $42$; $43$", "43", 0),
    (r"Final answer: $\text{red}$, green", "red", 0),
    # beside a box too: a value outside it with a word that offers it as an alternative
    (r"Final answer: \boxed{42} or 43", "42", 0),
    (r"Final answer: \boxed{42}, maybe 43", "42", 0),
    (r"Final answer: \boxed{\frac{3}{4}} - perhaps \frac{2}{3}", r"\frac{3}{4}", 0),
    (r"Final answer: 42 or \boxed{43}", "43", 0),
    (r"so it is \boxed{42}, though forty-three is possible", "42", 0),
    (r"Final answer: \boxed{42} (since 6 \times 7 = 42)", "42", 1),  # a derivation offers no other value
    (r"Final answer: \boxed{42} - verified either way", "42", 1),  # nor does a note
    (r"As it might be tricky, we computed 6 \times 7 = \boxed{42}", "42", 1),  # nor the work before it, unmarked
    ("Final answer: 42 - maybe pi", "42", 0),
    ("Final answer: 42, unless the grid wraps around", "42", 1),  # a condition without a value: a note (rule 3)
    ("Final answer: 42, unless the grid wraps around to 0", "42", 1),  # the value is too far from the word
    ("Final answer: 42, unless n = 0", "42", 0),  # a condition on a value is a hedge
    (r"Final answer: \frac{3}{4}, maybe \frac{2}{3}", r"\frac{3}{4}", 0),
    (r"Final answer: -0.5 - or perhaps -\frac{1}{3}", "-0.5", 0),
    ("Final answer: 42 checked with 3 runs", "42", 1),  # a note's numbers offer no value (rule 2)
    ("Final answer: red, green", "red", 0),  # a list of words is not a value and a note
    # math that ends in letters is neither a note nor a unit
    ("Final answer: x^2 - xy", "x^2", 0),
    ("Final answer: 2 sin theta", "2", 0),
    ("Final answer: 5 factorial", "5", 0),
]

# A finite decimal never equals a gold without a finite decimal expansion (0.333333 is a truncation of 1/3, not its
# value), whichever comparison decides; decimals that are the value are equal.
TRUNCATED_DECIMALS = [
    ("Final answer: 0.333333", "1/3", 0),
    ("Final answer: 0.333333", r"\frac{1}{3}", 0),
    ("Final answer: 0.3333333333", r"\frac{1}{3}", 0),
    ("Final answer: 0.33333333333333333333", r"\frac{1}{3}", 0),
    ("Final answer: 0.333333", r"\dfrac13", 0),
    ("Final answer: 0.142857", r"\frac{1}{7}", 0),
    ("Final answer: -0.666667", r"-\frac{2}{3}", 0),
    ("Final answer: x = 0.333333", r"\frac{1}{3}", 0),
    (r"Final answer: \boxed{(0.333333, 2)}", r"(\frac{1}{3}, 2)", 0),
    ("Final answer: 0.5", r"\frac{1}{2}", 1),
    ("Final answer: 0.25", r"\frac{1}{4}", 1),
    ("Final answer: 0.125", "1/8", 1),
    ("Final answer: -0.75", r"-\frac{3}{4}", 1),
    (r"Final answer: \boxed{(0.5, 2)}", r"(\frac{1}{2}, 2)", 1),
    (r"Final answer: \frac{1}{3}", "1/3", 1),
    (r"Final answer: \frac{2}{6}", r"\frac{1}{3}", 1),
    ("Final answer: 1.7320508", r"\sqrt{3}", 0),  # irrational golds alike
    ("Final answer: the probability is 0.5", r"\frac{1}{2}", 1),
]

# ---- docs/scoring.md, rule by rule: each rule's examples there, and forms of this file's own

# The rows of issue 50's table, scored as a careful grader scores them.
ISSUE_TABLE = [
    (r"Thus \boxed{42} is the largest possible value of $n^2+1$.", "42", 1),
    (r"Final answer: \boxed{42} (the only possible value, since n \le 6)", "42", 1),
    (r"Final answer: \boxed{0.5}, or equivalently \frac{1}{2}", "1/2", 1),
    ("Final answer: not 42", "42", 0),
    ("Final answer: negative 42", "42", 0),
    ("Final answer: minus 42", "42", 0),
    ("Final answer: 41 because 6 x 7 = 42", "42", 0),
    ("Final answer: 42 thousandths", "42", 0),
    ("Final answer: 42, which is 6*7", "42", 1),
    ("Final answer: $0$", "a + 3z = 0", 0),
    ("Final answer:\n\\[ 9 \\]", "9", 1),
]

POLICY = {
    "docs/scoring.md's own examples": [
        ("Final answer:\nIt is\n42", "42", 0),
        (r"Final answer: 2\sqrt{3}", r"\sqrt{12}", 1), (r"Final answer: 2 \pi", r"2\pi", 1),
        ("Final answer: 2x + 1", "1 + 2x", 1), ("Final answer: f(x) = x^2 + 1", "x^2 + 1", 1),
        (r"Final answer: \{1, 2\}", "1, 2", 1), ("Final answer: 5!", "120", 1), (r"Final answer: 28\%", "28", 1),
        ("Final answer: x = 5", "5", 1), ("Final answer: f(3) = 5", "5", 1), ("Final answer: a_1 = 5", "5", 1),
        ("Final answer: x is 5", "5", 1), ("Final answer: positive 12", "12", 1), ("Final answer: never 42", "42", 0),
        ("Final answer: not 42 but 43", "43", 1), ("Final answer: 5 twelfths", "5/12", 1),
        ("Final answer: three quarters", "0.75", 1), ("Final answer: a half", "0.5", 1),
        ("Final answer: 3 million", "3000000", 1), ("Final answer: 2 dozen", "24", 1),
        ("Final answer: 12 percent", "12", 1), ("Final answer: forty-two", "42", 1),
        ("Final answer: one hundred twenty", "120", 1), ("Final answer: x squared", "x^2", 1),
        ("Final answer: infinity", r"\infty", 1),
        ("Final answer: 42 cm", "42", 1), ("Final answer: 42cm", "42", 1), (r"Final answer: 42 \text{ cm}^2", "42", 1),
        ("Final answer: 42 m²", "42", 1), ("Final answer: 42 cm³", "42", 1), ("Final answer: 42°C", "42", 1),
        ("Final answer: 135°", "135", 1), (r"Final answer: 90^\circ", "90", 1), (r"Final answer: \$42", "42", 1),
        ("Final answer: 1,000", "1000", 1), (r"Final answer: 1{,}000", "1000", 1), (r"Final answer: 1\,000", "1000", 1),
        ("Final answer: 1 000", "1000", 1), ("Final answer: 1,2", "12", 0),
        (r"Final answer: \boxed{\text{Evelyn}}", "Evelyn", 1), ("Final answer: 42 because 6 x 7 = 42", "42", 1),
        ("Final answer: 42 — verified", "42", 1), ("Final answer: 42 43", "42", 0),
        ("Final answer: between 42 and 43", "42", 0), ("Final answer: 42, unless n = 3", "42", 0),
        ("Final answer: 42 if n is odd", "42", 0), (r"Final answer: \frac12 (or 0.5)", "1/2", 1),
        ("Final answer: 42 (forty-two)", "42", 1), (r"Final answer: \frac13 (or 0.333333)", "1/3", 0),
        ("Final answer: 42 (alternatively, 43)", "42", 0), ("Final answer: 128 (127 if n is odd)", "128", 0),
        (r"Final answer: \boxed{42}, the largest value, attained when n = 6", "42", 1),
        ("Final answer: 2, 3", "2, 3", 1), ("Final answer: 3, 2", "2, 3", 1),
        ("Final answer: 2, 3", "x = 2 or x = 3", 1),
        ("Final answer: 42 (= 6 \\times 7)", "42", 1), ("Final answer: 42 (43 was a typo)", "42", 1),
        ("Final answer: the two roots are 4 and 9", "4, 9", 1), ("Final answer: 2x", "2x", 1),
        ("Final answer: (12,102)", "(12, 102)", 1), ("Final answer: x = 5", "x = 5", 1),
        ("Final answer:\n\\begin{equation}\n42\n\\end{equation}", "42", 1),
        ("Final answer: x = 2 or x = 3", "2, 3", 1), (r"Final answer: \boxed{2} and \boxed{3}", "2, 3", 1),
        (r"Final answer: \boxed{2, 3}", "2, 3", 1), (r"Final answer: \{-1, 1\}", r"\pm 1", 1),
        ("Final answer: (1, 2]", "(1, 2]", 1), (r"Final answer: x \in (1, 2]", "(1, 2]", 1),
        ("Final answer: [1, 2)", "(1, 2]", 0), ("Final answer: 3z = -a", "a + 3z = 0", 1),
        ("Final answer: 0", "x + y = 0", 0), ("Final answer: 5", "x = 5", 1), ("Final answer: 2x + 1", "y = 2x + 1", 1),
        ("Final answer: 3 < x", "x > 3", 1), ("Final answer: 3", "x > 3", 0), ("Final answer: 42.0", "42", 1),
        ("Final answer: 1.5e3", "1500", 1), (r"Final answer: 15\%", "15", 1), ("Final answer: 0.5", "1/2", 1),
        (r"Final answer: 2^{10}", "1024", 1), (r"Final answer: \frac{\sqrt{2}}{2}", r"\frac{1}{\sqrt{2}}", 1),
        (r"Final answer: 50\%", "1/2", 1),
    ],
    "where the answer is": [
        ("We tried 5 first.\n## Final Answer: 128 (by enumeration)", "128", 1),
        ("Final answer: 7\nOn second thought the count double-counts.\nAnswer: 6", "6", 1),
        ("Final answer: 7\nOn second thought the count double-counts.\nAnswer: 6", "7", 0),
        (r"<think>Answer: \boxed{6}</think>Final answer: \boxed{8}", "6", 0),
        ("it prints 9, so the answer: 9 holds", "9", 0),  # a marker mid-line is none
        (r"Final answer: \boxed{\begin{pmatrix} 2 \\" "\n" r"5 \end{pmatrix}} (a column)",
         r"\begin{pmatrix} 2 \\ 5 \end{pmatrix}", 1),  # a box opened on the marker line, closed below
        ("so the count is $\\boxed{56}$ in all", "56", 1),  # no marker: the last box's line, inside $...$ too
        ("first guess \\boxed{55}\nthen \\boxed{56} after the fix", "56", 1),
        ("then \\boxed{56} and \\boxed{5", "56", 1),  # without a marker a box left open is cut off
    ],
    "rule 5: display math below an empty marker line": [
        ("**Final answer:**\n\n\\[\n\\frac{5}{8}\n\\]", "0.625", 1),
        ("Final answer:\n$$ 2^{5} $$ (from the table)", "32", 1),
        ("Final answer:\n  \\(  3\\sqrt{2} \\)", r"\sqrt{18}", 1),
        ("Final answer:\n$x = 14$", "14", 1),
        ("Final answer:\nthe count is\n14", "14", 0),  # spread over lines: not guessed at
        ("Final answer:\n\nWe double-check below.\n$14$", "14", 0),
        ("Final answer:\n\\[ 13 \\]\nor perhaps \\[ 14 \\]", "13", 0),  # a later alternative is a hedge (rule 6)
        ("Final answer:\n\\begin{equation*}\n  \\frac{9}{2}\n\\end{equation*}", "4.5", 1),
    ],
    "rule 1: the first box, else the first complete expression": [
        ("Final answer: the expected number of rolls is 7/2", "3.5", 1),
        ("Final answer: it takes 18 moves; 20 was my first estimate", "18", 1),
        ("Final answer: it takes 18 moves; 20 was my first estimate", "20", 0),
        (r"Final answer: after 3 rounds the total is \boxed{81}", "81", 1),  # a box before the first expression
        (r"Final answer: $\frac{2\sqrt{6}}{3}$ units", r"\frac{2\sqrt{6}}{3}", 1),
        ("Final answer: 3x^2 + 2x - 1", "3x^2+2x-1", 1),
        ("Final answer: (2, -3)", "(2, -3)", 1),
        ("Final answer: 7!", "5040", 1),
        ("Final answer: 30%", "30", 1),
        ("Final answer: 30%", "0.3", 1),
        ("Final answer: 0.3%", "0.3", 1),  # a percentage answers its number (rule 5)
        ("Final answer: 0.3%", "0.003", 1),
        ("Final answer: 0.3%", "0.03", 0),
    ],
    "rule 1: a leading name is dropped": [
        ("Final answer: N = 2024", "2024", 1),
        ("Final answer: g(10) = 91", "91", 1),
        ("Final answer: b_{12} = 5", "5", 1),
        ("Final answer: the value of $k$ is 12", "12", 1),
        ("Final answer: k equals 12", "12", 1),
        ("Final answer: y = 4", "5", 0),
    ],
    "rule 1: an equation of constants is true or commits to nothing": [
        ("Final answer: 41 = 42", "42", 0), ("Final answer: 41 = 42", "41", 0),
        (r"Final answer: 2 + 2 = 5", "5", 0), (r"Final answer: \frac{1}{2} = 0.6", "0.6", 0),
        (r"Final answer: 3 \times 4 = 12", "12", 1), (r"Final answer: \boxed{7 = 7}", "7", 1),
        (r"Final answer: 2^{3} = 8 = 9", "9", 0), (r"Final answer: \sqrt{16} = 4", "4", 1),
    ],
    "rule 1: sign words and negations": [
        ("Final answer: negative nineteen", "-19", 1),
        ("Final answer: minus 2.5", "-5/2", 1),
        ("Final answer: minus 2.5", "2.5", 0),
        ("Final answer: negative \\frac{1}{4}", "-0.25", 1),
        ("Final answer: positive 8", "8", 1),
        ("Final answer: 100 minus 1", "99", 1),
        ("Final answer: definitely not 19", "19", 0),
        ("Final answer: it is never 19", "19", 0),
        ("Final answer: not 19 but 21", "21", 1),
        ("Final answer: not 19 but 21", "19", 0),
    ],
    "rule 1: words that change a number's value": [
        ("Final answer: 9 hundredths", "0.09", 1),
        ("Final answer: 9 hundredths", "9", 0),
        ("Final answer: 7 eighths", "0.875", 1),
        ("Final answer: 11 twentieths", "0.55", 1),
        ("Final answer: two fifths", "2/5", 1),
        ("Final answer: three halves", "1.5", 1),
        ("Final answer: a quarter", "1/4", 1),
        ("Final answer: 6 millionths", "0.000006", 1),
        ("Final answer: 2.5 thousand", "2500", 1),
        ("Final answer: 7 million", "7000000", 1),
        ("Final answer: 7 million", "7", 0),
        ("Final answer: 3 dozen", "36", 1),
        ("Final answer: sixty-four", "64", 1),
        ("Final answer: two hundred fifty-six", "256", 1),
        ("Final answer: 45 percent", "45", 1),
        ("Final answer: 45 percent", "0.45", 1),
        ("Final answer: 4 pi", r"4\pi", 1),
        ("Final answer: 6 factorial", "720", 1),
        ("Final answer: the two roots are 4 and 9", "4, 9", 1),  # a number word after "the" is a word
    ],
    "rule 1: units are dropped": [
        ("Final answer: 64 km", "64", 1),
        ("Final answer: 64km/h", "64", 1),
        ("Final answer: 64 ft²", "64", 1),
        ("Final answer: 64 m³", "64", 1),
        ("Final answer: 64 g", "64", 1),
        (r"Final answer: 64\ \text{cm}^{2}", "64", 1),
        (r"Final answer: $64\,\mathrm{mL}$", "64", 1),
        ("Final answer: 64°", "64", 1),
        ("Final answer: 64 °F", "64", 1),
        ("Final answer: \\$64", "64", 1),
        ("Final answer: 64 square meters", "64", 1),
        ("Final answer: 63 km", "64", 0),
    ],
    "rule 1: digit groups, answers without math": [
        ("Final answer: 2,048", "2048", 1),
        (r"Final answer: 2{,}048", "2048", 1),
        ("Final answer: 2 048 ways", "2048", 1),
        ("Final answer: 2,48", "248", 0),  # not a digit group: two values
        ("Final answer: Bob, since he moves last", "Bob", 1),
        ("Final answer: Bob and Alice", "Bob", 0),
        (r"Final answer: \boxed{\text{No}}", "No", 1),
    ],
    "rule 2: everything after the committed value is a note": [
        ("Final answer: 64 (the script printed 64 and 65 for n = 3)", "64", 1),
        ("Final answer: 65 (the script printed 64 for n = 3)", "64", 0),
        ("Final answer: 64 = 2^6, i.e. the sixth power of two", "64", 1),
        ("Final answer: 64 -- double-checked with n = 1..10", "64", 1),
        ("Final answer: 64; brute force over 10^6 cases agrees", "64", 1),
        ("Final answer: 64. Note: 65 is what the naive count gives.", "64", 1),
        ("Final answer: *64* (✓ verified)", "64", 1),
        (r"Final answer: \boxed{64}, the least value of $f$ on [0, 10]", "64", 1),
        ("Final answer: 64 since 63 + 1 = 64", "64", 1),
        ("Final answer: 64 — not 65", "64", 1),
        ("Final answer: 64 because 6 x 7 = 42", "42", 0),
        ("Final answer: 64 (= 8^2)", "64", 1),  # a bracket opening with a relation restates in a note
        ("Final answer: 64 (≈ 64.0)", "64", 1),
        ("Final answer: 63 (= 8^2)", "64", 0),
    ],
    "rule 3: a different value offered is a hedge": [
        ("Final answer: 64 or 65", "64", 0),
        ("Final answer: 64 65", "65", 0),
        ("Final answer: 64; 65", "64", 0),
        ("Final answer: 64 and 65", "65", 0),
        ("Final answer: 64 (65)", "64", 0),
        ("Final answer: either 64 or 65", "64", 0),
        (r"Final answer: 64 \text{ or } 65", "64", 0),
        (r"Final answer: \boxed{64} \quad \boxed{65}", "64", 0),
        (r"Final answer: 63 or \boxed{64}", "64", 0),
        ("Final answer: 64, possibly 65", "64", 0),
        ("Final answer: 64 (otherwise 65)", "64", 0),
        ("Final answer: 64, though 65 is also plausible", "64", 0),
        ("Final answer: 64 but it could well be 65", "64", 0),
        ("Final answer: 64 if the grid has 8 rows", "64", 0),
        ("Final answer: 64, or sixty-five", "64", 0),
        ("Final answer: 64 (i.e. 65)", "64", 0),
        ("Final answer: 64 vs 65", "64", 0),
        ("Final answer: 64 (alternatively, 65)", "64", 0),
        ("Final answer: 64 (65 when n is odd)", "64", 0),
        ("Final answer: 64, unless n = 8", "64", 0),
    ],
    "rule 3: a restatement or a descriptive word is no hedge": [
        ("Final answer: 64 or 2^6", "64", 1),
        ("Final answer: 64 (sixty-four)", "64", 1),
        (r"Final answer: \frac{3}{4}, i.e. 0.75", "0.75", 1),
        (r"Final answer: 0.75 (or \frac{3}{4})", r"\frac34", 1),
        (r"Final answer: \boxed{64}; again, \boxed{64.0}", "64", 1),
        (r"Final answer: \frac{1}{7} (or 0.142857)", r"\frac{1}{7}", 0),  # a truncation is another value
        ("Final answer: the maximum possible value is 64", "64", 1),
        ("Final answer: 64, the smallest possible sum", "64", 1),
        ("Final answer: 64, or maybe more if we allow ties", "64", 1),  # an alternative word without a value
        (r"Final answer: 64 (could be checked faster with a sieve)", "64", 1),
        (r"Final answer: \boxed{64}, the largest value, attained when n = 8", "64", 1),  # a condition deep in a note
        ("Final answer: 64 (65 was a typo)", "64", 1),
        ("Final answer: 64 (8 squares per row)", "64", 1),
    ],
    "docs/scoring.md's examples of math regions, answer lines, witnesses and corrections": [
        (r"Final answer: \boxed{4 k + 1}", "4", 0), (r"Final answer: \boxed{2 n}", "2", 0),
        (r"Final answer: \boxed{2\,x}", "2", 0), (r"Final answer: \boxed{2 a + b}", "2", 0), ("Final answer: $2 x$", "2", 0),
        (r"Final answer: \boxed{x y}", "y", 0), (r"Final answer: \boxed{|-3|}", "-3", 0),
        (r"Final answer: \boxed{|-3|}", "3", 1), (r"Final answer: \boxed{-|3|}", "3", 0),
        (r"Final answer: \boxed{\cos^2 x}", r"\cos^2 x", 1), (r"Final answer: \boxed{\sum_{k=1}^{3} k}", "6", 1),
        (r"Final answer: \boxed{\log_2 8}", "3", 1), (r"Final answer: \boxed{\log_{10} 1000}", "3", 1),
        (r"Final answer: \boxed{\log_3 81}", "4", 1), (r"Final answer: \boxed{\tan^{-1} 1}", r"\frac{\pi}{4}", 1),
        (r"Final answer: \boxed{\ln^2 2}", r"(\ln 2)^2", 1), (r"Final answer: \boxed{\mathrm{lcm}(4,6)}", "12", 1),
        (r"Final answer: \boxed{\log_2 8 = 3}", "3", 1), (r"Final answer: \boxed{2\log_2 3}", r"2\log_2 3", 1),
        (r"Final answer: \boxed{\sin 30^\circ}", r"\frac{1}{2}", 1), (r"Final answer: \boxed{1,000}", "1000", 1),
        (r"Final answer: \boxed{42 \text{ cm}}", "42", 1), (r"Final answer: \boxed{5 \text{ cm}^2}", "5", 1),
        (r"Final answer: $x \in \boxed{(2, 12)}$", "(2, 12)", 1),
        (r"Final answer: the angle is $\boxed{90^\circ}.$", "90", 1), (r"Final answer: \boxed{m + n = 12}", "12", 1),
        ("Answer:\n42", "42", 1), ("Final answer: (verified with bash)\n\\boxed{42}", "42", 1),
        ("Final answer: 42\nThe script printed 42 in 0.3 s.", "42", 1),
        (r"Final answer: \boxed{12} (x = 3)", "12", 1), (r"Final answer: \boxed{12} (m=5, n=7)", "12", 1),
        (r"Final answer: \boxed{12} when n = 3", "12", 1), ("Final answer: 42 if n = 3", "42", 0),
        (r"Final answer: \boxed{41} -- no, corrected: \boxed{42}", "42", 1),
        (r"My earlier value \boxed{24} is wrong; the correct answer is \boxed{42}.", "42", 1),
        ("Final answer: \\boxed{42}\nWait, actually it's 43. Final answer: \\boxed{43}", "42", 0),
        ("Final answer: \\boxed{42}\nWait, actually it's 43. Final answer: \\boxed{43}", "43", 1),
        ("Final answer: \\boxed{42}\nHowever, it might also be \\boxed{43}.", "42", 0),
        ("Final answer: \\boxed{42}\nHowever, it might also be \\boxed{43}.", "43", 0),
        ("Final answer: 43 is not correct; 42", "42", 1), ("Final answer: my initial value 24, then 42", "42", 1),
        ("\\boxed{9}\n\n(Earlier I got \\boxed{8}, but that missed a case.)", "9", 1),
        (r"Final answer: \boxed{15}, but 16 is also possible", "15", 0),
        ("Final answer: 20, though 21 is equally plausible", "20", 0),
        ("Therefore the answer is 56.", "56", 1), (r"Final answer: \boxed{0.\overline{3}}", r"\frac{1}{3}", 1),
        (r"Final answer: \boxed{1.2\overline{45}}", "137/110", 1), (r"Final answer: \boxed{0.333}", r"\frac{1}{3}", 0),
        (r"Final answer: \boxed{x \le 1 \text{ or } x \ge 3}", r"(-\infty, 1] \cup [3, \infty)", 1),
        ("Final answer: x < 0 or x > 2", r"(-\infty, 0]", 0),
        (r"Final answer: \boxed{\textbf{(C)}\ 12}", "C", 1), (r"Final answer: \boxed{37.5\%}", "37.5", 1),
        (r"Final answer: \boxed{37.5\%}", "0.375", 1), (r"Final answer: \boxed{x > 2}", r"(2, \infty)", 1),
        (r"Final answer: \boxed{\boldsymbol{12}}", "12", 1), (r"Final answer: \boxed{\underline{12}}", "12", 1),
    ],
    "rule 1: a math region is one expression, read whole": [
        (r"Final answer: \boxed{3 m + 2}", "3", 0), (r"Final answer: \boxed{3 m + 2}", "3m+2", 1),
        ("Final answer: $5 t$", "5", 0), (r"Final answer: \boxed{7 h}", "7", 0), (r"Final answer: \boxed{a b}", "b", 0),
        (r"Final answer: \boxed{\sqrt{2} x}", r"\sqrt{2}", 0), (r"Final answer: $\sqrt{3}\,y$", r"\sqrt{3}", 0),
        (r"Final answer: \boxed{\sin^2 \theta}", r"\sin^2\theta", 1),
        (r"Final answer: \boxed{\prod_{k=1}^{3} k}", "6", 1),
        (r"Final answer: \boxed{|-7|}", "7", 1), (r"Final answer: \boxed{|-7|}", "-7", 0),
        (r"Final answer: \boxed{-|5|}", "5", 0), (r"Final answer: \boxed{-|5|}", "-5", 1),
        (r"Final answer: \boxed{\log_5 125}", "3", 1), (r"Final answer: \boxed{\log_{2} 32}", "5", 1),
        (r"Final answer: \boxed{\cos^{-1} 0}", r"\frac{\pi}{2}", 1),
        (r"Final answer: \boxed{\mathrm{gcd}(12, 18)}", "6", 1), (r"Final answer: \boxed{\text{lcm}(6, 8)}", "24", 1),
        (r"Final answer: \boxed{\log_3 9 = 2}", "2", 1), (r"Final answer: \boxed{3\log_2 5}", r"3\log_2 5", 1),
        (r"Final answer: \boxed{\cos 60^\circ}", r"\frac12", 1), (r"Final answer: \boxed{\tan(45^{\circ})}", "1", 1),
        (r"Final answer: \boxed{7\,\mathrm{kg}}", "7", 1), (r"Final answer: \boxed{60^\circ}", "60", 1),
        (r"So the area is $\boxed{20\text{ cm}^2}$.", "20", 1), (r"Thus $m+n = \boxed{47}$.", "47", 1),
        (r"Final answer: $\boxed{2}$ (the other root, $x = -3$, is extraneous)", "2", 1),
        (r"Final answer: \boxed{12 \quad 13}", "12", 0), (r"Final answer: \boxed{12 \text{ or } 13}", "13", 0),
        ("Final answer: $28$ %", "28", 1), ("Final answer: The largest $n$ is 34.", "34", 1),
    ],
    "answer lines: DAPO's Answer: with the value below it, a marker line without math": [
        ("Answer:\n17", "17", 1), ("**Answer:**\n\n$\\frac{3}{4}$", "3/4", 1), ("Answer:\n\nThe answer is 9", "9", 1),
        ("Answer:\n\n**23**\n", "23", 1), ("Answer:\n-4", "4", 0),
        ("**Final answer:** (see the computation above)\n\n$$\\boxed{9}$$", "9", 1),
        ("Answer: see below\n\\boxed{9}", "9", 1), ("Final answer: (checked twice)\nThe total is \\boxed{11}.", "11", 1),
        ("Final answer: Yes", "Yes", 1),
    ],
    "corrections: a withdrawn value is not offered, a later answer supersedes, a later alternative hedges": [
        ("Final answer: \\boxed{17}\nOops, I mis-added: the correct answer is \\boxed{18}.", "18", 1),
        ("Final answer: \\boxed{17}\nOops, I mis-added: the correct answer is \\boxed{18}.", "17", 0),
        (r"\boxed{5}, sorry, make that \boxed{6}", "6", 1), (r"\boxed{30} was a typo; \boxed{31}", "31", 1),
        ("Final answer: \\boxed{8}\nCorrection: \\boxed{9}", "9", 1),
        ("Final answer: 41\nActually it is 42.", "42", 1), ("Final answer: 41\nActually it is 42.", "41", 0),
        ("Final answer: \\boxed{8}\n\nThe answer is \\boxed{8}.", "8", 1),  # a restatement
        ("Final answer: \\boxed{8}\nThe script printed 8 in 0.3 s.", "8", 1),  # later numbers in prose are no answer
        ("Final answer: \\boxed{8}\nAlternatively, \\boxed{9}.", "8", 0),
        ("Final answer: \\boxed{8}\nOr possibly \\boxed{9}.", "9", 0),
        ("\\boxed{8}\nBut it could also be \\boxed{9}.", "8", 0),  # without a marker too
        ("Final answer: 10 (my first value, 12, was wrong)", "10", 1),
        ("Final answer: 30 (rather than 31)", "30", 1), ("Final answer: 30, instead of 31", "30", 1),
        (r"Final answer: \boxed{3}, which is correct; 1 + 2 = 3", "3", 1),
    ],
    "later statements and parts: conditions, alternatives in brackets, labelled parts, complex values": [
        ("If n is even, the answer is $\\boxed{6}$.\nIf n is odd, the answer is $\\boxed{5}$.", "5", 0),
        ("Assuming order matters, \\boxed{24}.\nIn case it does not, \\boxed{4}.", "4", 0),
        ("Final answer: \\boxed{30}\n\n(or perhaps 31 if both ends count)", "30", 0),
        ("Final answer: \\boxed{30}\n\n(31 would count both ends, which the problem excludes)", "30", 1),
        ("**Answers**\n\n(a) $\\boxed{4}$\n(b) $\\boxed{9}$", "(4, 9)", 1),
        ("**Answers**\n\n(a) $\\boxed{4}$\n(b) $\\boxed{9}$", "9", 0),
        ("Final answer:\n(i) \\boxed{4}\n(ii) \\boxed{9}", "(4, 9)", 1),
        ("Part 1: \\boxed{2}\nPart 2: \\boxed{5}", "(2, 5)", 1),
        (r"Final answer: \boxed{e^{i\pi}}", "-1", 1), (r"Final answer: \boxed{e^{i\pi}}", "1", 0),
        (r"Final answer: \boxed{e^{i\pi/2}}", "i", 1), (r"Final answer: \boxed{(1+i)^2}", "2i", 1),
    ],
    "plain-text forms: markers, number words, fractions, roots, struck-through and withdrawn values": [
        ("最终答案：42", "42", 1), ("答案：15（已验证）", "15", 1), ("最终答案：三十六", "36", 1),
        ("最终答案：一百零五", "105", 1), ("最终答案：15（或者16）", "15", 0),
        ("## Final Answer\n\n**42**", "42", 1), ("### Answer\n- **n = 5**", "5", 1),
        ("Final answer:\n```\n588\n```", "588", 1), ("**Final Answer**\n\n\\[\n\\boxed{12", "12", 0),
        ("Final answer: one hundred and five", "105", 1), ("Final answer: two thousand and twenty-six", "2026", 1),
        ("Final answer: 3 over 4", r"\frac{3}{4}", 1), ("Final answer: 12 over 5", "12", 0),
        ("Final answer: 2 sqrt(3)", r"2\sqrt{3}", 1), ("Final answer: sqrt(12)", r"2\sqrt{3}", 1),
        ("Final answer: 256, unless order matters, in which case 512", "256", 0),
        ("Final answer: 42. (If repeats were allowed it would be 35 instead.)", "42", 0),
        ("Final answer: 15 \u2014 wait, no: 16.", "16", 1), ("Final answer: 15 \u2014 wait, no: 16.", "15", 0),
        ("Final answer: 588; 587 was my first guess", "588", 1), ("**Final answer:** ~~41~~ 42", "42", 1),
        ("**Final answer:** ~~41~~ 42", "41", 0),
    ],
    "witnesses: where the answer holds is a note": [
        (r"Final answer: \boxed{25} (at a = 5)", "25", 1), (r"Final answer: \boxed{7} (p = 3, q = 4)", "7", 1),
        (r"Final answer: \boxed{7} for n = 2", "7", 1), (r"Final answer: \boxed{7}, x = 2", "7", 1),
        (r"Final answer: \boxed{25}, attained when a = b = 5", "25", 1), (r"Final answer: \boxed{7, x = 2}", "7", 1),
        ("Final answer: 7, unless n = 2", "7", 0),  # a condition that changes the answer is a hedge
        ("Final answer: x = 3, y = 4", "(3, 4)", 1),  # assignments are the answer when the gold is several values
        ("Final answer: x = 3 or x = 4", "3", 0),
    ],
    "forms a grader credits: a choice with its value, percentages, sets as relations, formatting": [
        (r"Final answer: \boxed{\text{(B)}\ 7}", "B", 1), (r"Final answer: \boxed{\text{(B)}\ 7}", "7", 1),
        (r"Final answer: \boxed{\text{(B)}\ 7}", "C", 0), ("Final answer: (D) 15", "D", 1),
        ("Final answer: (D) 15", "15", 1), (r"Final answer: \boxed{(A)}", "A", 1),
        (r"Final answer: \boxed{12.5\%}", "12.5", 1), (r"Final answer: \boxed{12.5\%}", "0.125", 1),
        (r"Final answer: \boxed{12.5\%}", "125", 0),
        (r"Final answer: \boxed{x \le 3}", r"(-\infty, 3]", 1), (r"Final answer: \boxed{x < 3}", r"(-\infty, 3]", 0),
        (r"Final answer: \boxed{1 < x < 4}", "(1, 4)", 1),
        (r"Final answer: \boxed{\mathbf{9}}", "9", 1), (r"Final answer: \boxed{\color{blue}{9}}", "9", 1),
        (r"Final answer: \boxed{\bm{9}}", "9", 1), (r"Final answer: \boxed{\underline{9}}", "9", 1),
        (r"Final answer: \boxed{\boldsymbol{\frac{1}{2}}}", "0.5", 1),
    ],
    "rule 6: a later answer corrects only where the reply re-examines; else it is a second answer": [
        ("Final answer: \\boxed{18}\nFinal answer: \\boxed{19}", "19", 0),
        ("Final answer: \\boxed{18}\nFinal answer: \\boxed{19}", "18", 0),
        ("Answer: 250\n\nAnswer: 205", "205", 0),
        ("The answer is \\boxed{64}.\n\nSo \\boxed{65}.", "65", 0),
        ("Final answer: \\boxed{7}\n\nSecond candidate: \\boxed{9}", "9", 0),
        ("Final answer: \\boxed{7}\n\nFinal answer: $7$", "7", 1),  # the same value again
        ("Final answer: 18\n\nOn second thought, the corners are shared.\n\nFinal answer: 14", "14", 1),
        ("Final answer: 18\n\nI overcounted the corners.\nFinal answer: 14", "14", 1),
        ("Final answer: 18\n\nRechecking with the script gives 14.\n\nFinal answer: \\boxed{14}", "14", 1),
        ("Final answer: \\boxed{18}\n\nHmm, the loop missed n = 0, so the total should be 19.", "19", 1),
        ("Final answer: \\boxed{18}\n\nHmm, the loop missed n = 0, so the total should be 19.", "18", 0),
        ("Final answer: \\boxed{120}\nSorry, the answer should be 60.", "60", 1),
        ("Final answer: \\boxed{120}\nThe answer must be 60 after all.", "120", 0),
    ],
    "rule 6: an answer taken back and not replaced is no answer": [
        ("Final answer: \\boxed{88}\n\nWait, this is incorrect: I dropped a factor of 2. Let me redo it.", "88", 0),
        ("Final answer: \\boxed{88}\n\nNo, that's not right. I need to recount.", "88", 0),
        ("Answer: 88\nHmm. I made an error in the second step.", "88", 0),
        ("\\boxed{88}\n\nScratch that; the table is wrong.", "88", 0),
        ("Final answer: \\boxed{88}\n\nMy first try, 86, was wrong, but that is fixed now.", "88", 1),
        ("Final answer: \\boxed{88}\n\nI checked that the other count, 86, is wrong.", "88", 1),
        ("Final answer: \\boxed{88}\n\nIs that wrong? The brute force agrees, so no.", "88", 1),
    ],
    "rule 1: a bound is no value": [
        ("Final answer: at least 12", "12", 0),
        ("Final answer: no fewer than $12$", "12", 0),
        ("Final answer: at most 3.5", "3.5", 0),
        ("Final answer: more than 1000", "1000", 0),
        ("Final answer: 12 or more", "12", 0),
        ("Final answer: $12$ or fewer", "12", 0),
        ("Final answer: at least 12", "[12, \\infty)", 1),
        ("Final answer: 5 or less", "(-\\infty, 5]", 1),
        ("Final answer: \\boxed{12} (at least 12 is needed, and 12 works)", "12", 1),  # a note
        ("Final answer: 12 apples, more than 11", "12", 1),
    ],
    "rule 1: an estimate or a doubt right before the value commits to nothing": [
        ("Final answer: roughly 300", "300", 0),
        ("Final answer: nearly $\\frac{1}{2}$", "\\frac{1}{2}", 0),
        ("Final answer: ~ 64", "64", 0),
        ("So the total is probably \\boxed{64}.", "64", 0),
        ("Final answer: I guess 64", "64", 0),
        ("Final answer: possibly 64", "64", 0),
        ("Final answer: \\boxed{64} (roughly 8 times the first term)", "64", 1),  # a note after the value
        ("Final answer: \\boxed{64}\n\nThat is about twice the estimate.", "64", 1),
        ("Final answer: 3.14, approximately", "3.14", 1),  # after the value: a note
    ],
    "rule 1: letters after a number in math are a product, unless a unit or a function": [
        ("Final answer: \\boxed{3ab}", "3", 0),
        ("Final answer: \\boxed{5 xy}", "5", 0),
        ("Final answer: \\boxed{2 \\cdot m \\cdot n}", "2mn", 1),
        ("Final answer: $4pq$", "4 \\cdot p \\cdot q", 1),
        ("Final answer: \\boxed{12 km}", "12", 1),
        ("Final answer: \\boxed{2.5e3}", "2500", 1),
        ("Final answer: \\boxed{\\sum_{j=1}^{4} j}", "10", 1),
    ],
    "rule 1: Unicode superscripts and LaTeX spaces": [
        ("Final answer: 3¹²", "531441", 1),
        ("Final answer: \\boxed{10⁻²}", "0.01", 1),
        ("Final answer: \\boxed{~512}", "512", 1),
        ("Final answer: $1~024$", "1024", 1),
    ],
    "where the answer is: answer markers in other languages": [
        ("Réponse : \\boxed{17}", "17", 1),
        ("Respuesta final: 17", "17", 1),
        ("Antwort: 17", "17", 1),
        ("Ответ: 17", "17", 1),
        ("Resposta final: 18", "17", 0),
    ],
    "rule 4: several values as one answer": [
        ("Final answer: -1, 4", "4, -1", 1),
        ("Final answer: x = -1 or x = 4", "-1, 4", 1),
        ("Final answer: x = -1 and x = 4", r"\{-1, 4\}", 1),
        (r"Final answer: \boxed{-1} and \boxed{4}", "-1, 4", 1),
        ("Final answer: -1, 4", "4", 0),  # a list for a gold of one value is a hedge
        ("Final answer: -1, 5", "-1, 4", 0),
        ("Final answer: -1", "-1, 4", 0),
        ("Final answer: [2, 5)", "[2, 5)", 1),
        ("Final answer: (2, 5]", "[2, 5)", 0),
        (r"Final answer: x \in [2, 5)", "[2, 5)", 1),
        (r"Final answer: (-\infty, 0) \cup (1, \infty)", r"(-\infty, 0) \cup (1, \infty)", 1),
        ("Final answer: (4, -1)", "(4, -1)", 1),
        (r"Final answer: \pm 3", "3, -3", 1),
        ("Final answer: 2x - y = 7", "2x - y - 7 = 0", 1),  # an equation gold: compared as an equation
        ("Final answer: 7", "2x - y = 7", 0),
        ("Final answer: 0", "x^2 + y^2 - 1 = 0", 0),
        ("Final answer: 9", "t = 9", 1),  # a name on the left: its right side
        ("Final answer: -1, 4", "x = -1 or x = 4", 1),  # a list of assignments is several values
        ("Final answer: y = 3x - 2", "y = 3x - 2", 1),
        ("Final answer: x \\ge 2", "x \\ge 2", 1),
        ("Final answer: 2 \\le x", "x \\ge 2", 1),
        ("Final answer: 2", "x \\ge 2", 0),
    ],
}


# ---- issue 67: the score reads every correction and alternative; classes of a new held-out batch. Each group is a
# rule of docs/scoring.md (its name), in forms of this file's own; "guards" are look-alikes the new rules must not take.
RECAP = "The script printed:\n\n```\ncount = 21\n```\n\nSo each of the two halves has 21 arrangements.\n\n"
CLASSES_ISSUE_67 = {
    "docs/scoring.md's examples of issue 67": [
        *[("Final answer: \\boxed{42}\n" + later, "43", 1) for later in (
            "Correction: 43", "Wait, actually 43.", "Oops, 43.", "Sorry, I meant 43.", "On second thought, 43.",
            "The correct value is 43.", "The answer above is wrong; 43")],
        *[("Final answer: \\boxed{42}\n" + later, "42", 0) for later in (
            "It could also be 43.", "But 43 is also possible.", "If both ends count, it is 43.")],
        ("Final answer: \\boxed{41}\nThe right one: 42", "42", 1),
        ("Final answer: \u2248 7034", "7034", 0), ("Final answer: \\approx 7034", "7034", 0),
        ("Final answer: 7034\u20137035", "7034", 0), ("Final answer: 7034 to 7035", "7034", 0),
        ("The answer is \\boxed{42", "42", 0), ("Final answer: \\boxed{3 \\pmod{7}}", "3", 1),
        ("Final answer: $n \\equiv 5 \\pmod{8}$", "5", 1), ("Final answer: \\boxed{1 + \\mathrm{i}}", "1+i", 1),
        ("Final answer: \\boxed{\\mathrm{e}^2}", "e^2", 1), ("Final answer: \\boxed{2\\sqrt[3]2}", "2\\sqrt[3]{2}", 1),
        ("Final answer: infinitely many", "\\infty", 1), ("Final answer: no solution", "\\emptyset", 1),
        ("Final answer: \u2205", "\\emptyset", 1), ("Final answer: 3{:}45", "3:45", 1),
    ],
    "rule 6: a correction with its value alone supersedes, both ways": [
        ("Final answer: \\boxed{18}\n\nCorrection: 21", "21", 1),
        ("Final answer: \\boxed{18}\n\nCorrection: 21", "18", 0),
        ("The total is $\\boxed{250}$.\n\nWait, actually $205$.", "205", 1),
        ("Final answer: 3/4\nOops \u2014 2/3.", "2/3", 1),
        (RECAP + "Answer: 1,024\n\nSorry, I meant 2,048.", "2048", 1),
        (RECAP + "Answer: 1,024\n\nSorry, I meant 2,048.", "1024", 0),
        ("**Final answer:** $\\boxed{64}$\n\nOn second thought: $\\frac{1}{64}$.", "1/64", 1),
        ("Final answer: \\boxed{12}\nThe correct count is 14 (I had skipped the two corner cases).", "14", 1),
        ("Final answer: \\boxed{12}\nThe correct count is 14 (I had skipped the two corner cases).", "12", 0),
        ("Final answer: \\boxed{7}\n\nOn reflection, 8.", "8", 1),
        ("Final answer: 41\n\nMy mistake: 42.", "42", 1),
        ("Final answer: \\boxed{42}\nOops, 41.", "42", 0),
        (RECAP + "### Final Answer\n\n\\[\n\\boxed{120}\n\\]\n\nThe right one: 60", "60", 1),
        (RECAP + "### Final Answer\n\n\\[\n\\boxed{120}\n\\]\n\nThe right one: 60", "120", 0),
        ("Final answer: The right one: 42", "42", 1),  # "one" after "the right" is a pronoun, no number word
        ("Final answer: the smallest such one is 17", "17", 1),
        ("Final answer: \\boxed{35}\n\nThe answer above is wrong; 36", "36", 1),
        ("Final answer: \\boxed{35}\n\nMy previous answer was incorrect: 36.", "36", 1),
        ("Final answer: \\boxed{35}\n\nScratch that \u2014 36.", "36", 1),
        ("Final answer: \\boxed{35}\n\nThat was wrong; 36.", "36", 1),
        ("Final answer: \\boxed{18}\n\nEdit: 21", "21", 1),
        ("Final answer: \\boxed{18}\n\nUpdate: 21 (I had missed the diagonal).", "21", 1),
        ("Final answer: 18\nErratum: 21", "21", 1), ("Final answer: 18\nTypo \u2014 21.", "21", 1),
        # a correction that offers two values is a hedge; a correction offered as possible too corrects nothing
        ("Final answer: \\boxed{42}\nCorrection: 43 or 44.", "42", 0),
        ("Final answer: 35\nWait, actually, if both ends count, it is 36.", "36", 0),
    ],
    "rule 6: a later alternative is a hedge": [
        ("Final answer: \\boxed{15}\n\nIt could also be 16.", "15", 0),
        ("So the answer is $\\boxed{15}$.\nIt might be $16$ as well.", "15", 0),
        ("Final answer: 15\n\nBut 16 is also possible if the endpoints count.", "15", 0),
        ("Final answer: \\boxed{15}\n(If both ends count, it is 17.)", "15", 0),
        ("Final answer: 15. If the empty set counts, it would be 16.", "15", 0),
        ("Final answer: \\boxed{15}\n\nAssuming the grid wraps, the count is 18.", "15", 0),
        ("Final answer: 42\nThe answer could equally be 43.", "42", 0),
        ("Final answer: \\boxed{42}\nWait, actually \\boxed{43} also works.", "43", 0),
        ("Final answer: 15\n16 is another possibility.", "15", 0), ("Final answer: 15\n16 would also work.", "15", 0),
        ("Final answer: 15\n16 if the corners count.", "15", 0),
        ("Final answer: 15\nIf the corners count: 16.", "15", 0),
        ("Final answer: 15. If the corners count, 16.", "15", 0),
        ("Final answer: (3, 4)\nWait, (5, 12) works too.", "(3, 4)", 0), ("Final answer: 42\n43 also works.", "42", 0),
        ("Final answer: 42\n$43$ works as well.", "42", 0),
        ("Final answer: 42\n(43 under the other convention.)", "42", 0),
        ("Final answer: 42\nWith the other convention, 43.", "42", 0),
        ("Final answer: 42\nFor the other parity, the count is 43.", "42", 0),
    ],
    "rule 1: an estimate or a doubt commits to nothing (an estimate sign)": [
        ("Final answer: \u2248 7034", "7034", 0),
        (RECAP + "Final answer: N \u2248 7034", "7034", 0),
        ("Final answer: $S \\approx 7034$", "7034", 0),
        ("**Final Answer:** $T \\approx 3.5$ hours", "3.5", 0),
        ("Final answer: x \\approx 12.5", "12.5", 0),
        ("Final answer: the total is \u2248 7034 ways", "7034", 0),
        ("Final answer: \u2243 7034", "7034", 0), ("Final answer: ~\\boxed{7034}", "7034", 0),
        ("Final answer: close to 7034", "7034", 0), ("Final answer: circa 7034", "7034", 0),
        ("Final answer: an estimated 7034", "7034", 0),
        ("Final answer: \u2272 7034", "7034", 0),
    ],
    "rule 3: a range offers both its ends": [
        ("Final answer: 7034\u20137035", "7034", 0),
        ("Final answer: from 12 to 15", "12", 0),
        ("Final answer: $12$\u2013$15$", "12", 0),
        ("Final answer: \\boxed{12 \\text{ to } 15}", "12", 0),
        ("Final answer: 7034 to 7035", "7034", 0),
        ("Final answer: $7034$ to $7035$ ways", "7034", 0),
        ("Final answer: 7034 up to 7035", "7034", 0),
        ("Final answer: 7034 ~ 7035", "7034", 0),
    ],
    "a check or an intermediate quantity is no answer": [
        ("Final answer: \\boxed{840}\n\n**Verification:** the number of unordered pairs is $\\boxed{420}$, doubled "
         "gives 840.", "840", 1),
        ("The answer is $\\boxed{840}$.\n\nAs a sanity check, the intermediate product $\\boxed{420}$ doubles to it.",
         "840", 1),
        ("Final answer: \\boxed{840} (intermediate: \\boxed{420})", "840", 1),
        ("Final answer: \\boxed{840}\n\n(The partial sum before doubling was \\boxed{420}.)", "840", 1),
        ("Final answer: \\boxed{840}\n\nQuick check: $f(2) = \\boxed{5}$, as the table says.", "840", 1),
        ("Final answer: \\boxed{42}\n\nFor verification: $\\binom{7}{2} = \\boxed{21}$, and $2 \\cdot 21 = 42$.",
         "42", 1),
        ("Final answer: \\boxed{42}\n\nVerifying: $\\boxed{21} \\cdot 2 = 42$.", "42", 1),
        ("Final answer: \\boxed{42}\n\n(Step 2 gave \\boxed{21}.)", "42", 1),
        ("Final answer: \\boxed{42}\nwhere \\boxed{21} is the number of unordered pairs.", "42", 1),
        ("Final answer: \\boxed{42}\n\nLemma: \\boxed{21}", "42", 1),
        ("Final answer: \\boxed{42}\n(Sub-result: \\boxed{21})", "42", 1),
        ("Final answer: \\boxed{42}\n\n\\boxed{21} (check)", "42", 1),
        ("Final answer: \\boxed{42}\n\n$\\boxed{21}$ \u2014 as a check, half of it.", "42", 1),
        (RECAP + "Hence $\\boxed{42}$.\n\nCheck: $\\boxed{21} \\times 2 = 42$ \u2713", "42", 1),
        ("Intermediate: \\boxed{1296}, and after dividing by 24 the answer is \\boxed{54}.", "54", 1),
    ],
    "an intermediate box in work that goes on, a box never closed: no answer": [
        ("We count the colourings without symmetry first.\n\nIntermediate result: $\\boxed{1296}$ colourings.\n\n"
         "Next, divide by the 24 rotations using Burnside's lemma:", "1296", 0),
        ("So far the total is \\boxed{36}; now we subtract the overlaps.", "36", 0),
        ("This gives \\boxed{36} for now. Let me continue with the second case.", "36", 0),
        ("The partial count so far is \\boxed{42}.", "42", 0),
        ("The answer is \\boxed{42", "42", 0),
        ("Final answer: \\boxed{42", "42", 0),
        ("Final answer: $\\boxed{\\frac{7}{2}$", "7/2", 0),
        ("Final answer: $\\boxed{42$", "42", 0), ("Final answer: \\fbox{42", "42", 0),
        ("The running total after step 3 is \\boxed{21}.", "21", 0),
        (RECAP + "Therefore the answer is $\\boxed{1", "1", 0),
    ],
    "comparing: a residue with its modulus": [
        ("Final answer: $\\boxed{3 \\pmod{7}}$", "3", 1),
        ("Final answer: $n \\equiv 5 \\pmod{8}$", "5", 1),
        ("Thus $x \\equiv 11 \\pmod{13}$, so the answer is $\\boxed{x \\equiv 11 \\pmod{13}}$.", "11", 1),
        ("Final answer: \\boxed{4 \\ (\\mathrm{mod}\\ 9)}", "4", 1),
        ("Final answer: $\\boxed{x \\equiv 2 \\pmod{9}}$", "2", 1),
        ("Final answer: \\boxed{6 \\ (\\text{mod } 11)}", "6", 1),
        ("Final answer: \\boxed{3}", "3 \\pmod{7}", 1),
    ],
    "comparing: \\mathrm{i}, \\mathrm{e}, a root's argument without braces": [
        ("Final answer: $\\boxed{3 - 4\\mathrm{i}}$", "3-4i", 1),
        ("Final answer: \\boxed{\\mathrm{e}^{2}-1}", "e^2 - 1", 1),
        ("Final answer: $\\boxed{\\mathrm{e}^{\\mathrm{i}\\pi}}$", "-1", 1),
        ("Final answer: \\boxed{2\\mathrm{e}}", "2e", 1),
        ("Final answer: \\boxed{2\\sqrt[3]2}", "2\\sqrt[3]{2}", 1),
        ("Final answer: \\boxed{2\\sqrt[3]2}", "2^{4/3}", 1),
        ("Final answer: $\\boxed{\\sqrt[4]3}$", "3^{1/4}", 1),
        ("Final answer: \\boxed{5\\sqrt[3]{4}}", "5\\sqrt[3]4", 1),
    ],
    "comparing: an infinite count, an empty solution set, a clock time": [
        ("Final answer: There are infinitely many such pairs.", "\\infty", 1),
        ("Final answer: \\boxed{\\text{infinitely many}}", "\\infty", 1),
        (RECAP + "**Answer:** infinitely many", "\\infty", 1),
        ("Final answer: \\boxed{\\infty}", "infinitely many", 1),
        ("Final answer: no solution", "\\emptyset", 1),
        ("Final answer: The equation has no real solutions.", "\\emptyset", 1),
        ("Final answer: \\boxed{\\text{No solution}}", "\\emptyset", 1),
        ("Final answer: \\boxed{\\varnothing}", "\\emptyset", 1),
        ("Final answer: No such integer exists.", "\\emptyset", 1), ("Final answer: none", "\\emptyset", 1),
        ("Final answer: the solution set is empty", "\\emptyset", 1),
        ("Final answer: \\boxed{\\text{none}}", "\\emptyset", 1), ("Final answer: \\boxed{\\{\\,\\}}", "\\emptyset", 1),
        ("Final answer: countably infinite", "\\infty", 1),
        ("Final answer: an infinite number of solutions", "\\infty", 1),
        ("Final answer: arbitrarily many", "\\infty", 1), ("Final answer: the set is empty", "\\emptyset", 1),
        ("Final answer: there is no such pair", "\\emptyset", 1),
        ("Final answer: \\boxed{3{:}45}", "3:45", 1),
        ("Final answer: $10{:}05$ a.m.", "10:05", 1),
        ("Final answer: \\boxed{15{:}45}", "3:45 PM", 1),
        ("Final answer: 1:15", "3:45", 0),  # a time, not the ratio 3:45 = 1:15
    ],
    "guards: look-alikes and the other side of the pairs above, scored as before": [
        ("Final answer: \\boxed{42}\n\nWait, 3 cases needed the tool; it confirmed 42 each time.", "42", 1),
        ("Final answer: \\boxed{42}\nSorry for the long derivation.", "42", 1),
        ("Final answer: \\boxed{42}\n\nThe correct value is 42, as the brute force confirms.", "42", 1),
        ("Final answer: \\boxed{42}\n\nNote: it could be computed faster with a sieve.", "42", 1),
        ("Final answer: \\boxed{42}\n\nThe count could be 0 only if n < 3, which the problem excludes.", "42", 1),
        ("Final answer: 42\n\nIf n = 7, it is 56, which is not allowed here.", "42", 1),  # a check of a case
        ("Final answer: \\boxed{15}\nIf we recount by hand, it is 15 again.", "15", 1),
        ("Final answer: \\boxed{42}\n\nOops, I forgot to mention the runtime: 3 s.", "42", 1),
        ("Final answer: \\boxed{42}\nSorry, 42 was already given above.", "42", 1),
        ("Thus \\boxed{42}, the partial fractions having cancelled.", "42", 1),
        ("Using the partial fraction decomposition, we get \\boxed{42}.", "42", 1),
        ("So far every case checks out, and the total is \\boxed{42}.", "42", 1),
        ("The partial sums are listed above.\n\nThe answer is \\boxed{54}.", "54", 1),
        ("Final answer: \\boxed{42}\n\nCheck: $6 \\cdot 7 = \\boxed{42}$.", "42", 1),
        ("Final answer: $\\frac{\\pi}{4} \\approx 0.785$", "\\frac{\\pi}{4}", 1),  # an approximation after the value
        ("Final answer: 3.14 to 2 decimal places", "3.14", 1),
        ("Final answer: 12 (rounded to 2 significant figures)", "12", 1),
        ("Final answer: 42 \u2014 6 more than the naive count", "42", 1),
        ("Final answer: 42 (no solutions for n > 6)", "42", 1),
        ("Final answer: the infinite sum is 2", "2", 1),
        ("Final answer: \\boxed{N \\equiv 2 \\pmod{5}}", "3", 0),
        ("Final answer: \\boxed{\\sqrt[3]2}", "\\sqrt[3]{20}", 0),  # one token under the root, as LaTeX reads it
        ("Final answer: infinitely many or 12", "\\infty", 0),
        ("Final answer: 3:45 or 4:15", "3:45", 0),
        ("so \\boxed{\\frac{1}{3}} and a broken \\boxed{2", "1/3", 1),  # a closed box before the cut one
        ("Final answer: \\boxed{35}\n\nThat was wrong; 36.", "35", 0),
        ("Final answer: \\boxed{42}\nCorrection: 43 or 44.", "43", 0),
        ("Final answer: \\boxed{35}\nActually, 36 is also possible.", "36", 0),
        ("Final answer: $\\approx 7034$ (from the simulation)", "7034", 0),
        ("Final answer: 7034\u20137035", "7035", 0),
        ("Final answer: 12 \u2014 15", "15", 0),
        ("Final answer: \\boxed{840}\n\nCheck: actually the answer is \\boxed{841}.", "840", 0),  # a correction
        ("Final answer: \\boxed{840}\n\nSanity check: \\boxed{841} also works.", "840", 0),  # offered too
        ("Final answer: n \u2261 6 (mod 11)", "6", 1),
        ("Final answer: $\\boxed{3 \\pmod{7}}$ or $\\boxed{4 \\pmod{7}}$", "3", 0),
        ("Final answer: \\boxed{e}", "\\mathrm{e}", 1),
        ("Final answer: \\boxed{18}\n\nUpdate: 3 more tests passed.", "18", 1),
        ("Final answer: \\boxed{18}\n\nEdit: 42 is confirmed, formatting only.", "18", 1),
        ("Final answer: 15\nIf we check with the script, 3 runs agree.", "15", 1),
        ("Final answer: 15\n15 if the corners count too.", "15", 1),
        ("Final answer: \\boxed{7034}, the closest integer", "7034", 1),
        ("**Step 3.** Combining, the count is \\boxed{42}.", "42", 1),
        ("**Step 2.** We find \\boxed{21} pairs.\n\n**Step 5.** Therefore the total is \\boxed{42}.", "42", 1),
        ("Checking again, the count is \\boxed{43}.\n\nEarlier: \\boxed{42}", "43", 1),
        ("Final answer: \\boxed{42}\n\nAs a final check, the script prints \\boxed{42}.", "42", 1),
        ("The area is \\boxed{42}, where the base is 6.", "42", 1),
        ("Final answer: 42\nNone of the other cases apply.", "42", 1),
        ("Final answer: None of the cases fail, so 42", "42", 1),
        ("Final answer: the empty string", "the empty string", 1),
        ("Final answer: 42 (the empty set is excluded)", "42", 1),
        ("Final answer: none", "0", 0), ("Final answer: No", "No", 1),
        ("Final answer: 42\nThis would also work for 7 \\times 7 grids.", "42", 1),
        ("Final answer: 42\nThe same method would also work for n = 5.", "42", 1),
        ("Final answer: 42\nThe other ordering is also possible, and gives the same 42.", "42", 1),
        ("Final answer: 42\nIf you run the script, 42.", "42", 1),
        ("Final answer: 42, close to the estimate of 40", "42", 1),
        ("Final answer: 42\n\nCorrection: none needed.", "42", 1),
        ("Final answer: 15. When checked by hand, 15 again.", "15", 1),
        ("Final answer: 15. If n = 2, 3 cases remain.", "15", 1),
        ("Final answer: $3 \\mod 7$", "3", 1), ("Final answer: the remainder is 3 modulo 7", "3", 1),
        ("Final answer: 3:45 p.m.", "3:45", 1),
        ("Final answer: 42\nThe formula works too, as checked.", "42", 1),
        ("Thus the count is \\boxed{42}, so far as the constraints allow.", "42", 1),
        ("Final answer: 42\nWith the other method, 42 again.", "42", 1),
        ("Final answer: 7034 (about 7 thousand)", "7034", 1), ("Final answer: 7034\uff5e7035", "7035", 0),
        ("Final answer: $1~024$ ways", "1024", 1),
        ("Final answer: $\\sim 7034$", "7034", 0),
    ],
}

@pytest.mark.parametrize("predicted, gold, expected", [
    ("1/2", "0.5", True), ("0.25", "1/4", True), ("0.50000000001", "0.5", True), ("1/3", "0.333333333333", True),
    ("0.333333", "1/3", False), ("0.3333333333", "1/3", False), ("0.5", "0.6", False), ("2/6", "1/3", True),
])
def test_numbers_agree(predicted, gold, expected):
    assert scoring.numbers_agree(Fraction(predicted), Fraction(gold)) is expected


@pytest.mark.parametrize("output, gold, expected", CASES + HEDGES + ACCEPTED_FORMS + NOTE_FORMS + TRUNCATED_DECIMALS
                         + ISSUE_TABLE)
def test_extract_and_score(output, gold, expected):
    prediction = scoring.extract_final_answer(output)
    score, method = scoring.score_answer(prediction, gold)
    assert score == expected, (prediction, method)
    assert isinstance(score, float) and isinstance(method, str)


@pytest.mark.parametrize("rule, output, gold, expected", [
    (rule, *case) for rule, cases in {**POLICY, **CLASSES_ISSUE_67}.items() for case in cases])
def test_policy(rule, output, gold, expected):
    prediction = scoring.extract_final_answer(output)
    assert scoring.score_answer(prediction, gold)[0] == expected, (rule, prediction)


@pytest.mark.parametrize("output, expected", [
    (r"Final answer: \boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"Final answer: \boxed{\begin{pmatrix} 1 \\ 2 \end{pmatrix}}", r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}"),
    ("Final answer: $x = 5$.", "x = 5"),
    (r"<think>Answer: \boxed{1}", None),  # reply cut off while thinking: nothing committed
    ("reasoning</think>\nAnswer: 3", "3"),  # opening tag was in the prompt
    ("no answer here", None),
    # the committed value whole, without its note; the values an answer offers, joined by ", "
    ("Final answer: 42 - verified with bash", "42"),
    ("Final answer: (1, 2], since the left endpoint is excluded", "(1, 2]"),
    (r"Final answer: \{1, 2\} [as listed]", r"\{1, 2\}"),
    ("Final answer: x = 5, as expected.", "x = 5"),
    (r"Final answer: \text{Yes}, since the sum is even", "Yes"),
    (r"Final answer: $2\sqrt{3}$ which the script confirms", r"2\sqrt{3}"),
    ("Final answer: the answer is 42, as computed", "42"),
    ("Final answer: 42 (checked with 3 runs)", "42"),
    ("Final answer: 42 checked with 3 runs", "42"),
    ("Final answer: 42, maybe 43", "42, 43"),
    ("Final answer: red, green", "red, green"),
    ("Final answer: x^2 - xy", "x^2 - xy"),
    ("Final answer: minus forty-two thousandths", r"-\frac{42}{1000}"),
    ("Final answer: not 42", "not 42"),  # commits to nothing: the text, which scores 0
    ("Final answer:\n\\[\n  \\frac{7}{2}\n\\]\nDone.", r"\frac{7}{2}"),  # display math below an empty marker
])
def test_extract_final_answer_text(output, expected):
    assert scoring.extract_final_answer(output) == expected


def test_missing_answer_method():
    assert scoring.score_answer(None, "42") == (0.0, "missing_final_answer")
    assert scoring.score_answer(scoring.extract_final_answer("nothing"), "42") == (0.0, "missing_final_answer")


@pytest.mark.parametrize("prediction, gold, expected", [  # non-integer golds: integers never reach math_verify
    ("1,000.5", "1000.5", (1.0, "numeric_match")),
    (r"\boxed{{ABC}}.", "abc", (1.0, "exact_match")),
    ("$x_7$", "x_7", (1.0, "exact_match")),
    ("3/4", "0.75", (1.0, "numeric_match")),
    (r"\frac{3}{4}", "0.75", (1.0, "numeric_match")),
    (r"-\frac{1}{3}", "-0.333333333333", (1.0, "numeric_match")),
    ("0.3333", "1/3", (0.0, "numeric_match")),  # 1e-8, not math_verify's rounding
    ("0.3333333333", "1/3", (0.0, "numeric_match")),  # within 1e-8, but a truncation of 1/3
    (r"\frac{33333333}{100000000}", "1/3", (0.0, "numeric_match")),  # a finite decimal, written as a fraction
    ("0.5000000001", "1/2", (1.0, "numeric_match")),
    (r"\frac{1}{3}", "0.33333333333", (1.0, "numeric_match")),  # the gold itself rounded
    ("1.5e3", "1500.5", (0.0, "numeric_match")),
    ("1.5e3", "3000/2", (1.0, "integer_match")),
    ("1.2", "1.3", (0.0, "numeric_match")),
    ("red", "blue", (0.0, "no_match")),
])
def test_fallback_when_math_verify_cannot_decide(monkeypatch, prediction, gold, expected):
    monkeypatch.setattr(scoring, "_math_verify", lambda prediction, gold: None)
    assert scoring.score_answer(prediction, gold) == expected


def test_normalize_answer():
    assert scoring.normalize_answer(r" \boxed{ 1,234 }. ") == "1234"
    assert scoring.normalize_answer("{{Yes}}") == "yes"
    assert scoring.normalize_answer("{a}{b}") == "{a}{b}"  # not one outer pair


def test_scoring_works_off_the_main_thread():
    # math_verify's signal-based timeouts only work in the main thread; scoring must still work in a worker
    results = []
    prediction, gold = r"\frac{\sqrt{2}}{2}", r"\frac{1}{\sqrt{2}}"
    worker = threading.Thread(target=lambda: results.append(scoring.score_answer(prediction, gold)))
    worker.start()
    worker.join()
    assert results == [(1.0, "math_verify")]


# run_episode's rules, through the production path: the agent loop with a scripted policy, its isolated scorer
RIGHT = "Final answer: \\boxed{42}"
EPISODES = {  # name: (the policy's replies, gold, max_turns, (score, score method))
    "integer after bash": ([action("echo 42"), RIGHT], "42", 5, (1.0, "integer_match")),
    "expression after bash": ([action("echo 1.414"), "Final answer: \\boxed{\\sqrt{2}}"], "\\sqrt{2}", 5,
                              (1.0, "math_verify")),
    "wrong integer": ([action("echo 41"), "Final answer: \\boxed{41}"], "42", 5, (0.0, "integer_match")),
    # a right answer without a bash call never scores: it is refused until the turns run out
    "no bash call": ([RIGHT, RIGHT], "42", 2, (0.0, "missing_final_answer")),
    # nor does an episode ended by an error or a context overflow, whatever it answered before
    "error": ([action("echo 42") + "\n" + RIGHT, RuntimeError("boom")], "42", 5, (0.0, "error")),
    "context overflow": ([action("echo 42") + "\n" + RIGHT, common.ContextOverflow("prompt of 40961 tokens")], "42", 5,
                         (0.0, "context_overflow")),
    "no final answer": ([action("echo 42")] * 3, "42", 3, (0.0, "missing_final_answer")),
}


@pytest.mark.parametrize("name", EPISODES)
def test_score_episode_rules(name):
    replies, gold, max_turns, expected = EPISODES[name]
    problem = {"id": "p1", "question": "What is 6 times 7?", "answer": gold}
    record = run(ScriptedPolicy(replies), problem, max_turns=max_turns)
    assert (record["score"], record["score_method"]) == expected


# ---- parse_action ----

@pytest.mark.parametrize("reply, expected", [
    ('{"name": "bash", "arguments": {"command": "ls"}}', "ls"),
    ('Let me compute.\n```json\n{"name": "bash", "arguments": {"command": "python3 -c \'print(2**10)\'"}}\n```',
     "python3 -c 'print(2**10)'"),
    ('<tool_call>\n{"name": "bash", "arguments": {"command": "echo \\"hi\\""}}\n</tool_call>', 'echo "hi"'),
    # the first well-formed bash object wins
    ('{"name": "bash", "arguments": {"command": "echo 1"}} then {"name": "bash", "arguments": {"command": "echo 2"}}',
     "echo 1"),
    # objects that are not bash actions are skipped
    ('{"a": 1} {"name": "python", "arguments": {"code": "1"}} {"name": "bash", "arguments": {"command": "pwd"}}',
     "pwd"),
    # arguments as a JSON string (OpenAI style)
    ('{"name": "bash", "arguments": "{\\"command\\": \\"date\\"}"}', "date"),
    # raw newlines inside the string (invalid strict JSON)
    ('{"name": "bash", "arguments": {"command": "cat > a.py <<EOF\nprint(1)\nEOF\npython3 a.py"}}',
     "cat > a.py <<EOF\nprint(1)\nEOF\npython3 a.py"),
    # relaxed fallback: unescaped double quotes inside the command
    ('{"name": "bash", "arguments": {"command": "python3 -c "print(1+1)""}}', 'python3 -c "print(1+1)"'),
    # LaTeX braces around do not confuse it
    (r'We need \frac{1}{2}. {"name": "bash", "arguments": {"command": "echo ok"}}', "echo ok"),
    # actions inside a think block do not count
    ('<think>{"name": "bash", "arguments": {"command": "rm x"}}</think>Final answer: \\boxed{1}', None),
    ("Final answer: \\boxed{1}", None),
    ("just prose {with braces}", None),
])
def test_parse_action(reply, expected):
    assert actions.parse_action(reply) == expected


def relaxed_action(command_body: str) -> str:
    """A bash action whose command string holds an unescaped double quote, so that it is no JSON: the relaxed
    pattern's case."""
    return '{"name": "bash", "arguments": {"command": "echo "x"; ' + command_body + '"}}'


@pytest.mark.parametrize("body, command", [
    # JSON escapes are decoded as json decodes them: what the model meant by writing them in a JSON string
    (r"cat > a.py <<EOF\nprint(1)\nEOF\npython3 a.py", "cat > a.py <<EOF\nprint(1)\nEOF\npython3 a.py"),
    (r'python3 -c \"print(2)\"', 'python3 -c "print(2)"'),
    (r"printf 'a\\tb\\n'\tls", "printf 'a\\tb\\n'\tls"),  # \\ is one backslash, \t a tab
    (r"echo caf\u00e9 \ud83d\ude00 \/tmp\r\b\f", "echo caf\u00e9 \U0001F600 /tmp\r\b\f"),
    (r'echo \\"', 'echo \\"'),  # an escaped backslash, then a bare quote
    # a backslash that starts no JSON escape: the model wrote the shell's text unescaped, taken verbatim
    (r"grep -E '\d+' f\nwc -l", r"grep -E '\d+' f\nwc -l"),
    (r"echo \$HOME \n", r"echo \$HOME \n"),
    (r"echo \u12", r"echo \u12"),  # a \u without four hex digits
    (r"echo \ud83d", r"echo \ud83d"),  # half a surrogate pair: no text the shell can be given
    (r"echo a\\", "echo a\\"),  # a trailing escaped backslash decodes
])
def test_the_relaxed_action_decodes_json_escapes_or_keeps_the_text_verbatim(body, command):
    assert actions.parse_action(relaxed_action(body)) == 'echo "x"; ' + command


def test_a_relaxed_action_blank_once_decoded_is_no_action():
    reply = '{"name": "bash" "arguments": {"command": " \\n\\t "}}'  # no JSON: a comma is missing
    assert actions.parse_action(reply) is None


def test_a_lone_trailing_backslash_is_kept_verbatim():
    assert actions.json_string_text("echo a\\") == "echo a\\"


# ---- seeds ----

def test_request_seed_is_stable_and_63_bit():
    seed = common.request_seed(1234, "dapo_001", 3, 0)
    assert seed == common.request_seed(1234, "dapo_001", 3, 0)
    assert isinstance(seed, int) and 0 <= seed < 2**63
    seeds = {common.request_seed(run, pid, s, t)
             for run in (0, 1) for pid in ("a", "b") for s in range(4) for t in range(5)}
    assert len(seeds) == 2 * 2 * 4 * 5  # every field changes the seed


# ---- the answer marker counts only at the start of a line

@pytest.mark.parametrize("output, expected", [
    # prose that mentions "answer:" mid-line commits to nothing and does not replace the boxed answer
    (r"So \boxed{12} is it; I computed the answer: 16 earlier.", "12"),
    (r"\boxed{7}" "\nLet me check that the answer: is verified", "7"),
    ("I computed the answer: 16 earlier, now checking.", None),
    ("Checking whether the final answer: 5 holds.", None),
    # after markdown at the start of the line it counts
    ("> Final answer: 9", "9"),
    ("- **Answer:** 14", "14"),
    ("  * Final Answer: 3", "3"),
    ("### Final answer: 21", "21"),
    (r"2. **Final answer**: \boxed{8}", "8"),
    ("We had an answer: 5 before.\nAnswer: 6", "6"),
])
def test_answer_marker_only_at_line_start(output, expected):
    assert scoring.extract_final_answer(output) == expected


# ---- numbers compare as numbers when the gold is an integer

@pytest.mark.parametrize("prediction, gold, expected", [
    # digit-group separators: commas, LaTeX thin spaces, braced commas, plain and unicode spaces
    ("1,000", "1000", 1), ("12,345,678", "12345678", 1), (r"1\,000", "1000", 1), (r"1{,}000", "1000", 1),
    ("1 000", "1000", 1), ("1\u2009000", "1000", 1), (r"2\ 024", "2024", 1), ("1~000", "1000", 1),
    (r"1\,000", "0", 0), ("1 000", "1", 0), (r"1\,000", "100", 0), ("1,001", "1000", 0),
    # currency, units, \text{}
    (r"\$1000", "1000", 1), (r"\$1{,}000", "1000", 1), ("1000 dollars", "1000", 1), (r"250 \text{ cm}^2", "250", 1),
    (r"\text{1000}", "1000", 1), (r"15\%", "15", 1), (r"\textbf{36}", "36", 1), (r"6 \text{ ways}", "7", 0),
    # a name on the left of `=`
    ("x = 5", "5", 1), ("n=12", "12", 1), ("f(3) = 17", "17", 1), ("x = 5", "6", 0),
    # degrees and modular qualifiers
    (r"5^\circ", "5", 1), (r"45^{\circ}", "45", 1), ("30°", "30", 1), (r"12 \pmod{20}", "12", 1),
    (r"7 \pmod {20}", "12", 0), ("3 (mod 7)", "3", 1), (r"4 \bmod 9", "4", 1),
    # markdown emphasis and sentence punctuation
    ("**42**", "42", 1), ("**42**.", "42", 1), ("42.", "42", 1), ("`42`", "42", 1), ("*41*", "42", 0),
    # a final sentence that ends in the number
    ("so the answer is 42", "42", 1), ("The total is 1,000 dollars.", "1000", 1),
    ("We found 3 cases. Thus the answer is 42.", "42", 0), ("Therefore, the answer is: -7", "-7", 1),
    ("so the answer is 41", "42", 0),
    # signs, fractions, decimals, leading zeros
    ("-12", "-12", 1), ("\u221212", "-12", 1), ("-12", "12", 0), (r"\dfrac{84}{12}", "7", 1),
    (r"-\frac{6}{3}", "-2", 1), (r"\frac{1}{2}", "0", 0), ("14/2", "7", 1), ("42.0", "42", 1), ("42.5", "42", 0),
    ("007", "7", 1), ("070", "7", 0), (r"\boxed{1\,000}", "1000", 1),
])
def test_integer_gold_compares_numbers(prediction, gold, expected):
    assert scoring.score_answer(prediction, gold) == (float(expected), "integer_match")


@pytest.mark.parametrize("prediction", [
    r"2^{10}", r"\sqrt{16}", "5 or 6", "x = 5, y = 6", "1, 2", "12 345 6", r"5\sqrt{2}", "2 pi", r"1000^{3}",
    "x^2 + 1", "(5)", "", "1" * 5000, "5!", r"3\sqrt{5}",
])
def test_not_one_number(prediction):
    assert scoring.read_number(prediction) is None


def test_integer_gold_falls_back_to_math_verify_for_expressions():
    assert scoring.score_answer(r"2^{10}", "1024") == (1.0, "math_verify")
    # an equation's right side, as math_verify reads it (the number reading drops only a leading name)
    assert scoring.score_answer("a+b = 17", "17") == (1.0, "math_verify")
    assert scoring.score_answer(r"6 \times 7 = 42", "42") == (1.0, "math_verify")
    assert scoring.score_answer(r"\binom{5}{2}", "10") == (1.0, "math_verify")
    assert scoring.score_answer("5!", "120") == (1.0, "math_verify")  # a factorial, not "5" with an exclamation mark
    assert scoring.score_answer(r"\sqrt{2}", "1") == (0.0, "math_verify")


@pytest.mark.parametrize("reply", [
    '{"name": "bash", "arguments": {"command": ""}}',
    '{"name": "bash", "arguments": {"command": "   \\n\\t "}}',
    '{"name": "bash", "arguments": "{\\"command\\": \\" \\"}"}',
    '{"name": "bash", "arguments": {"command": " "}} }}',  # the relaxed pattern too
])
def test_blank_bash_command_is_no_action(reply):
    assert actions.parse_action(reply) is None


# ---- scoring in worker processes

def test_isolated_scoring_agrees_with_score_answer_and_survives_a_hang(monkeypatch):
    scoring.shutdown_scorer_pool()
    try:
        for prediction, gold in [(r"\frac{1}{2}", "0.5"), (r"1\,000", "1000"), ("red", "blue"), (None, "1")]:
            expected = scoring.score_answer(prediction, gold)
            assert asyncio.run(scoring.score_answer_isolated(prediction, gold)) == expected
        (worker,) = scoring._scorer_pool().workers()  # calls one after another share one worker
        assert worker.process.poll() is None
        maps = open(f"/proc/{worker.process.pid}/maps").read()
        assert "libtorch" not in maps and "/vllm/" not in maps  # a light worker: neither torch nor vLLM loaded
        # sympy alone runs for minutes on this answer, holding the GIL; the worker is killed at the limit, and a
        # fresh one that keeps at it too marks the answer's timeout (the model's, not the machine's)
        monkeypatch.setattr(scoring, "SCORE_TIMEOUT_S", 5.0)
        monkeypatch.setattr(scoring, "SCORE_RETRY_FACTOR", 1.0)
        started = time.monotonic()
        assert asyncio.run(scoring.score_answer_isolated("2^{2001^{2000}}", "1")) == (0.0, "answer_timeout")
        assert time.monotonic() - started < 60  # both limits and a fresh worker's start-up, not minutes of sympy
        assert worker.process.poll() is not None  # killed ...
        (replacement,) = scoring._scorer_pool().workers()  # ... and replaced
        assert asyncio.run(scoring.score_answer_isolated("42", "42")) == (1.0, "integer_match")
        # a worker that dies while scoring gives score_error, not an exception
        threading.Timer(1.0, replacement.process.kill).start()
        assert asyncio.run(scoring.score_answer_isolated("2^{2001^{2000}}", "1")) == (0.0, "score_error")
        assert asyncio.run(scoring.score_answer_isolated("-3", "-3")) == (1.0, "integer_match")
        # shutting down kills every worker
        workers = scoring._scorer_pool().workers()
        scoring.shutdown_scorer_pool()
        assert workers and all(w.process.poll() is not None for w in workers)
    finally:
        scoring.shutdown_scorer_pool()


def test_scoring_imports_nothing_heavy():
    # the scorer workers run `python agentic_es/scoring.py`: neither torch nor vLLM, and math_verify only on first
    # comparison
    code = "import sys; from agentic_es import scoring; print(sorted({'torch', 'vllm', 'math_verify', 'sympy', 'common'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], cwd=Path(scoring.__file__).parents[1], capture_output=True,
                            text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_the_algorithm_modules_import_neither_vllm_nor_math_verify_and_no_import_hook():
    # a TP worker imports common (the worker extension): it must not pull in vLLM's layers or the grader with it
    code = ("import sys; hooks = len(sys.meta_path); import common; from agentic_es import sandbox, scoring, digests; "
            "print(sorted({'vllm', 'math_verify', 'sympy'} & set(sys.modules)), len(sys.meta_path) - hooks)")
    result = subprocess.run([sys.executable, "-c", code], cwd=Path(scoring.__file__).parents[1], capture_output=True,
                            text=True, check=True, env={k: v for k, v in os.environ.items()
                                                        if k != "ES_KEEP_CPU_LINEAR_WEIGHTS"})
    assert result.stdout.strip() == "[] 0"
