"""The compute task: competition-style math problems that a program solves and whose prompt does not solve them for
the model (no command, no hint of one). Families of problems (a modular power, the primes in an interval, lattice
paths around blocked points, ...), each with difficulty parameters per level and its gold computed exactly here;
three splits per level: "train", "heldout" (parameters no training problem has, of the training families) and
"families" (whole families training never sees). Every set is a fixed function of (split, level): the run seed
changes only which problems a generation draws (common.case_batch), never the problems."""

from __future__ import annotations

import functools
import json
import math
import random
from dataclasses import dataclass
from typing import Callable

from agentic_es import stage


LEVELS = (1, 2, 3)  # 1: numbers in the hundreds, exponents <= 60; 2: thousands; 3: competition sizes
SPLIT_SIZES = {"train": 512, "heldout": 128, "families": 128}  # problems per level: 512 > 12 generations x 32
PREFIX = ("Solve the following math problem step by step. The last line of your response should be of the form "
          "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n")  # DAPO's own wording
SUFFIX = "\n\nRemember to put your answer on its own line after \"Answer:\"."
PRIME_MODULUS = 1_000_000_007  # the remainder asked for where an exact count would run to hundreds of digits
MAX_DRAWS = 100_000  # a family whose parameter space is too small for a split stops with an error, never loops


@dataclass(frozen=True)
class Family:
    """One kind of problem: `draw(rng, level)` its parameters (json-able), `answer(params)` the exact gold,
    `body(params)` the problem in words, `size(params)` the number that makes it hard (grows with the level)."""
    name: str
    draw: Callable[[random.Random, int], dict]
    answer: Callable[[dict], int]
    body: Callable[[dict], str]
    size: Callable[[dict], int]


def pick(level: int, by_level: dict):
    """The level's entry of a family's difficulty table (levels 1..3)."""
    if level not in by_level:
        raise stage.DataError(f"compute_level={level} is not a level of the compute task; levels: {LEVELS}")
    return by_level[level]


# ---- shared arithmetic ---------------------------------------------------------------------------------------

def digit_sum(n: int, base: int = 10) -> int:
    """The sum of n's digits in `base`, by halving n at powers of the base: no decimal string (Python refuses one of
    more than 4300 digits) and no quadratic digit-by-digit loop on numbers of tens of thousands of digits."""
    if n < base ** 32:
        total = 0
        while n:
            n, d = divmod(n, base)
            total += d
        return total
    powers = [base ** 32]  # base^(32 * 2^i): the low half below it holds its digits, leading zeros add nothing
    while powers[-1] * powers[-1] <= n:
        powers.append(powers[-1] * powers[-1])
    high, low = divmod(n, powers[-1])
    return digit_sum(high, base) + digit_sum(low, base)


def primes_up_to(n: int) -> list[int]:
    """The primes <= n (sieve of Eratosthenes)."""
    if n < 2:
        return []
    sieve = bytearray([1]) * (n + 1)
    sieve[0:2] = b"\x00\x00"
    for p in range(2, math.isqrt(n) + 1):
        if sieve[p]:
            sieve[p * p::p] = bytes(len(range(p * p, n + 1, p)))
    return [i for i, is_prime in enumerate(sieve) if is_prime]


def factorize(n: int) -> dict[int, int]:
    """n's prime factorization by trial division (the generator draws n whose factors are small, or n < 10^6)."""
    factors, p = {}, 2
    while p * p <= n:
        while n % p == 0:
            factors[p] = factors.get(p, 0) + 1
            n //= p
        p += 1 if p == 2 else 2
    if n > 1:
        factors[n] = factors.get(n, 0) + 1
    return factors


def binomial(n: int, k: int, modulus: int | None, factorials=None) -> int:
    """C(n, k), exact or modulo the prime `modulus` (then from `factorials`: (n!, inverse n!) tables mod it)."""
    if k < 0 or k > n:
        return 0
    if modulus is None:
        return math.comb(n, k)
    fact, inverse = factorials
    return fact[n] * inverse[k] % modulus * inverse[n - k] % modulus


@functools.lru_cache(maxsize=4)
def factorial_tables(n: int, prime: int) -> tuple[list[int], list[int]]:
    """(k!, inverse k!) modulo the prime for k = 0..n (cached: a level's problems share one table)."""
    fact = [1] * (n + 1)
    for i in range(1, n + 1):
        fact[i] = fact[i - 1] * i % prime
    inverse = [1] * (n + 1)
    inverse[n] = pow(fact[n], prime - 2, prime)
    for i in range(n, 0, -1):
        inverse[i - 1] = inverse[i] * i % prime
    return fact, inverse


