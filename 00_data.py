"""Stage 0: the problem files, built from their public sources with `datasets` and checked against the manifest.

data_manifest.json names every row of the three files (its id and answer, in file order) and the sha256 of each
file, so the build reproduces the reference files byte for byte or stops with the reason; it carries no question
text. A file that is already there and matches the manifest is left alone.

    python 00_data.py                      # data/dapo_train400.jsonl, data/dapo_test100.jsonl, data/aime2026.jsonl
    python 00_data.py --out=DIR            # somewhere else
    python 00_data.py --source_dir=DIR     # local copies: DIR/<dataset id>/ holding its parquet or JSON files
    python 00_data.py --write_manifest=data_manifest.json   # the manifest of the files in --out, which are not built

How the rows map (both sources have one split, "train"):
  BytedTsinghua-SIA/DAPO-Math-17k (Apache-2.0; every problem repeated many times, the first copy is taken)
    id = "dapo_" + extra_info.index    question = the user message of prompt    answer = reward_model.ground_truth
    ability = ability
  MathArena/aime_2026 (CC BY-NC-SA 4.0)
    id = "aime_2026_%03d" % problem_idx    question = problem    answer = str(answer)
"""

import hashlib
import json
from pathlib import Path

from agentic_es import cli, data, fileio, stage

OUT = "data"  # where the three problem files are written
SOURCE_DIR = ""  # empty: the Hugging Face hub
CACHE_DIR = ""  # empty: the `datasets` default cache (~/.cache/huggingface/datasets)
FORCE = False  # replace a file that is there but differs from the manifest
WRITE_MANIFEST = ""  # a path: write there the manifest of the problem files in --out (a reference build) instead

DAPO = "BytedTsinghua-SIA/DAPO-Math-17k"
AIME = "MathArena/aime_2026"


def main(argv: list[str]) -> dict:
    options = {"out": OUT, "source_dir": SOURCE_DIR, "cache_dir": CACHE_DIR, "force": FORCE,
               "write_manifest": WRITE_MANIFEST}
    cli.exit_if_help(argv, __doc__, __file__, options, settings=False)
    opts, rest = cli.parse_args(argv, options)
    if rest:
        raise stage.ConfigError(f"unknown options {rest}; 00_data.py takes --out, --source_dir, --cache_dir, --force, "
                                "--write_manifest")
    manifest = fileio.read_json(data.DATA_MANIFEST)["files"]
    out = Path(opts["out"])
    if opts["write_manifest"]:
        return write_manifest(out, list(manifest), Path(opts["write_manifest"]))

    status, sources = {}, {}
    for name, entry in manifest.items():
        path = out / name
        if is_built(path, entry, opts["force"]):
            print(f"[data] {path}: up to date ({len(entry['rows'])} rows, sha256 matches the manifest)")
            status[name] = "up to date"
            continue
        if entry["source"] not in sources:
            sources[entry["source"]] = load_source(entry["source"], entry["split"], opts["source_dir"],
                                                   opts["cache_dir"])
        rows = select_rows(sources[entry["source"]], entry, name)
        text = jsonl_text(rows)
        check_against_manifest(rows, text, entry, name)  # before anything is written
        fileio.write_file_atomic(text, path)
        print(f"[data] {path}: built, {len(rows)} rows from {entry['source']}, sha256 matches the manifest")
        status[name] = "built"

    print(f"[data] done: {out}/ holds " + ", ".join(f"{name} ({s})" for name, s in status.items()))
    return status


def is_built(path: Path, entry: dict, force: bool) -> bool:
    """True when path already holds the manifest's file. A different file there is replaced only with --force."""
    if not path.exists():
        return False
    if fileio.sha256_file(path) == entry["sha256"]:
        return True
    if not force:
        raise stage.DataError(f"{path} exists but differs from data_manifest.json (not the reference build); move it "
                               f"away or pass --force to replace it")
    return False


