"""Every code block of README.md and docs/*.md runs, so the docs cannot drift from the code.

One test per Markdown file. Its fenced blocks run in order, in a fresh temporary
folder (the current directory while the file runs):

* ```python blocks: executed in ONE namespace per file (a later block sees the names
  of the earlier ones), in-process, against the installed mamba_ext.
* ```bash / ```console / ```sh blocks: every command (``$ `` prompt lines in a console
  block; every non-comment line of a bash block, ``\\`` continuations joined) must be
  ``python -m mamba_ext ...``, ``python3 -m mamba_ext ...`` or ``mamba-ext ...``; each
  runs as a subprocess with this interpreter and must exit 0.
* any other language (``c``, ``cython``, ...) must name the file it is, with
  ``<!-- file: NAME -->`` right before the fence: its text is written to NAME in the
  temporary folder, where a later python block builds it.
* ```text blocks are output or listings and are not run.
* ``<!-- quote: PATH -->`` before a block of any language: the block quotes the repository
  file PATH, and its code (``#`` comments and blank lines dropped, whitespace normalised)
  must appear there verbatim.

Comments right before a fence steer it:
``<!-- not-run: reason -->`` skips a block that cannot run in CI (a 2-minute default
run, a benchmark on an H200, an install command) — these are counted and listed;
``<!-- needs: gpu, compiler -->`` marks a block that needs a wgpu adapter, a C
compiler, Cython, torch or transformers: where one is missing that block is not run,
the others still are, and the file's test then skips naming what was missing (and
FAILS under CI=true, like every optional dependency of the suite).

A block with no language, or a runnable block that neither runs nor carries a
``not-run`` marker, fails the test.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOC_FILES = [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md"))

RUN_LANGS = {"python"}
SHELL_LANGS = {"bash", "console", "sh", "shell"}
TEXT_LANGS = {"text"}
COMMAND = re.compile(r"^(?:python3?\s+-m\s+mamba_ext|mamba-ext)(?:\s|$)")
FENCE = re.compile(r"^(\s*)(`{3,})\s*([\w+-]*)\s*$")
DIRECTIVE = re.compile(r"^<!--\s*([\w-]+)\s*:\s*(.*?)\s*-->\s*$")
COMMAND_TIMEOUT_S = 300


@dataclass
class Block:
    path: Path
    line: int                     # 1-based line of the opening fence
    lang: str
    text: str
    directives: dict = field(default_factory=dict)   # not-run / file / needs -> value

    @property
    def where(self) -> str:
        try:
            name = self.path.relative_to(REPO)
        except ValueError:
            name = self.path.name
        return f"{name}:{self.line}"


def parse_blocks(path: Path) -> list[Block]:
    """Fenced blocks of a Markdown file, with the ``<!-- key: value -->`` lines right
    before each (blank lines between them allowed)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, pending, i = [], {}, 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        d = DIRECTIVE.match(lines[i].strip())
        if d:
            pending[d.group(1)] = d.group(2)
        elif m:
            indent, ticks, lang = m.groups()
            j = i + 1
            while j < len(lines) and lines[j].strip() != ticks:
                j += 1
            if j == len(lines):
                raise AssertionError(f"{path.name}:{i + 1}: unclosed code fence")
            body = [ln[len(indent):] if ln.startswith(indent) else ln for ln in lines[i + 1:j]]
            blocks.append(Block(path, i + 1, lang.lower(), "\n".join(body) + "\n", pending))
            pending, i = {}, j
        elif lines[i].strip():
            pending = {}          # a directive applies only to the fence that follows it
        i += 1
    return blocks


def shell_commands(block: Block) -> list[str]:
    """The commands of a bash/console block (see the module docstring)."""
    lines = block.text.splitlines()
    if block.lang == "console":
        lines = [ln[2:] for ln in lines if ln.startswith("$ ")]
    cmds, cur = [], ""
    for ln in lines:
        s = ln.strip()
        if not cur and (not s or s.startswith("#")):
            continue
        cur += s[:-1] + " " if s.endswith("\\") else s
        if not s.endswith("\\"):
            cmds.append(cur.strip())
            cur = ""
    return cmds


def _strip_comment(cmd: str) -> str:
    """Drop a trailing ``# comment`` (outside quotes)."""
    lex = shlex.shlex(cmd, posix=True, punctuation_chars=False)
    lex.whitespace_split, lex.commenters = True, "#"
    return " ".join(shlex.quote(t) for t in lex)


