"""The compute task's problems (agentic_es/compute_task.py), without engines: every gold re-derived another way (a
second program: brute force against a formula, a sieve against trial division, a DP against inclusion-exclusion,
sympy against the module's own arithmetic) for every problem of level 1 and the first problems of each family at
levels 2 and 3; the splits fixed, disjoint and mixed; the wording DAPO's, with no hint of a program; each level
larger than the one before by every family's size parameter."""

import collections
import dataclasses
import decimal
import functools
import hashlib
import importlib
import json
import math
import re

import numpy as np
import pytest
import sympy
from sympy.functions.combinatorial.numbers import partition

import common
from agentic_es import cli, data, fileio, history, settings, stage
from agentic_es import compute_task as ct
from agentic_es.export import SHARDED_STATE_MANIFEST

evaluation = importlib.import_module("03_eval")

FORBIDDEN_WORDS = ("python", "bash", "command", "print(", "code")


# ---- the second programs: each family's gold computed otherwise than the module computes it --------------------

def decimal_digit_sum(n):  # decimal's own conversion has no limit on the digits of an int
    return sum(map(int, str(decimal.Decimal(n))))


def square_and_multiply(base, exponent, modulus):  # left to right over the exponent's bits
    result = 1
    for bit in bin(exponent)[2:]:
        result = result * result % modulus
        if bit == "1":
            result = result * base % modulus
    return result


def recurrence_by_iteration(p):
    a, b = p["a0"] % p["modulus"], p["a1"] % p["modulus"]
    for _ in range(p["index"]):
        a, b = b, (p["p"] * b + p["q"] * a) % p["modulus"]
    return a


def recurrence_by_polynomial_powers(p):
    """x^N modulo x^2 - p x - q (Kitamasa): x^N = c1 x + c0 gives a_N = c1 a_1 + c0 a_0."""
    m, pp, qq = p["modulus"], p["p"], p["q"]

    def product(u, v):  # (u1 x + u0)(v1 x + v0) with x^2 = p x + q
        top, mid, low = u[0] * v[0], u[0] * v[1] + u[1] * v[0], u[1] * v[1]
        return ((mid + top * pp) % m, (low + top * qq) % m)

    result, power, n = (0, 1), (1, 0), p["index"]
    while n:
        if n & 1:
            result = product(result, power)
        power, n = product(power, power), n >> 1
    return (result[0] * p["a1"] + result[1] * p["a0"]) % m


def blocked_paths_by_grid(p):
    blocked = {tuple(q) for q in p["blocked"]}
    row = [0] * (p["height"] + 1)
    for x in range(p["width"] + 1):
        for y in range(p["height"] + 1):
            if (x, y) in blocked:
                row[y] = 0
            elif (x, y) != (0, 0):
                row[y] = row[y] + (row[y - 1] if y else 0)
            else:
                row[y] = 1
    return row[p["height"]] % p["modulus"] if p["modulus"] else row[p["height"]]


def blocked_paths_exactly(p):
    """Inclusion-exclusion over every chain of blocked points, in exact integers (math.comb), reduced at the end."""
    points = sorted(tuple(q) for q in p["blocked"]) + [(p["width"], p["height"])]

    def paths(a, b):
        return math.comb(b[0] - a[0] + b[1] - a[1], b[0] - a[0]) if b[0] >= a[0] and b[1] >= a[1] else 0

    @functools.lru_cache(maxsize=None)
    def avoiding(i):  # paths from the origin to points[i] through no earlier blocked point
        return paths((0, 0), points[i]) - sum(avoiding(j) * paths(points[j], points[i]) for j in range(i))
    total = avoiding(len(points) - 1)
    return total % p["modulus"] if p["modulus"] else total


def circle_points_by_quadrant(bound):  # the origin, and four rotations of the points with x > 0, y >= 0
    return 1 + 4 * sum(math.isqrt(bound - y * y) for y in range(math.isqrt(bound) + 1))


def partitions_by_parts(n, modulus):  # the coin-change DP over part sizes 1..n
    ways = [1] + [0] * n
    for part in range(1, n + 1):
        for total in range(part, n + 1):
            ways[total] += ways[total - part]
    return ways[n] % modulus if modulus else ways[n]


def collatz_with_shortcut(n):  # an odd n goes to (3n + 1) / 2 in two steps
    steps = 0
    while n != 1:
        if n % 2:
            n, steps = (3 * n + 1) // 2, steps + 2
        else:
            n, steps = n // 2, steps + 1
    return steps


