"""The documentation runs as written: every code block of README.md and of the guides (docs/) that can run on this
machine runs, in order, page by page, in a fresh folder, against servers on loopback; a block that cannot says why in
an HTML comment just before it. And `mkdocs build --strict` builds the site without a warning.

The comment before a block (the last non-blank line before its fence) says what to do with it:

- none: run it (`python`: as a script; `bash`: `bash -euo pipefail`), and it must exit 0;
- `<!-- skip: WHY -->`: do not run it (a GPU, the network or an API key, a fragment, minutes of training); WHY is
  required;
- `<!-- serve -->`: a server, started in the background for the rest of the page (the page's port must answer);
- `<!-- file: NAME -->`: written to NAME in the page's folder, for a later block to use.

Port 8000, the one the pages use, is replaced by a free port. Blocks of output (`text`, or no language) are not code.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
CODE = {"python", "py", "bash", "sh", "shell", "console"}
PORT = "8000"
_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)\s*(?P<lang>[\w+-]*)[^\n]*$")
_MARKER = re.compile(r"^<!--\s*(?P<kind>skip|serve|file)\b:?\s*(?P<arg>.*?)\s*-->$")
#: Names a block may use before they exist (a block using one runs once it does; "stop": the page stops there, as
#: later blocks need what it makes; else that block alone is left out). Empty: everything the docs use exists.
_LANDING: dict[str, tuple[str, str]] = {}


@dataclass
class Block:
    page: Path
    line: int
    lang: str
    code: str
    kind: str  # run, skip, serve, file
    arg: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The page's fenced code blocks with the marker before each."""
    found, lines, i = [], page.read_text(encoding="utf-8").splitlines(), 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        start, fence, indent = i, match["fence"], len(match["indent"])
        i += 1
        body = []
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][indent:])
            i += 1
        i += 1
        before = next((line.strip() for line in reversed(lines[:start]) if line.strip()), "")
        marker = _MARKER.match(before)
        kind, arg = (marker["kind"], marker["arg"]) if marker else ("run", "")
        found.append(Block(page, start + 1, match["lang"].lower(), "\n".join(body) + "\n", kind, arg))
    return found


def code_blocks(page: Path) -> list[Block]:
    return [block for block in blocks(page) if block.lang in CODE]


def test_every_code_block_runs_or_says_why_not() -> None:
    """Each block is marked with a known marker, a skip gives its reason, and a file marker names a file."""
    problems = []
    for page in PAGES:
        for block in code_blocks(page):
            if block.kind == "skip" and not block.arg:
                problems.append(f"{block.where}: `skip` without a reason")
            if block.kind == "file" and not re.fullmatch(r"[\w.-]+", block.arg):
                problems.append(f"{block.where}: `file` needs a plain file name")
            if block.kind == "serve" and block.lang in ("python", "py"):
                problems.append(f"{block.where}: a server block is bash")
    assert problems == [], "\n".join(problems)
    assert sum(block.kind == "run" for page in PAGES for block in code_blocks(page)) >= 8


def _free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def _wait_for_port(port: str, server: subprocess.Popen, where: str) -> None:
    for _ in range(600):  # bounded: 600 tries, 0.1 s apart
        if server.poll() is not None:
            pytest.fail(f"{where}: the server exited ({server.returncode}) before it answered")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", int(port))) == 0:
                return
        time.sleep(0.1)
    pytest.fail(f"{where}: nothing answered on port {port}")


def _landed(name: str) -> bool:
    where, _, what = _LANDING[name][0].partition(":")
    if where == "cli":
        command, flag = what.split()
        run = subprocess.run([sys.executable, "-m", "ors_trl", command, "--help"], capture_output=True, text=True,
                             timeout=120, env=_env())
        return flag in run.stdout
    module = __import__(where, fromlist=[what])
    return hasattr(module, what)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env.setdefault("OPENREWARD_DISABLE_UPDATE_CHECK", "1")
    env["NO_MKDOCS_2_WARNING"] = "1"  # Material's end-of-life banner
    return env


