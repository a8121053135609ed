"""The README against the code and the records: a switch added without its row, a flag renamed, a default changed or
a cited record moved away fails here instead of leaving the README quietly wrong."""
from __future__ import annotations

import re

import pytest

from repo_scripts import REPO, RESULTS, tracked_files
from sglang_h20 import settings

README = (REPO / "README.md").read_text()


def switch_rows() -> dict[str, list[str]]:
    """The feature-switch table's rows by variable: [variable, flag, values, what, status] with backticks kept."""
    rows = {}
    for line in README.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if line.startswith("| `SGLANG_H20_") and len(cells) == 5:
            rows[cells[0].strip("`")] = cells
    return rows


@pytest.mark.parametrize("switch", settings.SWITCHES, ids=lambda s: s.name)
def test_every_switch_has_its_row_flag_and_default(switch):
    rows = switch_rows()
    assert switch.env in rows, f"README's switch table has no row for {switch.env}"
    _, flag, values, _, _ = rows[switch.env]
    assert flag == f"`{switch.flag}`"
    if switch.default:  # a path switch's default is empty: its values cell says "path"
        first = re.match(r"`([^`]*)`", values)
        assert first and first.group(1) == switch.default, (values, switch.default)
    else:
        assert values == "path"


def test_the_table_has_no_row_for_a_switch_that_does_not_exist():
    assert set(switch_rows()) == {s.env for s in settings.SWITCHES}


def expand_braces(name: str) -> list[str]:
    """'a{,_b}_c' -> ['a_c', 'a_b_c']: the one brace group the docs use to name a record and its rerun together."""
    brace = re.search(r"\{([^}]*)\}", name)
    return [name[:brace.start()] + alt + name[brace.end():] for alt in brace.group(1).split(",")] if brace else [name]


def cited_records(text: str = README) -> set[str]:
    """Every `folder/file.json`-like name in backticks (brace alternatives expanded), relative to benchmark/results."""
    return {n for m in re.finditer(r"`((?:[a-z_0-9]+/)?[A-Za-z0-9_.{},-]+\.(?:json|png|log)(?:\.xz)?)`", text)
            for n in expand_braces(m.group(1))}


def test_cited_records_exist():
    cited = cited_records()
    assert len(cited) > 30  # the pattern still finds the measured-so-far table's records
    missing = sorted(n for n in cited if "/" in n and not (RESULTS / n).exists())
    assert not missing, missing


def test_the_two_setup_commands_exist():
    assert "    bash scripts/gpu_check.sh\n" in README and "    bash scripts/test.sh\n" in README
    assert (REPO / "scripts" / "gpu_check.sh").is_file() and (REPO / "scripts" / "test.sh").is_file()


def is_tracked(name: str, names: set[str]) -> bool:
    """Whether a cited record is among the tracked file names, as cited or stored .xz (large records, session 49)."""
    return bool({name, name + ".xz", name.removesuffix(".xz")} & names)


NOT_TRACKED = {"MANIFEST.txt"}  # the devkit's, built beside the checkout (.devkit/), never committed


def test_files_cited_by_the_result_readmes_and_kernel_notes_exist():
    """Every backticked record name in benchmark/results' READMEs and sgl-kernel-ext/NOTES.md is a tracked file
    (found by name, or stored .xz since session 49): a record renamed, moved or never committed fails here."""
    names = {p.name for p in tracked_files()} | NOT_TRACKED
    docs = [REPO / "sgl-kernel-ext" / "NOTES.md", RESULTS / "README.md", *sorted(RESULTS.glob("*/README.md"))]
    cited = {(d.relative_to(REPO).as_posix(), n.rsplit("/", 1)[-1]) for d in docs for n in cited_records(d.read_text())}
    assert len(cited) > 300  # the pattern still finds the records
    missing = sorted((d, n) for d, n in cited if not is_tracked(n, names) and not n.startswith(("_", ".")))
    assert not missing, missing


GPU_RECORD = re.compile(r"\b[a-z][a-z0-9_{},]*_h(?:100|200)\.json(?:\.xz)?")


def test_records_the_package_names_are_tracked():
    """The plugin's log lines and comments back their numbers with record names (sbo's cost line, the tables'
    sources): each is a tracked file, so a claim the server prints at start-up can be looked up."""
    names = {p.name for p in tracked_files()}
    sources = [p for root in ("python", "sgl-kernel-ext") for p in sorted((REPO / root).rglob("*.py"))]
    cited = {(p.relative_to(REPO).as_posix(), n) for p in sources for m in GPU_RECORD.finditer(p.read_text())
             for n in expand_braces(m.group(0))}
    assert len(cited) > 20  # the pattern still finds them
    missing = sorted((p, n) for p, n in cited if not is_tracked(n, names))
    assert not missing, missing
