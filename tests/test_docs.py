"""The front door stays true: the README and the site's home page are landing pages whose links resolve and whose
quickstarts agree, the docs build as a site in strict mode (a broken link or an unlisted page fails) whose search
answers in a real browser, every gapo command quoted in a fenced block exists and knows the flags it is shown with,
every module path a page names exists, the plans and the rewarder the pages show are what the code does, and the
exit-code table is gapo.errors.Exit's."""

import contextlib
import functools
import http.server
import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Material for MkDocs prints its end-of-life banner (2027-05-05; Zensical is its successor: docs/testing.md) on every
# build unless NO_MKDOCS_2_WARNING is set; the Makefile's `make docs` sets it too.
MKDOCS_ENV = {"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"}


def build_site(out: Path) -> None:
    r = subprocess.run([str(Path(sys.executable).parent / "mkdocs"), "build", "--strict", "-q", "-d", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, env=MKDOCS_ENV)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "end of life" not in r.stdout + r.stderr  # the banner stays off


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
    build_site(tmp_path / "site")
    assert (tmp_path / "site" / "own-data" / "index.html").is_file()
    commands = (tmp_path / "site" / "commands" / "index.html").read_text()
    assert "\\|" not in commands and "PATH&#124;auto" in commands  # a table cell's | shown as |, not as \|


def test_no_code_span_in_a_table_escapes_a_pipe():
    """Python-Markdown keeps the backslash of `a \\| b` inside a code span (GitHub drops it): such a cell is written
    as <code>a &#124; b</code>."""
    found = [(page.name, line) for page in PAGES for line in page.read_text().splitlines()
             if line.startswith("|") and any("\\|" in span for span in re.findall(r"`[^`]*`", line))]
    assert not found, found


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


def test_every_module_path_a_page_names_exists():
    """`gapo/reward/ifeval.py`, not a `gapo/ifeval.py` that moved; bench/ and tests/ files alike. A path the same
    line says was replaced (a dated measurement that names the script it ran) is history, not a pointer."""
    named = {(page.name, ref, line) for page in PAGES for line in page.read_text().splitlines()
             for ref in re.findall(r"(?<![\w/.-])((?:gapo|bench|tests)/[\w./-]*\.(?:py|sh))\b", line)}
    assert len({ref for _, ref, _ in named if ref.startswith("gapo/")}) > 20
    dead = sorted((page, ref) for page, ref, line in named
                  if not (ROOT / ref).exists() and not re.search(re.escape(ref) + r"[^;.]*since replaced", line))
    assert not dead, dead


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of each fenced block, in order."""
    return re.findall(r"^```(\w*)[^\n]*\n(.*?)^```", text, flags=re.M | re.S)


def test_the_readme_rewarder_scores_a_boxed_answer_and_its_command_loads_it(monkeypatch):
    """The README's own-data block as a reader copies it: the file its comment names, loaded by the command's plugins
    and chosen by its data.type, scores what the tiny model writes ("The answer is \boxed{6}.") as correct."""
    from gapo.data import Problem
    from gapo.reward import registry

    section = (ROOT / "README.md").read_text().split("## Your own model, data and rewarder", 1)[1].split("\n## ")[0]
    (lang, code), (_, command) = [b for b in fenced_blocks(section) if b[0] in ("python", "bash")][:2]
    assert lang == "python"
    monkeypatch.setattr(registry, "REWARDERS", dict(registry.REWARDERS))  # the block's register() stays here
    exec(compile(code, "my_reward.py", "exec"), {"__name__": "my_reward"})
    [kind] = set(registry.REWARDERS) - {"math", "code", "ifeval"}
    words = shlex.split(command.replace("\\\n", " "))
    assert f"data.type={kind}" in words and "plugins=[my_reward.py]" in words and f"data.type={kind}" in code
    assert "--config" in words and words[words.index("--config") + 1] == "tiny_cpu"  # small: seconds on a CPU
    problems = [Problem("a", "What is 3 + 3?", "6"), Problem("b", "What is 2 + 2?", "4")]
    results = registry.rewarder(kind).score([["The answer is \\boxed{6}.", "The answer is \\boxed{5}."],
                                             ["2 + 2 = 4", "no idea"]], problems, None)
    assert [[r.status for r in group] for group in results] == [["correct", "wrong"], ["correct", "wrong"]]


def plan_of(args: list[str]) -> str:
    """What `gapo-train ARGS` (a --plan) prints, run in this process (under a second)."""
    from gapo.cli import train_main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert train_main(args) == 0
    return out.getvalue()


def test_the_plans_the_one_gpu_page_quotes_are_what_plan_prints():
    text = (ROOT / "docs" / "one-gpu.md").read_text()
    shown = re.findall(r"^```\n\$ gapo-train ([^\n]*--plan[^\n]*)\n(.*?)^```", text, flags=re.M | re.S)
    assert shown
    for args, block in shown:
        printed = plan_of(shlex.split(args)).splitlines()
        assert printed[:len(block.splitlines())] == block.splitlines(), (args, "\n".join(printed))
    lora = re.search(r"`gapo-train (--config \S+ --plan 24,48 [^`]*)`\s+plans ([\d.]+) GB on a 24 GB GPU and "
                     r"([\d.]+) GB on a 48 GB one", text)
    assert lora, "the LoRA plan's sentence"
    peaks = re.findall(r"peak per GPU\s+([\d.]+)\s+of (\d+)\.0 GB", plan_of(shlex.split(lora[1])))
    assert peaks == [(lora[2], "24"), (lora[3], "48")]


def test_the_home_page_is_a_landing_page():
    """docs/index.md: the README's quickstart word for word, every algorithm by the name a config gives it, what has
    run where (the vLLM-on-CUDA path said not to have run while docs/cluster.md says so), and links to the pages."""
    from gapo.algorithms import PRESETS

    home = (ROOT / "docs" / "index.md").read_text()
    readme = (ROOT / "README.md").read_text()
    assert fenced_blocks(home)[0] == fenced_blocks(readme)[0]
    assert all(w in fenced_blocks(home)[0][1] for w in ("make install", "make demo", "make test"))
    algorithms = home.split("## Algorithms", 1)[1].split("\n## ")[0]
    names = re.findall(r"^\|[^|\n]+\|[^|\n]+\| `(\w+)` \|$", algorithms, flags=re.M)
    assert sorted(names) == sorted(PRESETS)
    where = home.split("## What has run where", 1)[1].split("\n## ")[0]
    if "the vLLM rows have not run on a GPU yet" in (ROOT / "docs" / "cluster.md").read_text():
        assert re.search(r"\| not run yet \| vLLM on a CUDA GPU", where)
    nav = re.findall(r":\s+(\S+\.md)$", (ROOT / "mkdocs.yml").read_text(), flags=re.M)
    assert set(nav) - {"index.md"} <= set(re.findall(r"\]\(([\w-]+\.md)\)", home))


def require_browser() -> str:
    """Debian's chromium; without it the test skips with the reason, or fails where CI or GAPO_REQUIRE_BROWSER is
    set (our CI installs it: .ci/run)."""
    browser = shutil.which("chromium", path="/usr/bin:/bin:/usr/local/bin")
    if browser is None:
        reason = "no /usr/bin/chromium (apt-get install chromium) to check the site's search in a browser"
        if os.environ.get("GAPO_REQUIRE_BROWSER", "") not in ("", "0") or os.environ.get("CI", "") not in (
                "", "0", "false"):
            pytest.fail(f"CI / GAPO_REQUIRE_BROWSER: {reason}", pytrace=False)
        pytest.skip(reason)
    return browser


class Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def dom_once(browser: str, url: str, ready: str, timeout: float = 15.0) -> str:
    """The page's DOM once the JavaScript expression `ready` is true (or at `timeout`), from headless Chromium
    driven over its DevTools pipe (fds 3 and 4). Not --dump-dom: with --virtual-time-budget it dumps the page before
    Material's search worker answers (measured: after 1.4 s, at "Initializing search", whatever the budget), as no
    reader's browser does."""
    to_chrome, from_chrome = os.pipe(), os.pipe()

    def pipes():
        os.dup2(to_chrome[0], 3)
        os.dup2(from_chrome[1], 4)
        os.set_inheritable(3, True)
        os.set_inheritable(4, True)

    profile = tempfile.mkdtemp(prefix="gapo-chromium-")
    proc = subprocess.Popen([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                             "--no-first-run", "--disable-background-networking", "--disable-component-update",
                             "--disable-sync", f"--user-data-dir={profile}", "--remote-debugging-pipe", "about:blank"],
                            preexec_fn=pipes, close_fds=False, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    os.close(to_chrome[0])
    os.close(from_chrome[1])
    send, receive = os.fdopen(to_chrome[1], "wb", buffering=0), os.fdopen(from_chrome[0], "rb", buffering=0)
    pending, ids = b"", iter(range(1, 1_000_000))

    def call(method: str, params: dict, session: str | None = None) -> dict:
        nonlocal pending
        n = next(ids)
        send.write(json.dumps({"id": n, "method": method, "params": params,
                               **({"sessionId": session} if session else {})}).encode() + b"\0")
        while True:
            while b"\0" not in pending:
                chunk = receive.read(1 << 16)
                assert chunk, "chromium closed its DevTools pipe"
                pending += chunk
            message, pending = pending.split(b"\0", 1)
            reply = json.loads(message)
            if reply.get("id") == n:
                assert "error" not in reply, reply
                return reply["result"]

    def evaluate(expression: str, session: str):
        return call("Runtime.evaluate", {"expression": expression, "returnByValue": True}, session)["result"].get(
            "value")

    try:
        target = call("Target.createTarget", {"url": url})["targetId"]
        session = call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        end = time.monotonic() + timeout
        while not evaluate(ready, session) and time.monotonic() < end:
            time.sleep(0.2)
        return evaluate("document.documentElement.outerHTML", session)
    finally:
        send.close()
        receive.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the browser and the helpers it started, by its own group
        proc.wait(timeout=30)
        shutil.rmtree(profile, ignore_errors=True)


def test_the_site_search_finds_the_landing_page_over_http(tmp_path):
    """Material's `?q=` opens the search with that query: a word only the home page has must list the home page."""
    browser = require_browser()
    site = tmp_path / "site"
    build_site(site)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    try:
        dom = dom_once(browser, base + "?q=Quickstart", "!!document.querySelector('.md-search-result__item')")
    finally:
        server.shutdown()
        server.server_close()
    meta = re.search(r'class="md-search-result__meta">\s*([^<]*?)\s*<', dom)
    links = re.findall(r'<li class="md-search-result__item">\s*<a href="([^"]+)"', dom)
    assert links, f"no search results; the search said: {meta[1] if meta else '?'}"
    assert base + "#quickstart" in links or base in links, links