def write_manifest(out: Path, names: list[str], path: Path) -> dict:
    """The manifest of the problem files `names` in `out` (a reference build), written to `path` in
    data_manifest.json's format: how that file is made from the reference files."""
    files = {}
    for name in names:
        if not (out / name).is_file():
            raise stage.DataError(f"{out / name}: file not found; --write_manifest describes the files of a build")
        files[name] = manifest_entry((out / name).read_bytes().decode(), f"{out / name}")
    fileio.write_file_atomic(manifest_text(files), path)
    print(f"[data] wrote {path}: the manifest of " + ", ".join(f"{n} ({len(e['rows'])} rows)" for n, e in files.items()))
    return {name: "described" for name in files}


MANIFEST_FORMAT = "es-data-manifest/1"
MANIFEST_ABOUT = ("The rows 00_data.py selects from the public datasets, in file order: id, answer and the first 12 hex "
                  "digits of the sha256 of the row's JSONL line; sha256 of each whole file. Made from the reference "
                  "files (../shared/data); it carries no question text.")


def manifest_text(files: dict) -> str:
    """data_manifest.json's text: JSON laid out for reading and for diffs, a line per file's facts and per row."""
    def entry(name, e):
        facts = ", ".join(f"{json.dumps(k)}: {json.dumps(e[k])}" for k in ("source", "split", "sha256"))
        rows = ",\n".join(f"        {json.dumps(row)}" for row in e["rows"])
        return f'    {json.dumps(name)}: {{\n      {facts},\n      "rows": [\n{rows}\n      ]\n    }}'
    return (f'{{\n  "format": {json.dumps(MANIFEST_FORMAT)},\n  "about": {json.dumps(MANIFEST_ABOUT)},\n  "files": {{\n'
            + ",\n".join(entry(name, e) for name, e in files.items()) + "\n  }\n}\n")


def manifest_entry(text: str, where: str = "the file") -> dict:
    """data_manifest.json's entry for one problem file's text: its rows' source and split, its sha256, and per row
    its id, answer and the first 12 hex digits of its line's sha256 (no question text)."""
    lines = text.splitlines()
    try:
        rows = [json.loads(line) for line in lines]
        sources = {(r["source"], r["split_source"]) for r in rows}
        described = [[r["id"], r["answer"], hashlib.sha256(line.encode()).hexdigest()[:12]]
                     for r, line in zip(rows, lines)]
    except (ValueError, KeyError, TypeError) as e:
        raise stage.DataError(f"{where}: not a problem file this stage builds ({type(e).__name__}: {e})") from None
    if len(sources) != 1:
        raise stage.DataError(f"{where}: its rows come from {len(sources)} (source, split) pairs; a file of the "
                              "manifest has one")
    (source, split), = sources
    return {"source": source, "split": split, "sha256": hashlib.sha256(text.encode()).hexdigest(), "rows": described}


# ---- Reading the sources

def load_source(repo: str, split: str, source_dir: str, cache_dir: str):
    """One split of a public dataset, from the hub or from a local copy at <source_dir>/<repo>."""
    import datasets  # slow to import: only when something has to be built

    where = repo
    if source_dir:
        where = str(Path(source_dir) / repo)
        if not Path(where).is_dir():
            raise stage.DataError(f"--source_dir: no local copy of {repo} at {where}")
    try:
        return datasets.load_dataset(where, split=split, cache_dir=cache_dir or None)
    except Exception as exc:  # any failure to get the data (network, hub, files) ends the build with its reason
        place, hint = ((f"the local copy {where}", "Check the files there") if source_dir else
                       ("the Hugging Face hub", "Check the network, or pass --source_dir=DIR with local copies"))
        raise stage.DataError(f"could not load {repo} (split {split!r}) from {place}: {type(exc).__name__}: {exc}. "
                               f"{hint}") from None


def require_columns(ds, repo: str, columns: dict) -> None:
    """Fail on a schema other than the one this builder maps (a renamed, removed or restructured column)."""
    for column, subfields in columns.items():
        feature = ds.features.get(column)
        if feature is None or subfields and not (isinstance(feature, dict) and all(f in feature for f in subfields)):
            wanted = f"{column} with {', '.join(subfields)}" if subfields else column
            raise stage.DataError(f"{repo}: expected column {wanted}; its columns are {dict(ds.features)}")


def field(row: dict, repo: str, dotted: str, kinds: tuple):
    """row['a']['b'] for 'a.b', of one of the given types, or a DataError naming the field."""
    value = row
    for key in dotted.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    if not isinstance(value, kinds) or isinstance(value, bool):
        raise stage.DataError(f"{repo}: field {dotted} is {value!r}, expected {'/'.join(k.__name__ for k in kinds)}")
    return value