def totient_sum_by_sieve(n):
    phi = list(range(n + 1))
    for p in range(2, n + 1):
        if phi[p] == p:  # untouched: prime
            for multiple in range(p, n + 1, p):
                phi[multiple] -= phi[multiple] // p
    return sum(phi[1:])


def polynomial_sum_by_sympy(p):
    k = sympy.symbols("k")
    c3, c2, c1, c0 = p["coefficients"]
    return int(sympy.summation(c3 * k**3 + c2 * k**2 + c1 * k + c0, (k, 1, p["count"]))) % p["modulus"]


def second_program(family, p, level):
    """The gold of one problem, computed by other code than agentic_es.compute_task's. Brute force at level 1;
    where brute force is too slow, another algorithm or sympy."""
    small = level == 1
    if family == "digit_property_count":
        return sum(1 for n in range(p["low"], p["high"] + 1)
                   if n % p["divisor"] == 0 and sum(map(int, str(n))) % p["digit_modulus"] == 0)
    if family == "modular_power":
        return square_and_multiply(p["base"], p["exponent"], p["modulus"])
    if family == "power_digit_sum":
        return decimal_digit_sum(p["base"] ** p["exponent"])
    if family == "divisor_count":
        if small:
            return sum(1 for d in range(1, p["n"] + 1) if p["n"] % d == 0)
        return int(sympy.divisor_count(p["n"]))
    if family == "divisor_sum":
        if small:
            return sum(d for d in range(1, p["n"] + 1) if p["n"] % d == 0)
        return int(sympy.divisor_sigma(p["n"]))
    if family == "recurrence_mod":
        return recurrence_by_iteration(p) if level < 3 else recurrence_by_polynomial_powers(p)
    if family == "primes_in_interval":
        if small:
            return sum(1 for n in range(p["low"], p["high"] + 1)
                       if n > 1 and all(n % d for d in range(2, math.isqrt(n) + 1)))
        return sum(1 for _ in sympy.primerange(p["low"], p["high"] + 1))
    if family == "circle_lattice_points":
        if small:
            r = math.isqrt(p["bound"])
            return sum(1 for x in range(-r, r + 1) for y in range(-r, r + 1) if x * x + y * y <= p["bound"])
        return circle_points_by_quadrant(p["bound"])
    if family == "blocked_lattice_paths":
        return blocked_paths_by_grid(p) if level < 3 else blocked_paths_exactly(p)
    if family == "base_digit_sum":
        return sum(int(d, 36) for d in np.base_repr(p["n"], p["base"]))
    if family == "polynomial_sum_mod":
        if level < 3:
            c3, c2, c1, c0 = p["coefficients"]
            return sum(c3 * k**3 + c2 * k**2 + c1 * k + c0 for k in range(1, p["count"] + 1)) % p["modulus"]
        return polynomial_sum_by_sympy(p)
    if family == "range_lcm_mod":
        return functools.reduce(math.lcm, range(1, p["n"] + 1)) % p["modulus"]
    if family == "partition_count":
        if small:
            return partitions_by_parts(p["n"], p["modulus"])
        return int(partition(p["n"])) % p["modulus"]
    if family == "collatz_steps":
        return collatz_with_shortcut(p["n"])
    if family == "totient_sum":
        return totient_sum_by_sieve(p["n"])
    raise AssertionError(f"no second program for family {family}")


# ---- the golds ---------------------------------------------------------------------------------------------------

def test_every_family_has_a_second_program_and_the_split_sizes_hold():
    assert len(ct.TRAIN_FAMILIES) >= 8 and len(ct.HELDOUT_FAMILIES) >= 3
    assert set(ct.TRAIN_FAMILIES) | set(ct.HELDOUT_FAMILIES) == set(ct.FAMILIES)
    assert not set(ct.TRAIN_FAMILIES) & set(ct.HELDOUT_FAMILIES)
    assert ct.LEVELS == (1, 2, 3)
    for split, size in ct.SPLIT_SIZES.items():
        assert len(ct.problems(split, 1)) == size
    assert ct.SPLIT_SIZES["train"] >= 12 * 32  # a run of 12 generations x 32 problems cycles little


@pytest.mark.parametrize("split", ct.SPLITS)
def test_every_level_1_gold_is_what_a_second_program_computes(split):
    for row in ct.problems(split, 1):
        assert row["answer"] == str(second_program(row["family"], row["params"], 1)), row


