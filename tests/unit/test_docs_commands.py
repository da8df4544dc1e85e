"""Every ``gpuclusters`` command the docs show (README.md and docs/*.md,
in their bash blocks) names a command this CLI has, with options it takes:
docs that drift from the code fail here. (What the commands do is tested
elsewhere; the README's quickstart is run as written by
tests/e2e/test_readme_quickstart.py.)"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import typer

from gpuclusters.cli.main import app

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"^```(?:bash|sh|console)\n(.*?)^```", re.M | re.S)
_ENV = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")


def documented_commands() -> list[tuple[str, list[str]]]:
    """(where, argv after `gpuclusters`) for every documented invocation."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for block in _BLOCK.finditer(text):
            first = text[: block.start(1)].count("\n") + 1
            for i, line in enumerate(block.group(1).splitlines()):
                line = re.sub(r"\s+#(\s.*)?$", "", line).strip()
                for part in re.split(r"\s*(?:&&|\|\||;|\|)\s*", line):
                    try:
                        words = shlex.split(part)
                    except ValueError:
                        continue
                    while words and _ENV.match(words[0]):
                        words = words[1:]
                    if words and words[0] == "gpuclusters":
                        found.append((f"{doc.relative_to(ROOT)}:{first + i}", words[1:]))
    return found


def _check(argv: list[str]) -> str | None:
    """Why ``gpuclusters argv`` is not a command with these options, or None."""
    cmd: Any = typer.main.get_command(app)
    rest = list(argv)
    # A group has subcommands (typer's own click: duck-typed).
    while getattr(cmd, "commands", None) is not None:
        if not rest or rest[0].startswith("-"):
            return None if not rest or rest[0] in ("--help", "--version") else "no command"
        sub = cmd.commands.get(rest[0])
        if sub is None:
            return f"no command {rest[0]!r}"
        cmd, rest = sub, rest[1:]
    names = {opt for p in cmd.params for opt in (*p.opts, *p.secondary_opts)}
    for word in rest:
        if word == "--":
            break
        if word.startswith("-") and word != "-":
            name = word.split("=", 1)[0]
            if name not in names | {"--help"}:
                return f"{cmd.name}: no option {name}"
    return None


def test_the_docs_show_commands() -> None:
    assert len(documented_commands()) > 50  # the parser finds them


def test_every_documented_command_exists_with_its_options() -> None:
    wrong = [f"{where}: gpuclusters {' '.join(argv)}: {why}"
             for where, argv in documented_commands()
             if (why := _check(argv)) is not None]  # fmt: skip
    assert not wrong, "\n".join(wrong)


def test_the_check_can_fail() -> None:
    assert _check(["clusters", "create", "x", "--gpus", "8"]) is None
    assert _check(["clusters", "frobnicate"]) == "no command 'frobnicate'"
    assert _check(["clusters", "create", "x", "--gpu", "8"]) == "create: no option --gpu"


def command_path(argv: list[str]) -> tuple[str, ...]:
    """The subcommand words of ``gpuclusters argv`` (``clusters create``)."""
    cmd: Any = typer.main.get_command(app)
    rest, path = list(argv), []
    while getattr(cmd, "commands", None) is not None and rest and not rest[0].startswith("-"):
        sub = cmd.commands.get(rest[0])
        if sub is None:
            break
        path.append(rest[0])
        cmd, rest = sub, rest[1:]
    return tuple(path)


def _runs(path: tuple[str, ...], tests_source: str) -> bool:
    """Whether some test runs this command: as an argv (``"clusters",
    "create"``, to CliRunner, a ``cli(...)`` helper or a subprocess) or as
    a command line (``gpuclusters clusters create``). The README's
    quickstart counts: tests/e2e/test_readme_quickstart.py runs it."""
    words = ", ".join(f'"{w}"' for w in path)
    return (
        re.search(rf"[\[(]\s*(?:[\w.]+,\s*)*{re.escape(words)}\s*[,)\]]", tests_source) is not None
        or f"gpuclusters {' '.join(path)}" in tests_source
    )


def _quickstart_paths() -> set[tuple[str, ...]]:
    readme = (ROOT / "README.md").read_text()
    block = _BLOCK.search(readme, readme.index("## Quickstart"))
    assert block is not None
    paths = set()
    for line in block.group(1).splitlines():
        words = shlex.split(re.sub(r"\s+#(\s.*)?$", "", line))
        if words[:1] == ["gpuclusters"]:
            paths.add(command_path(words[1:]))
    return paths


def test_every_documented_command_is_run_by_a_test() -> None:
    tests_source = "\n".join(
        p.read_text() for p in (ROOT / "tests").rglob("*.py") if p.name != Path(__file__).name
    )
    quickstart = _quickstart_paths()
    assert ("clusters", "create") in quickstart  # the block was found
    documented: dict[tuple[str, ...], str] = {}
    for where, argv in documented_commands():
        documented.setdefault(command_path(argv), where)
    untested = [
        f"{where}: gpuclusters {' '.join(path)}"
        for path, where in sorted(documented.items())
        if path and path not in quickstart and not _runs(path, tests_source)
    ]
    assert not untested, "documented but run by no test:\n" + "\n".join(untested)


def test_the_run_check_can_fail() -> None:
    assert _runs(("clusters", "create"), 'cli("clusters", "create", "x")')
    assert _runs(("builds",), 'invoke(app, ["builds", "--wait"])')
    assert not _runs(("clusters", "create"), '"clusters", "created"')
    assert not _runs(("builds",), 'x = "builds"')
