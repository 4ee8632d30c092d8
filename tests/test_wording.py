"""The product speaks only of itself: no words about how it was made (tracker numbers, who did
what, in which sitting) in the package, its docs, benchmarks, tests, examples and scripts.

"Session" as the product class (``hpcstagger.Session``, ``session = hpcstagger.init()``) is fine;
only ordinal or deictic phrases ("this/an earlier/the 3rd ... session") are flagged. The words are
built by concatenation below, so this file is checked like any other without flagging itself.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GLOBS = ("hpcstagger/**/*.py", "docs/*.md", "README.md", "CHANGELOG.md", "benchmarks/**/*.py",
         "benchmarks/**/*.md", "tests/**/*.py", "examples/**/*", "scripts/*", ".ci/*")
_S = "sess" + "ions?"
_WHICH = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|[0-9]+(?:st|nd|rd|th)"
          "|earlier|previous|later|next|this|another")
PATTERNS = [re.compile(p, re.IGNORECASE) for p in (
    r"\b" + "iss" + r"ues? #?\d+",
    r"\b" + "hel" + r"pers?\b",
    r"\b" + "integ" + r"rators?\b",
    "develop" + "ment VM",
    r"\b" + "pa" + r"rt \d+\b",
    rf"\b(?:{_WHICH}) {_S}\b",
)]


def product_files(root: Path = ROOT) -> list[Path]:
    """The files the product is made of, as globs of ``root`` (generated caches left out)."""
    found = {p for g in GLOBS for p in root.glob(g)}
    return sorted(p for p in found if p.is_file() and "__pycache__" not in p.parts)


def process_words(paths: list[Path], root: Path = ROOT) -> list[str]:
    """``path:line: text`` for every line of ``paths`` that speaks of how the product was made."""
    hits = []
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:  # a binary file (a dataset, an image): no prose in it
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if any(p.search(line) for p in PATTERNS):
                hits.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    return hits


def test_product_files_speak_only_of_the_product():
    files = product_files()
    assert any(p.name == "test_wording.py" for p in files)  # the globs reach this very file
    hits = process_words(files)
    assert not hits, ("words about how the product was made; say what the code does instead:\n"
                      + "\n".join(hits))


def test_the_checker_flags_a_planted_line(tmp_path):
    planted = [f"Fixed in {'iss' + 'ue'} 7.", f"The {'hel' + 'per'} below.", f"Done in this {'sess' + 'ion'}.",
               f"On the {'develop' + 'ment'} VM.", f"({'pa' + 'rt'} 2)", f"The 3rd {'sess' + 'ion'}."]
    clean = ["session = hpcstagger.init()", "hpcstagger.Session and session.loader(loader)",
             "partitioned cache, part of the key", "integrations/torch_ddp.py", "issues a CheckpointWarning"]
    (tmp_path / "tests").mkdir()
    f = tmp_path / "tests" / "test_x.py"
    f.write_text("\n".join(clean + planted) + "\n")
    assert product_files(tmp_path) == [f]
    hits = process_words([f], tmp_path)
    assert hits == [f"tests/test_x.py:{len(clean) + i + 1}: {line}" for i, line in enumerate(planted)]