@pytest.mark.parametrize("level", [2, 3])
def test_the_first_problem_of_every_family_at_levels_2_and_3_is_what_a_second_program_computes(level):
    firsts = {}
    for split in ("train", "families"):
        for row in ct.problems(split, level, 2 * len(ct.FAMILIES)):  # each family within its first rounds
            firsts.setdefault(row["family"], row)
    assert set(firsts) == set(ct.FAMILIES)
    for family, row in firsts.items():
        p = row["params"]
        if family == "blocked_lattice_paths" and level == 2:  # the grid DP is affordable on level 2's smallest
            p = min((r["params"] for r in ct.problems("train", 2) if r["family"] == family),
                    key=lambda q: q["width"] * q["height"])
            assert str(ct.FAMILIES[family].answer(p)) == str(second_program(family, p, level))
            continue
        if family == "totient_sum" and level == 3:  # the sieve up to a million takes seconds: the smallest n
            p = min((r["params"] for r in ct.problems("families", 3) if r["family"] == family), key=lambda q: q["n"])
            assert ct.FAMILIES[family].answer(p) == second_program(family, p, level)
            continue
        assert row["answer"] == str(second_program(family, p, level)), row


def test_the_module_s_own_arithmetic_on_known_values():
    assert ct.digit_sum(2**1000) == 1366 and ct.digit_sum(255, 2) == 8 and ct.digit_sum(0) == 0
    assert ct.digit_sum(10**9000 - 1) == 9 * 9000  # beyond the 4300 digits Python's str() takes
    assert ct.primes_up_to(30) == [2, 3, 5, 7, 11, 13, 17, 19, 23, 29]
    assert ct.primes_in_interval(1, 100) == 25 and ct.primes_in_interval(2, 2) == 1
    assert ct.divisor_count(720) == 30 and ct.divisor_sum(28) == 56
    assert ct.circle_points(1) == 5 and ct.circle_points(2) == 9
    assert ct.partition_table(100, None)[100] == 190569292 and ct.collatz_steps(27) == 111
    assert ct.totient_sum(10) == 32 and ct.totient_sum(1) == 1
    fibonacci = {"a0": 0, "a1": 1, "p": 1, "q": 1, "index": 90, "modulus": 10**30}
    assert ct.answer_recurrence(fibonacci) == 2880067194370816120
    assert ct.answer_blocked_paths({"width": 2, "height": 2, "blocked": [[1, 1]], "modulus": None}) == 2


# ---- the splits --------------------------------------------------------------------------------------------------

def fresh(split, level, n=None):
    """problems() with the module's caches emptied first: generated again, not remembered."""
    ct.split_params.cache_clear()
    ct.split_rows.cache_clear()
    return ct.problems(split, level, n)


def test_generation_is_deterministic_and_a_prefix_is_the_split_s_first_rows():
    for level in ct.LEVELS:
        assert fresh("train", level, 40) == fresh("train", level, 40) == ct.problems("train", level, 60)[:40]
    assert fresh("heldout", 1) == fresh("heldout", 1)
    digest = hashlib.sha256(json.dumps(fresh("train", 1, 16), sort_keys=True).encode()).hexdigest()
    assert digest == PINNED_LEVEL_1_DIGEST  # a changed stream changes every history's recorded data sha256


PINNED_LEVEL_1_DIGEST = "0f78da5b230568b63c066274c4c1ba79f746a36c096bfa76cc3efdb94b74c332"


def test_held_out_problems_share_no_family_and_parameters_with_training():
    def drawn(split, level):  # the split's (family, params) and questions, without computing golds
        pairs = ct.split_params(split, level)
        return set(pairs), {ct.question(ct.FAMILIES[f], json.loads(key)) for f, key in pairs}

    for level in ct.LEVELS:
        (train, train_questions), (heldout, heldout_questions) = drawn("train", level), drawn("heldout", level)
        families, families_questions = drawn("families", level)
        assert len(train) == ct.SPLIT_SIZES["train"] and len(heldout) == ct.SPLIT_SIZES["heldout"]  # no repeats
        assert not train & heldout and not train_questions & (heldout_questions | families_questions)
        assert {f for f, _ in heldout} == set(ct.TRAIN_FAMILIES)
        assert {f for f, _ in families} == set(ct.HELDOUT_FAMILIES)
        assert not {f for f, _ in families} & {f for f, _ in train}
    assert [(r["family"], r["params"]) for r in ct.problems("heldout", 1)] == [
        (f, json.loads(key)) for f, key in ct.split_params("heldout", 1)]  # the rows are these draws


def test_the_first_64_rows_cover_every_family_of_the_split_about_equally():
    for level in ct.LEVELS:
        for split in ct.SPLITS:
            counts = collections.Counter(r["family"] for r in ct.problems(split, level, 64))
            expected = ct.HELDOUT_FAMILIES if split == "families" else ct.TRAIN_FAMILIES
            assert set(counts) == set(expected) and max(counts.values()) - min(counts.values()) <= 1


