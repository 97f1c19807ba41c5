"""The repository documents itself: no docstring or comment cites a document it does not hold.

A module's docstring carries its why, as long as the idea needs (there is no length cap: the cap
pushed module notes away from their code into ``docs/``). A docstring that mentions the architecture
(or a habit) names the file it means, such as ``docs/architecture.md``, and no text anywhere cites
numbered sections of a document that is not here.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import sidecar

REPO = Path(sidecar.__file__).parent.parent
PYTHON_FOLDERS = ("sidecar", "tests", "bench", "integration")
TEXT_FOLDERS = (*PYTHON_FOLDERS, "docs", "api", "deploy")
MENTION = re.compile(r"architecture|habit", re.IGNORECASE)
NAMES_A_DOC = re.compile(r"docs/[\w./-]+\.md")
# "architecture section 5", "architecture 4.1", "style habit 3", "section 6": a numbered part of a
# document that is not in the repository (docs/ has no numbered sections).
FOREIGN_CITATION = re.compile(r"architecture (section )?\d|style habits? \d|\bsection \d", re.IGNORECASE)


def python_files() -> list[Path]:
    return sorted(
        p
        for folder in PYTHON_FOLDERS
        for p in (REPO / folder).rglob("*.py")
        if not p.name.endswith("_pb2.py")
    )


def docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""


def test_every_python_folder_is_read() -> None:
    read = {p.relative_to(REPO).parts[0] for p in python_files()}
    assert read == set(PYTHON_FOLDERS)


def test_a_docstring_that_mentions_the_architecture_names_the_file_in_docs() -> None:
    vague = [
        str(p.relative_to(REPO))
        for p in python_files()
        if MENTION.search(docstring(p)) and not NAMES_A_DOC.search(docstring(p))
    ]
    assert vague == []
    for named in {m for p in python_files() for m in NAMES_A_DOC.findall(docstring(p))}:
        assert (REPO / named).is_file(), named


def test_no_text_cites_a_numbered_section_of_a_document_outside_the_repository() -> None:
    this = Path(__file__)
    found = []
    for folder in TEXT_FOLDERS:
        for path in sorted((REPO / folder).rglob("*")):
            if (
                not path.is_file()
                or path == this
                or path.suffix not in {".py", ".go", ".proto", ".md", ".yaml"}
            ):
                continue
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if FOREIGN_CITATION.search(line):
                    found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    readme = (REPO / "README.md").read_text()
    found += [f"README.md: {line}" for line in readme.splitlines() if FOREIGN_CITATION.search(line)]
    assert found == []


def test_the_probes_see_what_they_look_for() -> None:
    assert FOREIGN_CITATION.search("see architecture section 5")
    assert FOREIGN_CITATION.search("style habit 12")
    assert not FOREIGN_CITATION.search('``docs/architecture.md``, "Crash safety"')
    assert MENTION.search("the architecture")
    assert NAMES_A_DOC.search("see docs/architecture.md")
