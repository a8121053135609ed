"""Names that docstrings and comments put in backticks still exist: a function renamed or removed leaves its old name
in the prose that explains it (session 51 found two: mla_decode's Q quantizer and plugin's flag export, both
renamed long before).
A name counts as existing when the code of this repository (Python tokens outside docstrings, or the CUDA and shell
sources) or the installed sglang uses it. Only identifier-like names are checked: with an underscore or a lower-to-
upper case change, so plain words in backticks stay prose."""
from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import sglang

from repo_scripts import REPO, tracked_files

BACKTICKED = re.compile(r"`([A-Za-z_][\w.]*)(?:\(\))?`")


def tracked(*suffixes: str) -> list[Path]:
    return [p for p in tracked_files() if p.name.endswith(suffixes)]


def code_words(source: str) -> set[str]:
    """Names and the words of string literals in Python code; statement-level strings (docstrings) left out."""
    words, after = set(), tokenize.NEWLINE
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.NAME:
            words.add(tok.string)
        elif tok.type == tokenize.STRING and after not in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                                                           tokenize.NL):
            words.update(re.findall(r"\w+", tok.string))
        if tok.type != tokenize.COMMENT:
            after = tok.type
    return words


def identifier_like(name: str) -> bool:
    return "_" in name.strip("_") or name.startswith("_") or bool(re.search(r"[a-z][A-Z]", name))


def stale_names(text: str, known: set[str]) -> set[str]:
    """The backticked dotted names in `text` with an identifier-like part that `known` lacks."""
    return {m.group(1) for m in BACKTICKED.finditer(text)
            if any(identifier_like(p) and p not in known for p in m.group(1).split("."))}


def known_words() -> set[str]:
    words = set()
    for path in tracked(".py"):
        words |= code_words(path.read_text())
    for path in tracked(".cu", ".cuh", ".sh"):
        words |= set(re.findall(r"\w+", path.read_text()))
    for path in Path(sglang.__file__).parent.rglob("*.py"):
        words |= set(re.findall(r"\w+", path.read_text(errors="ignore")))
    return words


def test_the_check_finds_a_removed_name():
    source = 'def kept_name():\n    """Calls `kept_name` and `_removed_kernel`; `plain` is prose."""\n'
    assert stale_names(source, code_words(source)) == {"_removed_kernel"}


def test_backticked_names_exist():
    known = known_words()
    stale = {str(p.relative_to(REPO)): sorted(s) for p in tracked(".py") if (s := stale_names(p.read_text(), known))}
    assert not stale, stale
