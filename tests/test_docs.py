"""The README and docs/ against the real CLI and file tree: no MPI, no Slurm, no subprocess.

- Every ``hpcstagger SUB [SUBSUB]`` written in a code span or code block names a real subcommand,
  and every ``--option`` written after it on the same line (or span) is one of its options.
- Every relative markdown link resolves to an existing path, and its ``#anchor`` to a heading.
- The README stays short and links every page under docs/.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from hpcstagger.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
README_MAX_LINES = 220


def doc_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


# ------------------------------------------------------------------------------- markdown parsing
FENCE = re.compile(r"^\s*(```|~~~)\s*(\w*)")
NOT_SHELL = {"python", "py", "pycon"}  # fenced blocks whose `hpcstagger ...` is Python, not a command
INLINE_CODE = re.compile(r"(`+)(.+?)\1")


def split_code(text: str) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(code, prose): numbered lines of fenced blocks and of inline code spans; prose without them.

    Python blocks are left out of both: their ``hpcstagger`` is a module, not the command.

    A fenced line that starts with blanks and ``[`` continues the previous line (a wrapped usage
    line), so its options count for the command above it.
    """
    code: list[tuple[int, str]] = []
    prose: list[tuple[int, str]] = []
    in_fence = False
    python = False
    for no, line in enumerate(text.splitlines(), 1):
        fence = FENCE.match(line)
        if fence:
            in_fence = not in_fence
            python = in_fence and fence.group(2).lower() in NOT_SHELL
            continue
        if python:
            continue
        if in_fence:
            if code and re.match(r"^\s+\[", line) and code[-1][0] == no - 1:
                code[-1] = (no, code[-1][1] + " " + line.strip())
            else:
                code.append((no, line))
            continue
        code.extend((no, m.group(2)) for m in INLINE_CODE.finditer(line))
        prose.append((no, INLINE_CODE.sub("", line)))
    return code, prose


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out: set[str] = set()
    in_fence = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m and not in_fence:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def links(path: Path) -> list[tuple[int, str]]:
    _, prose = split_code(path.read_text())
    return [(no, m.group(1)) for no, line in prose for m in LINK.finditer(line)]


# --------------------------------------------------------------------------------- the CLI's view
def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # private, but argparse has no public accessor
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def options(parser: argparse.ArgumentParser) -> set[str]:
    """The long options a parser takes, as its --help shows them."""
    shown = parser.format_help()
    opts = {o for a in parser._actions for o in a.option_strings if o.startswith("--")}  # private, likewise
    assert all(o in shown for o in opts), parser.prog
    return opts


CLI = build_parser()
COMMANDS = subparsers(CLI)
COMMAND = re.compile(r"(?<![\w.\-])(?<!from )(?<!import )hpcstagger\s+([A-Za-z][\w|-]*)")
STOP = {"#", "&&", "||", ";", "|"}


def invocations(path: Path) -> list[tuple[int, str, list[str], list[str]]]:
    """(line, text, command path alternatives, options) for each ``hpcstagger SUB ...`` in code.

    ``hpcstagger slurm render|submit`` gives the alternatives ``slurm render`` and ``slurm submit``.
    Options are the ``--name`` tokens after the command, up to a comment or a second command.
    """
    code, _ = split_code(path.read_text())
    found = []
    for no, text in code:
        matches = list(COMMAND.finditer(text))
        for i, m in enumerate(matches):
            end = matches[i + 1].start() if i + 1 < len(matches) else len(text)
            sub, rest = m.group(1), text[m.end():end]
            words = rest.split()
            paths = [[s] for s in sub.split("|")]
            if len(paths) == 1 and sub in COMMANDS and subparsers(COMMANDS[sub]) and words:
                nested = re.match(r"^[A-Za-z][\w|-]*", words[0])
                if nested and all(n in subparsers(COMMANDS[sub]) for n in nested.group(0).split("|")):
                    paths = [[sub, n] for n in nested.group(0).split("|")]
                    words = words[1:]
            opts = []
            for word in words:
                if word in STOP or word.startswith("#"):
                    break
                m_opt = re.match(r"^[\[(]*(--[A-Za-z][\w-]*)", word)
                if m_opt:
                    opts.append(m_opt.group(1))
            found.append((no, text.strip(), [" ".join(p) for p in paths], opts))
    return found


def resolve(path: str) -> argparse.ArgumentParser | None:
    parser: argparse.ArgumentParser | None = CLI
    for word in path.split():
        parser = subparsers(parser).get(word) if parser is not None else None
    return parser