RUNNABLE = [page for page in PAGES if any(block.kind != "skip" for block in code_blocks(page))]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("page", RUNNABLE, ids=[str(page.relative_to(ROOT)) for page in RUNNABLE])
def test_page_runs(page: Path, tmp_path: Path) -> None:
    """The page's runnable blocks, in order, in a fresh folder, as a user would copy them."""
    pytest.importorskip("trl")
    pytest.importorskip("openreward")
    port, env, servers = _free_port(), _env(), []
    ran, pending = 0, []  # blocks run; the block that uses a name not there yet
    try:
        for block in code_blocks(page):
            if block.kind == "skip":
                continue
            if missing := [name for name in _LANDING if name in block.code and not _landed(name)]:
                pending.append(f"{block.where} ({', '.join(missing)})")
                if any(_LANDING[name][1] == "stop" for name in missing):
                    break
                continue
            code = block.code.replace(f"127.0.0.1:{PORT}", f"127.0.0.1:{port}").replace(f"--port {PORT}",
                                                                                        f"--port {port}")
            if block.kind == "file":
                (tmp_path / block.arg).write_text(code.replace(f"port={PORT}", f"port={port}"), encoding="utf-8")
                continue
            if block.lang in ("python", "py"):
                script = tmp_path / f"block_{block.line}.py"
                script.write_text(code, encoding="utf-8")
                command = [sys.executable, str(script)]
            else:
                command = ["bash", "-euo", "pipefail", "-c", code]
            if block.kind == "serve":
                log = open(tmp_path / f"server_{block.line}.log", "wb")  # noqa: SIM115 (closed with the server)
                servers.append((subprocess.Popen(command, cwd=tmp_path, env=env, stdout=log, stderr=log,
                                                 start_new_session=True), log))
                _wait_for_port(port, servers[-1][0], block.where)
                continue
            run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
            assert run.returncode == 0, f"{block.where} exited {run.returncode}:\n{run.stdout[-3000:]}\n" \
                                        f"{run.stderr[-3000:]}"
            ran += 1
    finally:
        for server, log in servers:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait(timeout=30)
            log.close()
    if pending:
        pytest.skip(f"ran {ran} blocks; not {pending}: another branch of issue 34 adds what it uses")
    assert ran > 0


def test_site_builds_without_a_warning(tmp_path: Path) -> None:
    """`make docs`: `mkdocs build --strict` (every page in the nav, every link and anchor resolving, every public
    name's docstring rendering) exits 0."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, env=_env())
    assert run.returncode == 0, run.stderr[-5000:]
    assert (tmp_path / "site" / "reference" / "spec" / "index.html").exists()


def test_readme_is_short_and_its_links_resolve() -> None:
    """The README stays a front page (what it is, the two commands, the quick start, a map of the docs): at most 300
    lines, every relative link naming a file of the checkout."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if "://" not in link]
    assert len(local) >= 10
    assert [link for link in local if not (ROOT / link).exists()] == []


def test_every_public_name_is_in_the_reference() -> None:
    """`ors_trl.__all__` and `ors_trl.testing.__all__`: each name has a `::: ` entry on a reference page (an alias,
    such as `PolicyReply`, as its class under `heading: NAME`)."""
    import ors_trl
    import ors_trl.testing

    entries = set()
    for page in (ROOT / "docs" / "reference").glob("*.md"):
        for line in page.read_text(encoding="utf-8").splitlines():  # `::: path`, or a heading that renames it
            if line.startswith("::: ") or line.strip().startswith("heading: "):
                entries.add(line.strip().split(" ", 1)[1].strip().rsplit(".", 1)[-1])
    public = {name for name in [*ors_trl.__all__, *ors_trl.testing.__all__] if not name.startswith("__")}
    assert public - entries == set()