def console_script() -> list[str]:
    """How to run ``mamba-ext``: the console script installed next to this interpreter
    (not one found elsewhere on PATH, which may belong to another installation)."""
    script = Path(sys.executable).parent / "mamba-ext"
    assert script.exists(), f"the mamba-ext console script is not installed next to {sys.executable}"
    return [str(script)]


def run_command(cmd: str, cwd: Path, where: str) -> None:
    argv = shlex.split(_strip_comment(cmd))
    if argv[0] == "mamba-ext":
        argv = console_script() + argv[1:]
    else:                                     # python / python3 -m mamba_ext ...
        argv = [sys.executable] + argv[1:]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=COMMAND_TIMEOUT_S)
    assert proc.returncode == 0, (f"{where}: `{cmd}` exited {proc.returncode}\n"
                                  f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}")


def gpu_available() -> bool:
    try:
        import mamba_ext.gpu as G
        return bool(G.available())
    except Exception:
        return False


def missing_needs(block: Block) -> list[str]:
    """What a block's ``<!-- needs: a, b -->`` names that this machine lacks."""
    missing = []
    for need in filter(None, (n.strip() for n in block.directives.get("needs", "").split(","))):
        if need == "gpu":
            if not gpu_available():
                missing.append("a wgpu adapter (pip install wgpu; a Vulkan driver such as "
                               "Debian's mesa-vulkan-drivers)")
        elif need == "compiler":
            cc = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()[0]
            if shutil.which(cc) is None:
                missing.append(f"a C compiler ({cc} is not on PATH)")
        elif need in ("torch", "transformers", "cython"):
            try:
                __import__("Cython" if need == "cython" else need)
            except Exception as e:
                missing.append(f"{need} ({type(e).__name__}: {e}; pip install '.[test]' "
                               f"torch==2.13.0)")
        else:
            raise AssertionError(f"{block.where}: unknown <!-- needs: {need} --> "
                                 f"(known: gpu, compiler, cython, torch, transformers)")
    return missing


def _normalised(text: str) -> str:
    lines = (ln.split("#")[0].strip() for ln in text.splitlines())
    return " ".join(" ".join(ln.split()) for ln in lines if ln)


def check_quote(block: Block) -> None:
    source = REPO / block.directives["quote"]
    assert source.is_file(), f"{block.where}: quoted file {source} does not exist"
    assert _normalised(block.text) in _normalised(source.read_text(encoding="utf-8")), \
        f"{block.where}: the block no longer matches {block.directives['quote']}"


def classify(block: Block) -> str:
    """'python', 'shell', 'file', 'quote', 'text' or 'not-run'; AssertionError if unrunnable."""
    if "quote" in block.directives:
        return "quote"
    if "not-run" in block.directives:
        assert block.directives["not-run"], f"{block.where}: not-run needs a reason"
        return "not-run"
    if not block.lang:
        raise AssertionError(f"{block.where}: code fence without a language "
                             f"(python, bash, console, text, c, cython, ...)")
    if block.lang in TEXT_LANGS:
        return "text"
    if block.lang in RUN_LANGS:
        return "python"
    if block.lang in SHELL_LANGS:
        cmds = shell_commands(block)
        assert cmds, f"{block.where}: {block.lang} block without a command"
        bad = [c for c in cmds if not COMMAND.match(c)]
        assert not bad, (f"{block.where}: {bad[0]!r} is not a `python -m mamba_ext`/`mamba-ext` "
                         f"command; mark the block <!-- not-run: reason --> if it cannot run here")
        return "shell"
    assert "file" in block.directives, (
        f"{block.where}: a ```{block.lang} block must be written to a file for a later python "
        f"block to build (<!-- file: NAME -->) or be marked <!-- not-run: reason -->")
    return "file"


def run_doc(path: Path, tmp_path: Path, monkeypatch) -> dict:
    blocks = parse_blocks(path)
    kinds = [classify(b) for b in blocks]      # every problem is found before anything runs
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))    # blocks may add the folder they build in
    namespace = {"__name__": "__docs__"}
    counts = dict.fromkeys(("python", "shell", "file", "quote", "text", "not-run", "missing"), 0)
    skipped = []
    for b, kind in zip(blocks, kinds):
        missing = missing_needs(b) if kind in ("python", "shell") else []
        if missing:                          # this block only; the others still run
            skipped.append(f"{b.where} needs {', '.join(missing)}")
            counts["missing"] += 1
            continue
        counts[kind] += 1
        if kind == "python":
            try:
                exec(compile(b.text, b.where, "exec"), namespace)
            except Exception as e:
                raise AssertionError(f"{b.where}: python block failed: {type(e).__name__}: {e}") from e
        elif kind == "shell":
            for cmd in shell_commands(b):
                run_command(cmd, tmp_path, b.where)
        elif kind == "quote":
            check_quote(b)
        elif kind == "file":
            target = tmp_path / b.directives["file"]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(b.text, encoding="utf-8")
    counts["skipped"] = skipped
    return counts


