"""A peer's test suite: cases from math-verify's own tests (huggingface/Math-Verify, tests/: number extraction,
fractions, LaTeX notation, percentages, sets and intervals, relations, matrices, answers at the end of a solution,
string-like answers, trailing punctuation, mixed numbers), each written as the agent writes its answer (a
`Final answer:` line, a box) and run through the production path: extract_final_answer, then score_answer against
the case's gold. The project agrees with math-verify's verdict on at least 95% of them; where it does not, the case
is kept in DISAGREEMENTS with the project's score and the rule of docs/scoring.md that decides it."""

import pytest

from agentic_es import scoring

# (gold as math-verify's test writes it, the agent's answer, math-verify's verdict)
NUMBERS = [
    ("-5", "Final answer: -5", 1),
    ("7425000", "Final answer: 7,425,000", 1),
    ("1000", "Final answer: 1 000", 1),
    ("1000", "Final answer: 1000.0", 1),
    ("1000.0", "Final answer: 1,000.0", 1),
    ("1000.99", "Final answer: 1000,99", 1),
    ("0.4", "Final answer: .4", 1),
    ("1000.99", "Final answer: 1,000.99", 1),
    ("1000.99", "Final answer: $1,000.99", 1),
    ("1000.99", "Final answer: 1,000.99$", 1),
    ("1000.99", "Final answer: the number is not 10 which is 1,000.99€", 1),
    ("1000.99", "Final answer: so the number is 10 which is 1,000.99m²", 1),
    ("1000.99", "Final answer: not it's not 10 it's 1,000.99m²", 1),
    ("2", "Final answer: AZYUK2A", 0),
    ("10/9", r"Final answer: \frac{10}{9}", 1),
    ("-10/9", r"Final answer: -\frac{10}{9}", 1),
]
SETS = [
    ("$[0,1)$", "Final answer: $[0,1)$", 1),
    ("$[0,9)$", "Final answer: $[0,1)$", 0),
    ("$(0,9)$", "Final answer: $[0,9)$", 0),
    ("$1$", "Final answer: $-[0,1)$", 0),
    ("$-2,1$", r"Final answer: \boxed{-2,1}", 1),
    (r"$\{1\pm\sqrt{5},-2\}$", r"Final answer: \boxed{\{1\pm\sqrt{5},-2\}}", 1),
    (r"$[-1, -\frac{1}{2}) \cup (-\frac{1}{2}, 0) \cup (0, 1) \cup (1, \infty)$",
     r"Final answer: \boxed{[-1, -\tfrac12) \cup (-\tfrac12, 0) \cup (0, 1) \cup (1, \infty)}", 1),
    (r"$(2, 12) \cup (12, 102)$", r"Final answer: $x \in \boxed{(2,12) \cup (12,102)}$", 1),
    (r"$(3,1)$", r"Final answer: ${1,3}$", 0),
    (r"$(1,3)$", r"Final answer: ${1,3}$", 1),
    (r"$\boxed{1}\boxed{2}$", r"Final answer: $\boxed{1,2}$", 1),
    (r"$[-4,0]$", r"Final answer: \[ \boxed{[-4, 0]} \]", 1),
    ("$(-6, 10)$", r"Final Answer: The final answer is \((-6, 10)\). I hope it is correct.", 1),
    ("$[0,1)$", "Final Answer: The final answer is $(0, 1)$. I hope it is correct.", 0),
    ("$(7,6)$", "Final answer: the ordered pair is $(7, 6)$", 1),
    (r"$(\tfrac{27}{8},\tfrac{15}{8})$", "Final Answer: The final answer is $(0, 0)$. I hope it is correct.", 0),
]
LATEX = [
    ("$9$", r"Final answer: \[ 9 \]", 1),
    ("$9$", "Final answer: $ 9 $", 1),
    ("$9$", "Final answer: $$ 9 $$", 1),
    ("$9$", r"Final answer: \( 9 \)", 1),
    ("$10$", r"Final answer: \( (9+1) \)", 1),
    ("$9$", "Final answer: $ \n 9 \n $", 0),  # inline math over several lines
    ("$9$", "Final answer:\n\\[\n9\n\\]", 1),  # display math on the lines below
    ("$9$", "Final answer:\n$$\n9\n$$", 1),
    ("$1/3$", r"Final answer: $\frac13 $", 1),
    ("$1$", r"Final answer: $\frac3{3} $", 1),
    (r"$\sqrt{3}$", r"Final answer: $\sqrt3 $", 1),
    ("$1/3$", r"Final answer: $\cfrac{1}{3} $", 1),
    ("$1/3$", r"Final answer: $\dfrac{1}{3} $", 1),
    ("$1/3$", r"Final answer: $\tfrac{1}{3} $", 1),
    ("$1/3$", "Final answer: $ 1/3 $", 1),
    ("$1/3$", r"Final answer: $\left( \frac{1}{3} \right)$", 1),
    ("$1/3$", r"Final answer: $\boxed{\frac{1}{3}}$", 1),
    ("$1/3$", r"Final answer: $\frac{1}{3} \text{meters}$", 1),
    ("$1/3$", r"Final answer: $\frac{1}{3} \textbf{meters}$", 1),
    ("$1/3$", r"Final answer: $k = \frac{1}{3}$", 1),
    ("$2-2p$", r"Final answer: $x-p=\boxed{2-2p}$.", 1),
    (r"$(3, \frac{\pi}{2})$", r"Final answer: $\boxed{\left( 3, \frac{\pi}{2} \right)}$.", 1),
    (r"$\frac{14}{3}$", r"Final answer: $2+\frac{5}{3}+1=\boxed{\frac{14}{3}}$", 1),
    (r"$\text{Evelyn}$", r"Final answer: $\boxed{\text{Evelyn}}$ is our answer.", 1),
    (r"$90^\circ$", r"Final answer: the angle between the lines is $\boxed{90^\circ}.$", 1),
    (r"$3\sqrt{13}$", r"Final answer: \sqrt{117} = \boxed{3\sqrt{13}}.", 1),
    (r"$\frac{3}{56}$", r"Final answer: \[p(8) = \frac{q(8) + 8}{8^2 - 1} = \boxed{\frac{3}{56}}.\]", 1),
    (r"$15\mbox{ cm}^2$", r"Final answer: $$\frac{1}{2}\times 3 \times 10 = \boxed{15\mbox{ cm}^2}.$$", 1),
    ("$9$", r"Final answer: $129^{34}+96^{38} \equiv \boxed{9} \pmod{11}.$", 1),
    ("$204_5$", r"Final answer: a quotient of $\boxed{204_5}$.", 1),
    ("$(6,31,-1)$", r"Final answer: $(p,q,r) = \boxed{(6,31,-1)}.$", 1),
    (r"$1 \pm \sqrt{19}$", r"Final answer: $x = \boxed{1 \pm \sqrt{19}}.$", 1),
    (r"$3 \pm 2 \sqrt{2}$", r"Final answer: the roots are $x = \boxed{3 \pm 2 \sqrt{2}}.$", 1),
    (r"$f(2) < f(1) < f(4)$", r"Final answer: Hence, $\boxed{f(2) < f(1) < f(4)}.$", 1),
    (r"$2 \sin b \cos a$", r"Final answer: \[\sin (a + b) - \sin (a - b) = \boxed{2 \sin b \cos a}.\]", 1),
    (r"$\frac{\pi r}{h+r}$", r"Final answer: The answer is $\boxed{\frac{\pi r}{h+r}}$.", 1),
    ("$125$ miles", r"Final answer: The distance is $\boxed{125\textnormal{ miles}}.$", 1),
    (r"$\sqrt{2}+\sqrt{5}$", r"Final answer: The answer is $\boxed{\sqrt 2+\sqrt 5}$", 1),
    (r"$\frac{9}{4}\pi$", r"Final answer: Therefore $\boxed{\frac94\pi}$.", 1),
    (r"$\text{C}$", r"Final answer: $\boxed{\text{(C)}}.$", 1),
    (r"$\text{E}$", "Final answer: $E$", 1),
    ("$1112112_3$", r"Final answer: \(\boxed{1112122_3}\)", 0),
]
PERCENTAGES = [
    (r"$28\%$", "Final answer: 28 percent", 1),
    (r"$28\%$", "Final answer: 28 pct", 1),
    (r"$28\%$", "Final answer: 28 %", 1),
    (r"$28\%$", "Final answer: $28$ %", 1),
    (r"$28\%$", "Final answer: $28$ percent", 1),
    (r"$28\%$", r"Final answer: $\boxed{28}$ pct", 1),
    (r"$28\%$", r"Final answer: \boxed{28 pct}", 1),
    (r"$28\%$", r"Final answer: \boxed{28 percent}", 1),
    (r"$28\%$", r"Final answer: \boxed{28 percentage}", 1),
    (r"$28\%$", "Final answer: 28", 1),
    ("$0.28$", "Final answer: 28", 0),
    ("$28/100$", "Final answer: 28", 0),
    ("$28$", "Final answer: 28/100", 0),
    (r"$\frac{28}{100}$", "Final answer: 28", 0),
    (r"$28*\frac{1}{100}$", "Final answer: 28", 0),
    (r"$20\%$", r"Final answer: $\frac{1 }{5 }=\boxed{20 \%}$", 1),
    (r"$100%$", "Final answer: the minimum error in the measurement of the position increases by 100%.", 1),
    ("$100$", "Final Answer: The final answer is $100$. I hope it is correct.", 1),
]
RELATIONS = [
    ("$x >= 5$", r"Final answer: Therefore $x \geq 5$ is the solution.", 1),
    ("$x < 3$", r"Final answer: We find that $x \lt 3$.", 1),
    (r"$x \leq 2$", "Final answer: Thus $x <= 2$ is our answer.", 1),
    ("$x > 5$", r"Final answer: Therefore $x \gt 5$ is the solution.", 1),
    ("$x != 3$", r"Final answer: We find that $x \neq 3$.", 1),
    ("$x > 5$", "Final answer: Therefore $x < 5$ is the solution.", 0),
    (r"$x \geq 5$", r"Final answer: The solution is $x \leq 5$", 0),
    (r"$x \neq 5$", "Final answer: The solution is $x != 5$", 1),
    (r"$x \leq 5$", r"Final answer: $5 \geq x$", 1),
    (r"$x \geq 5$", r"Final answer: $5 \leq x$", 1),
    ("$x = 11$", "Final answer: $x = 5+5+1 = 7 =11$", 1),
    ("$7 = 11a+c$", "Final answer: $11a+c$", 0),
    ("$x = 1/3$", r"Final answer: $x = 5+5+1 = 1/3 \approx 11$", 1),
    ("$11$", "Final answer: $x=11$", 1),
    ("$11$", r"Final answer: $x\approx11$", 1),
    ("$1/3$", r"Final answer: $x=1/3\approx1.3$", 1),
    ("$x < 1$", "Final answer: $-x > -1$", 1),
    ("$x < 1$", "Final answer: $x > -1$", 0),
    ("$x <= 1$", "Final answer: $-x >= -1$", 1),
    ("$a +3z = 0$", "Final answer: $0$", 0),
    (r"$1 = \zzz = x = 0$", "Final answer: $0$", 1),
    ("$2x + z = 1$", "Final answer: $1$", 0),
    ("$a^2 + b = 0$", "Final answer: $0$", 0),
    ("$k=1$", "Final answer: $1$", 1),
    ("$1$", "Final answer: $k=1$", 1),
    ("$z = 1 + 1 = 2$", "Final answer: $z = 3+3 = 2$", 1),
    ("$2x+4y-3=0$", r"Final answer: $y=-\frac{1}{2}x+\frac{3}{4}$", 1),
    ("$x^2/4 + y^2/3 = 1$", "Final answer: $x^2/16 + y^2/12 = 1/4$", 1),
    ("$34x+45y-20z+100=0$", "Final answer: $-34x-45y+20z-100=0$", 1),
    ("$x-2y+z-1=0$", r"Final answer: $$-1(x-1)+2(y-1)+1(z-1)=0\Rightarrow\boxed{x-2y+z-1=0}.$$", 1),
    (r"$-2 \le x \le 7$", r"Final answer: $x \in [-2,7]$", 1),
]
MATRICES = [
    (r"$\begin{pmatrix}1 & 0 \\ 0 & 1\end{pmatrix}$",
     r"Final answer: The identity matrix is $ \begin{pmatrix}1 & 0 \\ 0 & 1\end{pmatrix} $.", 1),
    (r"$\begin{bmatrix}0 & 0 \\0 & 0\end{bmatrix}$",
     r"Final answer: Here is a zero matrix: $ \begin{pmatrix}0 & 0 \\0 & 0\end{pmatrix} $", 1),
    (r"$\begin{pmatrix}1 & 2 \\3 & 4\end{pmatrix}$",
     r"Final answer: $ \left[\begin{array}{cc}1 & 2 \\3 & 4\end{array}\right] $", 1),
    (r"$\begin{pmatrix}\frac{1}{2} & \frac{3}{4} \\ \frac{5}{6} & \frac{7}{8}\end{pmatrix}$",
     r"Final answer: $ \begin{pmatrix}\frac{1}{2} & \frac{3}{4} \\ \frac{5}{6} & \frac{7}{8}\end{pmatrix} $", 1),
    (r"$\begin{pmatrix}1 & 2 \\ 3 & 4\end{pmatrix}$",
     r"Final answer: The matrix is $\begin{pmatrix}1 & 2 \\ 3 & 5\end{pmatrix}$", 0),
]
EXPRESSIONS = [
    (r"$\frac{1}{12}$", "Final answer: $0.0833333333333333$", 1),
    (r"$(1,\frac{9}{2})$", "Final answer: $(1,4.5)$", 1),
    (r"$\frac{x+2}{7}$", r"Final answer: $\frac{x}{7}+\frac{2}{7}$", 1),
    (r"$\tan^2(y)+1$", r"Final answer: $\sec^2(y)$", 1),
    (r"$\frac{\sqrt{\sqrt{11}+\sqrt{194}}}{15+2\sqrt{33}}$",
     r"Final answer: $\frac{\sqrt{\sqrt{11}+\sqrt{194}}}{2\sqrt{33}+15}$", 1),
    ("$(a+5)(b+2)$", "Final answer: $(+5)(b+2)$", 0),
    ("$2$", r"Final answer: $\frac{1+\sqrt{5}}{2}$", 0),
    ("$4$", r"Final answer: $\frac{34}{16}+\frac{\sqrt{1358}}{16}$", 0),
    (r"$1\sqrt{19}$", "Final answer: $1$", 0),
    ("$x+2n+1$", "Final answer: $x+1$", 0),
    ("$4$", r"Final answer: $4\sqrt{2}$", 0),
    (r"$\text{13}$", "Final answer: $13$", 0),
]
SOLUTION_ENDINGS = [
    ("$2/3$", "Final answer: Therefore, the probability that Alice wins the game is 2/3.", 1),
    ("$12$", "Final answer: there are 12 distinct arithmetic sequences that meet the three given conditions.", 1),
    ("$16386.20$", r"Final answer: $\boxed{\$16,\!386.20}$", 1),
    ("$120$", "Final Answer: The volume of $ABCDEFGH$ is 120. I hope it is correct.", 1),
    ("12000023", "Final Answer: The final answer is 12,000,023. I hope it is correct.", 1),
    ("$14916$", r"Final Answer: The smallest possible value of $N$ is $\boxed{14{,}916}$. I hope it is correct.", 1),
    (r"$\left(\frac{1}{5},\frac{1}{6}\right)$",
     r"Final answer: $(p,q) = \boxed{\left( \frac{1}{5}, \frac{1}{6} \right)}.$", 1),
    ("$16386.17$", r"Final answer: Paula's investment is worth $\boxed{\$16386.17}$ after 5 years.", 1),
    ("$34$", "Final Answer: The largest $n$ is 34.", 1),
    ("$19$", "Final Answer: The maximum number of points that could be in the domain of $f(x)$ is 19.", 1),
    ("$3$", "Final Answer: Jane started growing Sphere 3 hours ago. I hope it is correct.", 1),
    ("$7.78$", "Final Answer: The final answer is 7.78.", 1),
    ("$10455$", "Final Answer: The final answer is $10,455$. I hope it is correct.", 1),
    ("11111111100", r"Final answer: is $\boxed{11,\! 111,\! 111,\! 100}$", 1),
    ("32349", r"Final answer: is $\boxed{32,\! 349}$", 1),
    ("32349", r"Final answer: is $\boxed{32, 349}$", 0),
    ("$189$", "Final answer: Thus, the area of the trapezoid is \\(\\boxed{189}\\) square centimeters.", 1),
]
STRINGS = [
    ("$n=1, 2, 3$", "Final answer: $n=1, 2, 3$", 1),
    ("$n=2, 3, 4$", "Final answer: $n=1, 2, 3$", 0),
    ("$D = (0, 1)$", "Final answer: $D = (0, 1)$", 1),
    ("$D = (0, 1)$", "Final answer: $D = (0, 1.5)$", 0),
    ("$19, 46, and 82$", r"Final answer: $19, 46, \text{ and } 82$", 1),
    ("$19, 46, and 82$", "Final answer: $21, 36, and 82$", 0),
    (r"$1 - \frac{1}{\mathrm{e}}$", r"Final answer: $1 - \frac{1}{\mathrm{e}}$", 1),
    (r"$1 - \frac{1}{\mathrm{e}}$", r"Final answer: $1 + \frac{1}{\mathrm{e}}$", 0),
    (r"$\pm 2021$", "Final answer: $2021$", 0),
    (r"$\pm 2021$", "Final answer: ${-2021, 2021}$", 1),
    ("$12:00$", "Final answer: $1:00$", 0),
    ("$12:00$", "Final answer: $12:00$", 1),
]
PUNCTUATION = [
    (r"$\frac{1}{3}$", r"Final answer: $\frac{1}{3}.$", 1),
    (r"$\frac{1}{3}$", r"Final answer: The answer is $\frac{1}{3}.$", 1),
    (r"$\frac{1}{3}$", r"Final answer: $$\frac{1}{3}.$$", 1),
    (r"$\frac{1}{3}$", r"Final answer: \[\frac{1}{3}.\]", 1),
    (r"$\frac{1}{3}$", r"Final answer: $\frac{1}{3},$", 1),
    (r"$\frac{1}{3}$", r"Final answer: $\frac{1}{3} .$", 1),
    (r"$\sqrt{2}$", r"Final answer: $\sqrt{2}.$", 1),
    ("$(1,2)$", "Final answer: $(1,2).$", 1),
    ("$5$", r"Final answer: $5 \text{ cm}.$", 1),
    ("$42$", "Final answer: $42.$", 1),
    ("$2$", "Final answer: $2^{10}.$", 0),
    ("$1$", "Final answer: The answer is $1/3.$", 0),
    ("$1, 2, 3$", "Final answer: $1, 2, 3, ...$", 0),
]
MIXED_NUMBERS = [
    ("40/9", "Final answer: 4 4/9", 1),
    ("4", "Final answer: The answer is 4 4/9.", 0),
    ("103/9", "Final answer: 11 + 4/9", 1),
    ("95/9", "Final answer: 11 + 4/9", 0),
    ("5", "Final answer: 10/2", 1),
]
CASES = (NUMBERS + SETS + LATEX + PERCENTAGES + RELATIONS + MATRICES + EXPRESSIONS + SOLUTION_ENDINGS + STRINGS
         + PUNCTUATION + MIXED_NUMBERS)