def test_rows_have_the_promised_fields_and_ids():
    for level in ct.LEVELS:
        for split in ct.SPLITS:
            rows = ct.problems(split, level, 24)
            assert [r["id"] for r in rows] == [f"compute-L{level}-{split}-{i:04d}" for i in range(24)]
            for r in rows:
                assert set(r) == {"id", "question", "answer", "source", "family", "params"}
                assert r["source"] == "compute" and re.fullmatch(r"0|[1-9][0-9]*", r["answer"])
                assert json.loads(json.dumps(r["params"])) == r["params"]


def test_the_wording_is_dapo_s_with_no_hint_of_a_program():
    dapo_prefix = ("Solve the following math problem step by step. The last line of your response should be of the "
                   "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n")
    dapo_suffix = "\n\nRemember to put your answer on its own line after \"Answer:\"."  # (data/dapo_test100.jsonl)
    for level in ct.LEVELS:
        for split in ct.SPLITS:
            for r in ct.problems(split, level, 64):
                q = r["question"]
                assert q.startswith(dapo_prefix) and q.endswith(dapo_suffix)
                assert not [w for w in FORBIDDEN_WORDS if w in q.lower()], q


def test_each_level_is_larger_than_the_one_before_by_every_family_s_size():
    for name, family in ct.FAMILIES.items():
        split = "families" if name in ct.HELDOUT_FAMILIES else "train"
        sizes = {level: [family.size(json.loads(key)) for f, key in ct.split_params(split, level) if f == name]
                 for level in ct.LEVELS}
        for level in ct.LEVELS[1:]:
            assert max(sizes[level - 1]) < min(sizes[level]), (name, level)


def test_bad_splits_levels_and_counts_are_refused():
    with pytest.raises(stage.DataError, match="split 'test'"):
        ct.problems("test", 1)
    with pytest.raises(stage.DataError, match="level 4"):
        ct.problems("train", 4)
    with pytest.raises(stage.DataError, match="513 compute problems"):
        ct.problems("train", 1, 513)


# ---- the task in the stages: data names, the setting, the preset, 03_eval's sets and the level it evaluates ------

def test_the_stages_data_names_are_the_splits_of_the_configured_level():
    for level in ct.LEVELS:
        for name, split in ct.SETS.items():
            assert data.problems_from(name, 3, compute_level=level) == ct.problems(split, level)  # any run seed
    sha = {level: data.problems_sha256("compute_heldout", 0, compute_level=level) for level in ct.LEVELS}
    assert len(set(sha.values())) == 3 and sha[1] == data.problems_sha256("compute_heldout", 9)  # level 1: default
    assert sha[1].startswith("compute_heldout ")
    cfg = cli.parse_config(["--preset=compute", "--compute_level=2"])
    assert data.training_problems(cfg) == ct.problems("train", 2)
    assert history.train_data_sha256(cfg) == data.problems_sha256("compute", 0, compute_level=2)
    for held_out in ("compute_heldout", "compute_families"):
        with pytest.raises(stage.ConfigError, match=f"^train_data={held_out} is the compute task's held-out set, "
                                                    "which is never trained on; train on --train_data=compute$"):
            data.training_problems(cli.parse_config(["--preset=compute", f"--train_data={held_out}"]))


def test_the_compute_preset_and_the_level_setting():
    cfg = cli.parse_config(["--preset=compute"])
    assert (cfg.model, cfg.train_data, cfg.compute_level, cfg.fitness) == ("qwen2.5-coder-1.5b", "compute", 1, "agent")
    assert (cfg.max_model_len, cfg.max_new_tokens, cfg.max_turns, cfg.bash_timeout_s) == (8192, 512, 6, 10.0)
    assert (cfg.generations, cfg.population, cfg.case_batch, cfg.eval_problems) == (12, 16, 32, 64)
    assert (cfg.temperature, cfg.presence_penalty, cfg.sigma_start, cfg.sigma_end, cfg.alpha) == (
        0.7, 0.0, 2e-3, 1e-3, 4e-3)
    strict = settings.PRESETS["strict"]  # the agent loop and prompt are the strict preset's: only the task differs
    assert all(cfg.__getattribute__(k) == v for k, v in strict.items()
               if k not in ("max_model_len", "max_new_tokens", "bash_timeout_s", "train_data", "learn_digits",
                            "run_dir"))
    assert common.Config().compute_level == 1 and cli.parse_config(["--preset=strict"]).compute_level == 1
    with pytest.raises(stage.ConfigError, match=r"^compute_level=2 is a level of the compute task; use it with "
                                                r"--train_data=compute \(train_data is 'learn'\)$"):
        cli.parse_config(["--preset=strict", "--compute_level=2"])
    with pytest.raises(stage.ConfigError, match=r"^compute_level must be in \[1, 3\]"):
        cli.parse_config(["--preset=compute", "--compute_level=4"])