def scaled(coefficient: int, term: str) -> str:
    """A coefficient written before its term as in print: 3a_{n-1}, a_{n-1} for 1."""
    return term if coefficient == 1 else f"{coefficient}{term}"


def remainder_phrase(modulus: int | None) -> str:
    return "" if modulus is None else f" Find the remainder when this number is divided by ${modulus}$."


# ---- the training families -----------------------------------------------------------------------------------

def draw_digit_property(rng, level):
    span, width = pick(level, {1: ((100, 999), (150, 500)), 2: ((1_000, 99_999), (2_000, 8_000)),
                               3: ((100_000, 9_999_999), (20_000, 90_000))})
    w = rng.randint(*width)
    lo = rng.randint(span[0], span[1] - w)
    return {"low": lo, "high": lo + w, "divisor": rng.randint(3, 13), "digit_modulus": rng.randint(3, 11)}


def answer_digit_property(p):
    first = -(-p["low"] // p["divisor"]) * p["divisor"]
    return sum(1 for n in range(first, p["high"] + 1, p["divisor"]) if digit_sum(n) % p["digit_modulus"] == 0)


DIGIT_PROPERTY = Family(
    "digit_property_count", draw_digit_property, answer_digit_property,
    lambda p: (f"How many integers $n$ with ${p['low']} \\le n \\le {p['high']}$ are divisible by ${p['divisor']}$ "
               f"and have a sum of decimal digits that is divisible by ${p['digit_modulus']}$?"),
    lambda p: p["high"] - p["low"])


def draw_modular_power(rng, level):
    base, exponent, modulus = pick(level, {1: ((2, 999), (10, 60), (100, 999)),
                                           2: ((1_000, 99_999), (1_000, 9_999), (1_000, 9_999)),
                                           3: ((10**5, 10**9), (10**6, 10**7), (10**8, 10**9))})
    return {"base": rng.randint(*base), "exponent": rng.randint(*exponent), "modulus": rng.randint(*modulus)}


MODULAR_POWER = Family(
    "modular_power", draw_modular_power, lambda p: pow(p["base"], p["exponent"], p["modulus"]),
    lambda p: f"Find the remainder when ${p['base']}^{{{p['exponent']}}}$ is divided by ${p['modulus']}$.",
    lambda p: p["exponent"])


def draw_power_digit_sum(rng, level):
    base, exponent = pick(level, {1: ((2, 9), (20, 60)), 2: ((2, 99), (200, 2_000)),
                                  3: ((2, 99), (10_000, 40_000))})
    return {"base": rng.randint(*base), "exponent": rng.randint(*exponent)}


POWER_DIGIT_SUM = Family(
    "power_digit_sum", draw_power_digit_sum, lambda p: digit_sum(p["base"] ** p["exponent"]),
    lambda p: f"What is the sum of the decimal digits of ${p['base']}^{{{p['exponent']}}}$?",
    lambda p: p["exponent"])


def draw_smooth_number(rng, level):
    """n with every prime factor below a bound: at level 3 a number of 13 to 15 digits (no slow factoring)."""
    low, high = pick(level, {1: (100, 999), 2: (1_000, 999_999), 3: (10**12, 10**15)})
    if level < 3:
        return {"n": rng.randint(low, high)}
    small_primes = primes_up_to(997)
    while True:
        n = 1
        while n < low:
            n *= rng.choice(small_primes[:10] if rng.random() < 0.6 else small_primes)
        if n <= high:
            return {"n": n}


def divisor_count(n: int) -> int:
    return math.prod(e + 1 for e in factorize(n).values())


def divisor_sum(n: int) -> int:
    return math.prod((p ** (e + 1) - 1) // (p - 1) for p, e in factorize(n).items())


DIVISOR_COUNT = Family(
    "divisor_count", draw_smooth_number, lambda p: divisor_count(p["n"]),
    lambda p: f"How many positive divisors does ${p['n']}$ have?", lambda p: p["n"])

DIVISOR_SUM = Family(
    "divisor_sum", draw_smooth_number, lambda p: divisor_sum(p["n"]),
    lambda p: f"What is the sum of all positive divisors of ${p['n']}$?", lambda p: p["n"])


def draw_recurrence(rng, level):
    index, modulus = pick(level, {1: ((10, 60), (100, 999)), 2: ((1_000, 9_999), (1_000, 9_999)),
                                  3: ((10**6, 10**7), (10**6, 10**9))})
    return {"a0": rng.randint(0, 9), "a1": rng.randint(1, 9), "p": rng.randint(1, 7), "q": rng.randint(1, 7),
            "index": rng.randint(*index), "modulus": rng.randint(*modulus)}


def answer_recurrence(p):
    """a_N mod m from the matrix [[p, q], [1, 0]] raised to the N-th power by squaring."""
    m = p["modulus"]

    def multiply(x, y):
        return [[(x[i][0] * y[0][j] + x[i][1] * y[1][j]) % m for j in range(2)] for i in range(2)]

    result, square, n = [[1, 0], [0, 1]], [[p["p"], p["q"]], [1, 0]], p["index"]
    while n:
        if n & 1:
            result = multiply(result, square)
        square, n = multiply(square, square), n >> 1
    # (a_{N+1}, a_N) = M^N (a_1, a_0)
    return (result[1][0] * p["a1"] + result[1][1] * p["a0"]) % m


RECURRENCE = Family(
    "recurrence_mod", draw_recurrence, answer_recurrence,
    lambda p: (f"A sequence is defined by $a_0 = {p['a0']}$, $a_1 = {p['a1']}$, and "
               f"$a_n = {scaled(p['p'], 'a_{n-1}')} + {scaled(p['q'], 'a_{n-2}')}$ for all $n \\ge 2$. Find the "
               f"remainder when $a_{{{p['index']}}}$ is divided by ${p['modulus']}$."),
    lambda p: p["index"])


def draw_prime_interval(rng, level):
    span, width = pick(level, {1: ((100, 999), (100, 500)), 2: ((1_000, 99_999), (1_000, 5_000)),
                               3: ((10**6, 10**8), (10_000, 50_000))})
    w = rng.randint(*width)
    lo = rng.randint(span[0], span[1] - w)
    return {"low": lo, "high": lo + w}


def primes_in_interval(low: int, high: int) -> int:
    """The primes in [low, high] by a segmented sieve: the base primes up to sqrt(high) strike the window."""
    window = bytearray([1]) * (high - low + 1)
    for p in primes_up_to(math.isqrt(high)):
        start = max(p * p, -(-low // p) * p)
        window[start - low::p] = bytes(len(range(start, high + 1, p)))
    return sum(window[max(0, 2 - low):])


PRIME_INTERVAL = Family(
    "primes_in_interval", draw_prime_interval, lambda p: primes_in_interval(p["low"], p["high"]),
    lambda p: f"How many prime numbers $p$ satisfy ${p['low']} \\le p \\le {p['high']}$?",
    lambda p: p["high"])


def draw_circle(rng, level):
    return {"bound": rng.randint(*pick(level, {1: (100, 999), 2: (10_000, 999_999), 3: (10**8, 10**9)}))}


def circle_points(bound: int) -> int:
    """Integer points with x^2 + y^2 <= bound: for each x, the 2*floor(sqrt(bound - x^2)) + 1 values of y."""
    r = math.isqrt(bound)
    return sum(2 * math.isqrt(bound - x * x) + 1 for x in range(-r, r + 1))


CIRCLE = Family(
    "circle_lattice_points", draw_circle, lambda p: circle_points(p["bound"]),
    lambda p: f"How many ordered pairs of integers $(x, y)$ satisfy $x^2 + y^2 \\le {p['bound']}$?",
    lambda p: p["bound"])


def draw_blocked_paths(rng, level):
    side, blocked, modular = pick(level, {1: ((4, 9), (2, 3), False), 2: ((100, 999), (3, 5), True),
                                          3: ((10_000, 50_000), (5, 8), True)})
    width, height, count = rng.randint(*side), rng.randint(*side), rng.randint(*blocked)
    points = set()
    while len(points) < count:
        point = (rng.randint(0, width), rng.randint(0, height))
        if point not in ((0, 0), (width, height)):
            points.add(point)
    return {"width": width, "height": height, "blocked": sorted(list(q) for q in points),
            "modulus": PRIME_MODULUS if modular else None}


def answer_blocked_paths(p):
    """Paths through no blocked point, by inclusion-exclusion over the blocked points in order: f(b) = paths to b
    avoiding the earlier blocked points; the answer takes every path less those through a first blocked point."""
    m, w, h = p["modulus"], p["width"], p["height"]
    factorials = factorial_tables(1 << (w + h).bit_length(), m) if m else None  # a table for many problems

    def paths(a, b):
        dx, dy = b[0] - a[0], b[1] - a[1]
        return binomial(dx + dy, dx, m, factorials) if dx >= 0 and dy >= 0 else 0

    blocked = sorted(tuple(q) for q in p["blocked"])
    first = []
    for i, b in enumerate(blocked):
        first.append(paths((0, 0), b) - sum(first[j] * paths(blocked[j], b) for j in range(i)))
    total = paths((0, 0), (w, h)) - sum(f * paths(b, (w, h)) for f, b in zip(first, blocked))
    return total % m if m else total


BLOCKED_PATHS = Family(
    "blocked_lattice_paths", draw_blocked_paths, answer_blocked_paths,
    lambda p: ("A lattice path from $(0, 0)$ to $({width}, {height})$ consists of unit steps, each either one unit "
               "right or one unit up. How many such paths pass through none of the points {points}?{rest}").format(
        width=p["width"], height=p["height"], points=", ".join(f"$({x}, {y})$" for x, y in p["blocked"]),
        rest=remainder_phrase(p["modulus"])),
    lambda p: p["width"] + p["height"])


def draw_base_digit_sum(rng, level):
    n, base = pick(level, {1: ((100, 999), (2, 9)), 2: ((10_000, 9_999_999), (3, 16)),
                           3: ((10**15, 10**18), (11, 36))})
    return {"n": rng.randint(*n), "base": rng.randint(*base)}


BASE_DIGIT_SUM = Family(
    "base_digit_sum", draw_base_digit_sum, lambda p: digit_sum(p["n"], p["base"]),
    lambda p: (f"When ${p['n']}$ is written in base ${p['base']}$, what is the sum of its digits (each digit "
               f"taken as its value from $0$ to ${p['base'] - 1}$)?"),
    lambda p: p["n"])


def draw_polynomial_sum(rng, level):
    count, modulus = pick(level, {1: ((10, 99), (100, 999)), 2: ((1_000, 9_999), (1_000, 9_999)),
                                  3: ((10**6, 10**7), (10**6, 10**9))})
    return {"coefficients": [rng.randint(1, 9) for _ in range(4)], "count": rng.randint(*count),
            "modulus": rng.randint(*modulus)}


def answer_polynomial_sum(p):
    """sum_{k=1}^N (c3 k^3 + c2 k^2 + c1 k + c0) by the power-sum formulas."""
    n = p["count"]
    c3, c2, c1, c0 = p["coefficients"]
    s1 = n * (n + 1) // 2
    s2 = n * (n + 1) * (2 * n + 1) // 6
    return (c3 * s1 * s1 + c2 * s2 + c1 * s1 + c0 * n) % p["modulus"]


POLYNOMIAL_SUM = Family(
    "polynomial_sum_mod", draw_polynomial_sum, answer_polynomial_sum,
    lambda p: ("Let $S = \\sum_{{k=1}}^{{{n}}} \\left({polynomial}\\right)$. Find the remainder when $S$ is divided "
               "by ${m}$.").format(n=p["count"], m=p["modulus"], polynomial=" + ".join(
                   [scaled(c, t) for c, t in zip(p["coefficients"][:3], ("k^3", "k^2", "k"))]
                   + [str(p["coefficients"][3])])),
    lambda p: p["count"])


def draw_range_lcm(rng, level):
    n, modulus = pick(level, {1: ((10, 60), (100, 999)), 2: ((100, 999), (1_000, 9_999)),
                              3: ((10_000, 50_000), (10**8, 10**9))})
    return {"n": rng.randint(*n), "modulus": rng.randint(*modulus)}


def answer_range_lcm(p):
    """lcm(1..n) = the product over primes q <= n of the largest power of q not above n."""
    result = 1
    for q in primes_up_to(p["n"]):
        power = q
        while power * q <= p["n"]:
            power *= q
        result = result * power % p["modulus"]
    return result % p["modulus"]


RANGE_LCM = Family(
    "range_lcm_mod", draw_range_lcm, answer_range_lcm,
    lambda p: (f"Let $L$ be the least common multiple of the integers $1, 2, 3, \\ldots, {p['n']}$. Find the "
               f"remainder when $L$ is divided by ${p['modulus']}$."),
    lambda p: p["n"])


# ---- the held-out families (training never sees them) ---------------------------------------------------------

def draw_partitions(rng, level):
    n, modular = pick(level, {1: ((100, 199), False), 2: ((1_000, 4_999), True), 3: ((5_000, 15_000), True)})
    return {"n": rng.randint(*n), "modulus": PRIME_MODULUS if modular else None}


@functools.lru_cache(maxsize=4)
def partition_table(limit: int, modulus: int | None) -> tuple[int, ...]:
    """p(0..limit) by Euler's pentagonal number recurrence (one table for every problem of a level: a level's
    problems share their modulus, and the recurrence up to 15000 takes a second)."""
    table = [1] + [0] * limit
    for n in range(1, limit + 1):
        total, k = 0, 1
        while True:
            first = k * (3 * k - 1) // 2
            if first > n:
                break
            sign = 1 if k % 2 else -1
            total += sign * table[n - first]
            second = first + k
            if second <= n:
                total += sign * table[n - second]
            k += 1
        table[n] = total % modulus if modulus else total
    return tuple(table)


def answer_partitions(p):
    limit = max(p["n"], 199 if p["modulus"] is None else 15_000)  # the largest n of the levels of this modulus
    return partition_table(limit, p["modulus"])[p["n"]]


PARTITIONS = Family(
    "partition_count", draw_partitions, answer_partitions,
    lambda p: ("A partition of a positive integer $n$ is a way of writing $n$ as a sum of positive integers, where "
               "the order of the summands does not matter; for example, $4$ has $5$ partitions: $4$, $3 + 1$, "
               f"$2 + 2$, $2 + 1 + 1$ and $1 + 1 + 1 + 1$. How many partitions does ${p['n']}$ have?"
               f"{remainder_phrase(p['modulus'])}"),
    lambda p: p["n"])


def draw_collatz(rng, level):
    return {"n": rng.randint(*pick(level, {1: (100, 999), 2: (1_000, 999_999), 3: (10**9, 10**12)}))}


def collatz_steps(n: int) -> int:
    steps = 0
    while n != 1:
        n = n // 2 if n % 2 == 0 else 3 * n + 1
        steps += 1
    return steps


COLLATZ = Family(
    "collatz_steps", draw_collatz, lambda p: collatz_steps(p["n"]),
    lambda p: (f"Starting from $x_0 = {p['n']}$, let $x_{{k+1}} = x_k / 2$ if $x_k$ is even and "
               "$x_{k+1} = 3x_k + 1$ if $x_k$ is odd. What is the smallest $k$ such that $x_k = 1$?"),
    lambda p: p["n"])


def draw_totient_sum(rng, level):
    return {"n": rng.randint(*pick(level, {1: (100, 999), 2: (1_000, 9_999), 3: (10**5, 10**6)}))}


def totient_sum(n: int) -> int:
    """sum_{k<=n} phi(k) by Phi(n) = n(n+1)/2 - sum_{d=2}^{n} Phi(n // d), over the O(sqrt n) distinct quotients."""
    @functools.lru_cache(maxsize=None)
    def phi_sum(x):
        total, d = x * (x + 1) // 2, 2
        while d <= x:
            q = x // d
            last = x // q  # every d' in [d, last] has the same quotient q
            total -= (last - d + 1) * phi_sum(q)
            d = last + 1
        return total
    return phi_sum(n)


TOTIENT_SUM = Family(
    "totient_sum", draw_totient_sum, lambda p: totient_sum(p["n"]),
    lambda p: (f"For a positive integer $k$, let $\\varphi(k)$ be the number of integers $j$ with $1 \\le j \\le k$ "
               f"and $\\gcd(j, k) = 1$. Compute $\\varphi(1) + \\varphi(2) + \\cdots + \\varphi({p['n']})$."),
    lambda p: p["n"])


FAMILIES = {f.name: f for f in (DIGIT_PROPERTY, MODULAR_POWER, POWER_DIGIT_SUM, DIVISOR_COUNT, DIVISOR_SUM,
                                RECURRENCE, PRIME_INTERVAL, CIRCLE, BLOCKED_PATHS, BASE_DIGIT_SUM, POLYNOMIAL_SUM,
                                RANGE_LCM, PARTITIONS, COLLATZ, TOTIENT_SUM)}
HELDOUT_FAMILIES = ("partition_count", "collatz_steps", "totient_sum")
TRAIN_FAMILIES = tuple(name for name in FAMILIES if name not in HELDOUT_FAMILIES)
SPLITS = tuple(SPLIT_SIZES)
SETS = {"compute": "train", "compute_heldout": "heldout", "compute_families": "families"}  # data.TASKS, by name
EVAL_SETS = {  # what 03_eval.py evaluates after a run on the task: made here, never trained on
    "compute_heldout": "compute_heldout",  # the training families, at parameters no training problem has
    "compute_families": "compute_families",  # families training never sees
}


def set_problems(split: str, run_seed: int, learn_digits: int = 0, compute_level: int = 1) -> list[dict]:
    """A set of SETS (data.problems_from): its split of the level compute_level, the same for every run seed."""
    return problems(split, compute_level)


# ---- the splits ------------------------------------------------------------------------------------------------

def params_key(params: dict) -> str:
    return json.dumps(params, sort_keys=True)


def family_slots(families: tuple[str, ...], count: int, rng: random.Random) -> list[str]:
    """Which family each row is: rounds of every family once, each round in its own shuffled order, so that any
    prefix covers the families equally (to within one)."""
    slots = []
    while len(slots) < count:
        round_ = list(families)
        rng.shuffle(round_)
        slots += round_
    return slots[:count]


def unique_params(family: Family, level: int, stream: str, count: int, excluded: set[str]) -> list[dict]:
    """`count` distinct parameter sets of a family from its own fixed stream, none of them in `excluded`."""
    rng = random.Random(f"compute-task/{stream}/L{level}/{family.name}")
    chosen, seen = [], set(excluded)
    for _ in range(MAX_DRAWS):
        if len(chosen) == count:
            return chosen
        params = family.draw(rng, level)
        if params_key(params) not in seen:
            seen.add(params_key(params))
            chosen.append(params)
    raise stage.DataError(f"compute family {family.name} at level {level}: fewer than {count} distinct parameter sets "
                          f"outside the {len(excluded)} excluded ones")


@functools.lru_cache(maxsize=16)
def split_params(split: str, level: int) -> tuple[tuple[str, str], ...]:
    """The whole split's (family, params as JSON) in row order. "heldout" draws from another stream than "train"
    and rejects every (family, params) of the whole training split."""
    families = HELDOUT_FAMILIES if split == "families" else TRAIN_FAMILIES
    slots = family_slots(families, SPLIT_SIZES[split], random.Random(f"compute-task/order/{split}/L{level}"))
    excluded = ({name: {key for f, key in split_params("train", level) if f == name} for name in families}
                if split == "heldout" else {name: set() for name in families})
    drawn = {name: iter(unique_params(FAMILIES[name], level, split, slots.count(name), excluded[name]))
             for name in families}
    return tuple((name, params_key(next(drawn[name]))) for name in slots)


def question(family: Family, params: dict) -> str:
    return PREFIX + family.body(params) + SUFFIX


@functools.lru_cache(maxsize=16)
def split_rows(split: str, level: int, n: int) -> str:
    """The first n rows of a split as JSON (cached: every stage reads its sets more than once)."""
    rows = []
    for i, (name, key) in enumerate(split_params(split, level)[:n]):
        family, params = FAMILIES[name], json.loads(key)
        rows.append({"id": f"compute-L{level}-{split}-{i:04d}", "question": question(family, params),
                     "answer": str(family.answer(params)), "source": "compute", "family": name, "params": params})
    return json.dumps(rows)


def problems(split: str, level: int, n: int | None = None) -> list[dict]:
    """The first n problems (all: None) of a split of a level, in the split's fixed order, which mixes its
    families. split: "train", "heldout" (unseen parameters of TRAIN_FAMILIES) or "families" (HELDOUT_FAMILIES)."""
    if split not in SPLIT_SIZES:
        raise stage.DataError(f"compute task split {split!r} does not exist; splits: {', '.join(SPLITS)}")
    if level not in LEVELS:
        raise stage.DataError(f"compute task level {level!r} does not exist; levels: {LEVELS}")
    size = SPLIT_SIZES[split]
    if n is None:
        n = size
    if not 0 <= n <= size:
        raise stage.DataError(f"{n} compute problems asked for, but split {split} of level {level} has {size}")
    return json.loads(split_rows(split, level, n))
