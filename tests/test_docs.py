"""The front door stays true: the README is a landing page whose links resolve, the docs build as a site in strict
mode (a broken link or an unlisted page fails), every gapo command quoted in a fenced block exists and knows the
flags it is shown with, and the exit-code table is gapo.errors.Exit's."""

import contextlib
import io
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_the_readme_is_a_landing_page_with_the_gpu_quickstart_on_its_first_screen():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 220, len(lines)
    first = "\n".join(lines[:60])
    assert "make demo" in first and "make install-gpu" in first and "gapo-train --config qwen_math --nproc 8" in first


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_of_a_page_resolves(page):
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    targets = [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in t and not t.startswith("#")]
    missing = [t for t in targets if not (page.parent / t.split("#")[0]).exists()]
    assert not missing, missing


def test_the_docs_build_as_a_site_in_strict_mode(tmp_path):
    r = subprocess.run([str(Path(sys.executable).parent / "mkdocs"), "build", "--strict", "-q", "-d",
                        str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert (tmp_path / "site" / "own-data" / "index.html").is_file()


def documented_commands() -> list[tuple[str, str]]:
    """(page, command) for each gapo command line of a fenced block (continuations joined, `$ ` and comments off)."""
    out = []
    for page in PAGES:
        for block in re.findall(r"^```[^\n]*\n(.*?)^```", page.read_text(), flags=re.M | re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.removeprefix("$ ").split(" #")[0].strip()
                if re.match(r"gapo-(train|eval|sweep|compare|plot)\b", line):
                    out.append((page.name, line.split("&&")[0].strip()))
    return out


def help_of(words: list[str]) -> str:
    """The --help of the command (and its subcommand) that `words` runs, from the installed entry point."""
    from importlib.metadata import entry_points

    [ep] = [e for e in entry_points(group="console_scripts") if e.name == words[0]]
    sub = [words[1]] if words[0] == "gapo-compare" and len(words) > 1 and not words[1].startswith("-") else []
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        ep.load()([*sub, "--help"])
    return out.getvalue()


def test_every_documented_command_exists_and_knows_its_flags():
    commands = documented_commands()
    assert len(commands) >= 10 and any(c.startswith("gapo-train --config qwen_math") for _, c in commands)
    helps: dict[tuple, str] = {}
    for page, cmd in commands:
        words = shlex.split(cmd)
        key = tuple(words[:2]) if words[0] == "gapo-compare" else (words[0],)
        helps.setdefault(key, help_of(words))
        known = set(re.findall(r"(?<![\w-])(--[\w-]+)", helps[key]))  # whole option strings, not prefixes
        unknown = [w.split("=")[0] for w in words if w.startswith("--") and w.split("=")[0] not in known]
        assert not unknown, (page, cmd, unknown)


def test_the_exit_code_table_is_gapo_errors_exit():
    from gapo.errors import Exit

    text = (ROOT / "docs" / "commands.md").read_text().split("## Exit codes", 1)[1]
    rows = re.findall(r"^\| (\d+) \| (\w+) \|", text, flags=re.M)
    assert [(int(code), name) for code, name in rows] == [(e.value, e.name) for e in Exit]


def test_every_docs_page_the_code_and_configs_name_exists():
    """A moved or renamed page leaves no dead pointer in a docstring, a config header or the Makefile."""
    texts = [ROOT / "Makefile", ROOT / "mkdocs.yml", *PAGES]
    for folder in ("gapo", "bench", "configs", "experiments", "tests"):
        texts += [p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".yaml", ".md", ".sh")]
    named = {(p.relative_to(ROOT).as_posix(), ref) for p in texts
             for ref in re.findall(r"\bdocs/[\w./-]+\.(?:md|png)", p.read_text(errors="replace"))}
    assert len(named) > 20
    dead = sorted((where, ref) for where, ref in named if not (ROOT / ref).exists())
    assert not dead, dead