def test_03_eval_evaluates_both_held_out_sets_of_the_level():
    no_paths = {name: "" for name in evaluation.ALL_DATASETS}
    cfg = cli.parse_config(["--preset=compute", "--compute_level=3"])
    assert evaluation.data_paths(no_paths, cfg) == ct.EVAL_SETS == {
        "compute_heldout": "compute_heldout", "compute_families": "compute_families"}
    assert evaluation.eval_problems("compute_families", cfg) == ct.problems("families", 3)[:64]
    with pytest.raises(stage.ConfigError, match=re.escape("--dapo= names a set this run does not evaluate "
                                                          "(train_data=compute evaluates compute_heldout, "
                                                          "compute_families)")):
        evaluation.data_paths(dict(no_paths, dapo="x.jsonl"), cfg)


def manifest_only_export(folder, **recorded):
    """A folder holding only an export manifest whose history config records `recorded`: enough for 03_eval.py to
    read the run's task, which it does before it verifies the export."""
    folder.mkdir()
    config = dataclasses.asdict(common.Config(**recorded))
    fileio.write_json_atomic({"config": config}, folder / SHARDED_STATE_MANIFEST)
    return str(folder)


def test_03_eval_evaluates_an_export_at_the_level_and_tier_its_run_recorded(tmp_path):
    level2 = manifest_only_export(tmp_path / "compute", train_data="compute", compute_level=2)
    overrides = ["--preset=compute", f"--run_dir={tmp_path}"]
    assert evaluation.exported_task(cli.parse_config(overrides), level2, overrides).compute_level == 2
    for argv in (["--compute_level=2"], []):  # the recorded value, given or not
        assert evaluation.exported_task(cli.parse_config(overrides + argv), level2, overrides + argv).compute_level == 2
    refused = re.escape("an evaluation of a run's weights is of the task tier and level the run trained on: "
                        f"--compute_level=3 (the run's is compute_level=2, recorded in {level2}/"
                        f"{SHARDED_STATE_MANIFEST}); drop the setting or pass the recorded value")
    with pytest.raises(stage.ConfigError, match=refused):  # through main(): before anything is verified or written
        evaluation.main(overrides + [f"--export={level2}", "--compute_level=3"])
    assert not (tmp_path / "eval").exists()
    # the learn task's tier: the same hole closed (the strict run's 4 digits are not evaluated as 6)
    tier4 = manifest_only_export(tmp_path / "strict", train_data="learn", learn_digits=4)
    strict = ["--preset=strict", f"--run_dir={tmp_path}"]
    assert evaluation.exported_task(cli.parse_config(strict), tier4, strict).learn_digits == 4
    with pytest.raises(stage.ConfigError, match=r"--learn_digits=6 \(the run's is learn_digits=4, recorded in "):
        evaluation.exported_task(cli.parse_config(strict + ["--learn_digits=6"]), tier4, strict + ["--learn_digits=6"])
    # another task's sets (DAPO) of the same weights keep the command line's settings
    dapo = cli.parse_config([f"--run_dir={tmp_path}"])
    assert evaluation.exported_task(dapo, level2, []) == dapo
    assert evaluation.exported_task(dapo, str(tmp_path / "missing"), []) == dapo  # left to export.verify


def test_03_eval_of_the_base_model_in_a_run_folder_takes_the_run_s_level(tmp_path):
    recorded = common.Config(model="tiny-qwen3-dense", train_data="compute", compute_level=3, run_dir=str(tmp_path))
    fileio.write_json_atomic({"config": dataclasses.asdict(recorded), "base_model": {}, "base_digests": [],
                              "generations": []},
                             tmp_path / history.HISTORY_FILE)
    argv = ["--model=tiny-qwen3-dense", "--train_data=compute", f"--run_dir={tmp_path}"]
    assert evaluation.base_config(cli.parse_config(argv), argv).compute_level == 3
    with pytest.raises(stage.ConfigError, match=r"--compute_level=1 \(the run's is compute_level=3, recorded in "):
        evaluation.base_config(cli.parse_config(argv + ["--compute_level=1"]), argv + ["--compute_level=1"])