@pytest.mark.parametrize("path", DOC_FILES, ids=[str(p.relative_to(REPO)) for p in DOC_FILES])
def test_doc_blocks_run(path, tmp_path, monkeypatch, record_property):
    counts = run_doc(path, tmp_path, monkeypatch)
    skipped = counts.pop("skipped")
    for k, v in counts.items():
        record_property(k, v)
    print(f"{path.name}: {counts}")
    if skipped:     # the optional-dependency rule of the suite: skip locally, fail under CI
        msg = "blocks not run for a missing optional dependency: " + "; ".join(skipped)
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("CI=true: " + msg, pytrace=False)
        pytest.skip(msg)


def test_every_docs_page_is_found():
    names = {p.name for p in DOC_FILES}
    for want in ("README.md", "api.md", "cli.md", "gpu.md", "c_api.md", "semantics.md",
                 "performance.md", "development.md"):
        assert want in names, f"{want} missing (README links to it)"


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown file (lower case, punctuation dropped,
    spaces to hyphens), headings inside code fences excluded."""
    out, in_fence = set(), False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def test_links_resolve():
    """Every relative link of README.md and docs/*.md points to an existing file, and
    every ``#anchor`` to a heading of that file."""
    for path in DOC_FILES:
        text = path.read_text(encoding="utf-8")
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", text):
            if re.match(r"^[a-z]+:", target):
                continue
            dest = (path.parent / target) if target else path
            assert dest.exists(), f"{path.name}: broken link {target}"
            if anchor and dest.suffix == ".md":
                assert anchor in anchors(dest), f"{path.name}: no heading #{anchor} in {dest.name}"


def test_parser_refuses_unmarked_blocks(tmp_path):
    """The rules above can fail: an unlabeled fence, a foreign shell command, a C block
    with no file name are each refused; a marked one is counted as not-run."""
    doc = tmp_path / "x.md"
    cases = {
        "```\nprint(1)\n```\n": "without a language",
        "```bash\npip install foo\n```\n": "is not a",
        "```c\nint x;\n```\n": "must be written to a file",
    }
    for text, why in cases.items():
        doc.write_text(text)
        b, = parse_blocks(doc)
        with pytest.raises(AssertionError, match=why):
            classify(b)
    doc.write_text("<!-- not-run: needs an H200 -->\n```bash\npip install foo\n```\n")
    b, = parse_blocks(doc)
    assert classify(b) == "not-run"
    doc.write_text("<!-- quote: setup.py -->\n```python\nimport no_such_module_here\n```\n")
    b, = parse_blocks(doc)
    with pytest.raises(AssertionError, match="no longer matches setup.py"):
        check_quote(b)
    doc.write_text("<!-- not-run: x -->\ntext between\n```bash\npip install foo\n```\n")
    b, = parse_blocks(doc)
    assert "not-run" not in b.directives      # a marker applies only right before its fence


def test_failing_blocks_fail(tmp_path, monkeypatch):
    """A python block that raises and a command that exits non-zero fail the file; the
    namespace carries from one python block to the next."""
    doc = tmp_path / "y.md"
    doc.write_text("```python\nx = 2\n```\n\n```python\nassert x == 3, 'x is 2'\n```\n")
    with pytest.raises(AssertionError, match="y.md:5: python block failed: AssertionError: x is 2"):
        run_doc(doc, tmp_path, monkeypatch)
    doc.write_text("```bash\npython -m mamba_ext no-such-command\n```\n")
    with pytest.raises(AssertionError, match="exited 2"):
        run_doc(doc, tmp_path, monkeypatch)


def test_readme_is_a_front_page():
    n = len((REPO / "README.md").read_text(encoding="utf-8").splitlines())
    assert 100 <= n <= 200, f"README.md has {n} lines; it is the front page (~150), details go to docs/"