# -------------------------------------------------------------------------------------- the tests
def test_docs_exist():
    assert DOCS.is_dir()
    assert sorted(DOCS.glob("*.md")), "docs/ holds no page"


@pytest.mark.parametrize("path", doc_files(), ids=rel)
def test_commands_and_options_exist(path):
    problems = []
    for no, text, paths, opts in invocations(path):
        for cmd in paths:
            parser = resolve(cmd)
            if parser is None:
                problems.append(f"{rel(path)}:{no}: 'hpcstagger {cmd}' is no subcommand: {text}")
                continue
            unknown = [o for o in opts if o not in options(parser)]
            if unknown:
                problems.append(f"{rel(path)}:{no}: 'hpcstagger {cmd}' has no {', '.join(unknown)}: {text}")
    assert not problems, "\n".join(problems)


def test_docs_mention_commands():
    """The parser above really sees the docs' commands (guards against a parser that finds none)."""
    seen = {p for f in doc_files() for _, _, paths, _ in invocations(f) for p in paths}
    for cmd in ("demo", "info", "cache ls", "ckpt verify", "calibrate", "plan", "profile", "launch",
                "status", "exec", "sweep", "history", "slurm render", "slurm submit"):
        assert cmd in seen, f"no doc shows 'hpcstagger {cmd}'"


@pytest.mark.parametrize("path", doc_files(), ids=rel)
def test_relative_links_resolve(path):
    problems = []
    for no, target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            problems.append(f"{rel(path)}:{no}: {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{rel(path)}:{no}: {target}: no heading with that anchor")
    assert not problems, "\n".join(problems)


def test_readme_is_short_and_links_every_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"
    linked = {(README.parent / t.partition("#")[0]).resolve() for _, t in links(README)
              if t.startswith("docs/")}
    for page in linked:
        assert page.is_file(), f"README links {page}, which does not exist"
    pages = {p.resolve() for p in DOCS.glob("*.md")}
    assert pages <= linked, f"README links no {sorted(str(p.relative_to(REPO)) for p in pages - linked)}"


# ------------------------------------------------------------------------------- Python imports
PY_IMPORT = re.compile(r"^\s*from (hpcstagger[\w.]*) import (.+?)\s*(#.*)?$")


def python_imports() -> list[tuple[str, int, str, list[str]]]:
    """(file, line, module, names) of every ``from hpcstagger... import ...`` in a Python block."""
    out = []
    for path in doc_files():
        in_python = False
        for no, line in enumerate(path.read_text().splitlines(), 1):
            fence = FENCE.match(line)
            if fence:
                in_python = not in_python and fence.group(2).lower() in NOT_SHELL
                continue
            m = PY_IMPORT.match(line) if in_python else None
            if m:
                names = [n.split(" as ")[0].strip() for n in m.group(2).strip("()").split(",") if n.strip()]
                out.append((rel(path), no, m.group(1), names))
    return out


def test_the_docs_have_python_imports_to_check():
    assert len(python_imports()) >= 8


@pytest.mark.parametrize("where, line, module, names", python_imports(),
                         ids=[f"{f}:{n}" for f, n, _, _ in python_imports()])
def test_python_examples_import_what_exists(where, line, module, names):
    """A module moved or a name renamed shows up here, not in a user's first try."""
    import importlib
    import importlib.util

    mod = importlib.import_module(module)
    missing = [n for n in names if not hasattr(mod, n) and importlib.util.find_spec(f"{module}.{n}") is None]
    assert not missing, f"{where}:{line}: {module} has no {', '.join(missing)}"


def test_results_is_a_page_of_current_figures_each_with_its_command():
    """benchmarks/RESULTS.md stays one short page: per part a table whose every row names the
    machine, the commit and the command of its figure."""
    lines = (REPO / "benchmarks" / "RESULTS.md").read_text().splitlines()
    assert len(lines) <= 300, f"benchmarks/RESULTS.md has {len(lines)} lines (at most 300): history goes to git"
    header = "| Target | Figure now | Machine | Commit | Command |"
    assert lines.count(header) >= 8, "each part's figures are in one Target | ... | Command table"
    rows, inside = [], False
    for i, line in enumerate(lines, 1):
        inside = line == header or (inside and line.startswith("|"))
        if inside and line != header and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows.append((i, cells))
    bad = [i for i, cells in rows if len(cells) < 5 or not all(cells[2:5]) or not ("`" in cells[4] or
                                                                                cells[4] == "same")]
    assert rows and not bad, f"RESULTS.md rows without a machine, commit or command: lines {bad}"