def dapo_ids(ds) -> list[str]:
    import pyarrow.compute as pc

    require_columns(ds, DAPO, {"prompt": (), "ability": (), "reward_model": ("ground_truth",),
                               "extra_info": ("index",)})
    return ["dapo_" + str(i) for i in pc.struct_field(ds.data.column("extra_info"), "index").to_pylist()]


def dapo_problem(row: dict) -> dict:
    messages = field(row, DAPO, "prompt", (list,))
    user = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    if len(user) != 1:
        raise stage.DataError(f"{DAPO}: expected one user message in prompt, got {messages!r}")
    return {"id": "dapo_" + field(row, DAPO, "extra_info.index", (str,)), "source": DAPO,
            "question": field(user[0], DAPO, "content", (str,)),
            "answer": field(row, DAPO, "reward_model.ground_truth", (str,)),
            "ability": field(row, DAPO, "ability", (str,)), "split_source": "train"}


def aime_ids(ds) -> list[str]:
    require_columns(ds, AIME, {"problem_idx": (), "problem": (), "answer": ()})
    indices = ds.data.column("problem_idx").to_pylist()
    if not all(type(i) is int for i in indices):
        raise stage.DataError(f"{AIME}: problem_idx must hold integers, got {ds.features['problem_idx']}")
    return [f"aime_2026_{i:03d}" for i in indices]


def aime_problem(row: dict) -> dict:
    index = field(row, AIME, "problem_idx", (int,))
    return {"id": f"aime_2026_{index:03d}", "source": AIME, "question": field(row, AIME, "problem", (str,)),
            "answer": str(field(row, AIME, "answer", (int, str))), "split_source": "train"}


SOURCES = {DAPO: (dapo_ids, dapo_problem), AIME: (aime_ids, aime_problem)}  # repo -> (row ids, row -> problem)


# ---- Selecting, writing and checking the rows

def select_rows(ds, entry: dict, name: str) -> list[dict]:
    """The manifest's rows, in its order: the first source row of each id, mapped to the problem fields."""
    ids_of, to_problem = SOURCES[entry["source"]]
    first = {}
    for position, pid in enumerate(ids_of(ds)):
        first.setdefault(pid, position)
    wanted = [pid for pid, _, _ in entry["rows"]]
    missing = [pid for pid in wanted if pid not in first]
    if missing:
        raise stage.DataError(f"{entry['source']} lacks {len(missing)} of the {len(wanted)} ids of {name}: "
                               f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    return [to_problem(row) for row in ds.select([first[pid] for pid in wanted])]


def jsonl_text(rows: list[dict]) -> str:
    """The reference files' serialisation: json.dumps defaults (non-ASCII as \\u escapes), one row per line."""
    return "".join(json.dumps(row) + "\n" for row in rows)


def check_against_manifest(rows: list[dict], text: str, entry: dict, name: str) -> None:
    """Answers first (the facts the manifest carries), then each row's line, then the whole file."""
    wrong = [f"{r['id']}: source says {r['answer']!r}, manifest {answer!r}"
             for r, (_, answer, _) in zip(rows, entry["rows"]) if r["answer"] != answer]
    if wrong:
        raise stage.DataError(f"{name}: answer mismatch in {len(wrong)} rows: " + "; ".join(wrong[:5]))
    lines = text.splitlines()
    changed = [r["id"] for r, line, (_, _, digest) in zip(rows, lines, entry["rows"])
               if hashlib.sha256(line.encode()).hexdigest()[:12] != digest]
    if changed:
        raise stage.DataError(f"{name}: {len(changed)} rows differ from the reference build (question text or other "
                               f"fields; has the public dataset changed?): {', '.join(changed[:5])}")
    digest = hashlib.sha256(text.encode()).hexdigest()
    if digest != entry["sha256"]:
        raise stage.DataError(f"{name}: sha256 {digest} differs from the manifest's {entry['sha256']}")


if __name__ == "__main__":
    stage.run_stage(main, "data")  # errors as one line; SIGTERM/SIGINT stop cleanly