# (gold, answer): (the project's score, the rule of docs/scoring.md that decides it)
DISAGREEMENTS = {
    ("1000.99", "Final answer: 1000,99"): (0, "a comma between digits is a digit group or separates values (rule 1): "
                                             "1000, 99 is two values, a hedge; no decimal comma"),
    ("1000.99", "Final answer: so the number is 10 which is 1,000.99m²"): (
        0, "rule 1: the first value after the marker is committed (10); what follows is a note (rule 2)"),
    (r"$\frac{1}{12}$", "Final answer: $0.0833333333333333$"): (
        0, "a truncated decimal never equals a gold without a finite decimal (Comparing)"),
    ("40/9", "Final answer: 4 4/9"): (0, "two values side by side are listed (rule 3): 4 and 4/9, a hedge; "
                                        "mixed numbers are not read"),
    ("1000.99", "Final answer: not it's not 10 it's 1,000.99m²"): (
        0, "rule 1: outside math a letter right after a number is a variable (2x), so this is 1000.99 m^2; a unit is "
           "a word or a spaced letter after a number (1,000.99 m²)"),
    (r"$\text{13}$", "Final answer: $13$"): (
        1, "math-verify 0.9.0, the installed version that decides here, compares them equal; the case comes from a "
           "later math-verify that reads \\text{13} as a word"),
}


def project_score(gold, answer):
    return scoring.score_answer(scoring.extract_final_answer(answer), gold)[0]


@pytest.mark.parametrize("gold, answer, verdict", CASES)
def test_peer_case_through_the_production_path(gold, answer, verdict):
    expected, _ = DISAGREEMENTS.get((gold, answer), (verdict, None))
    assert project_score(gold, answer) == expected


def test_agreement_with_math_verify_is_at_least_95_percent():
    verdicts = {(gold, answer): verdict for gold, answer, verdict in CASES}
    assert len(CASES) >= 80 and len(verdicts) == len(CASES)  # no case twice
    for case, (score, reason) in DISAGREEMENTS.items():  # each disagreement is one, with its reason
        assert case in verdicts and score != verdicts[case] and reason
    assert 1 - len(DISAGREEMENTS) / len(CASES) >= 0.95
