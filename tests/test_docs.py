"""The documentation runs: every fenced ```python block of README.md and docs/*.md is executed (the blocks of one
page in order, in one fresh namespace, with a temporary working directory), and every relative link of the pages
points to an existing file (and, into a Markdown page, to an existing heading)."""

import pathlib
import re
import unicodedata

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
CODE_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK_PAGES = [*CODE_PAGES, ROOT / "CHANGELOG.md"]
PYTHON_TAGS = {"python", "py", "python3"}
_FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def fenced_blocks(text: str) -> list[tuple[str, int, str]]:
  """(language tag, line number of the block's first code line (1-based), code) for every fenced block."""
  blocks, lines, i = [], text.splitlines(), 0
  while i < len(lines):
    m = _FENCE.match(lines[i])
    if not m:
      i += 1
      continue
    fence, tag, start = m.group(1), m.group(2).lower(), i + 1
    i += 1
    while i < len(lines) and not lines[i].strip().startswith(fence):
      i += 1
    blocks.append((tag, start + 1, "\n".join(lines[start:i])))
    i += 1
  return blocks


def python_blocks(page: pathlib.Path) -> list[tuple[int, str]]:
  return [(line, code) for tag, line, code in fenced_blocks(page.read_text()) if tag in PYTHON_TAGS]


def prose(text: str, code_spans: bool = False) -> str:
  """The page without fenced blocks and, unless code_spans, inline code spans (where a bracket is not a link)."""
  lines, out, fence = text.splitlines(), [], None
  for line in lines:
    m = _FENCE.match(line)
    if fence is None and m:
      fence = m.group(1)
    elif fence is not None and line.strip().startswith(fence):
      fence = None
    elif fence is None:
      out.append(line if code_spans else re.sub(r"`+[^`]*`+", "", line))
  return "\n".join(out)


def slug(heading: str) -> str:
  """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
  text = re.sub(r"`|\*\*|__", "", heading.strip()).lower()
  text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
  return text.replace(" ", "-")


def anchors(page: pathlib.Path) -> set[str]:
  seen: dict[str, int] = {}
  out = set()
  for line in prose(page.read_text(), code_spans=True).splitlines():
    m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
    if m:
      s = slug(m.group(1))
      out.add(f"{s}-{seen[s]}" if s in seen else s)
      seen[s] = seen.get(s, 0) + 1
  return out


def test_the_pages_have_python_blocks():
  """Guards the tests below against passing vacuously (a fence-parsing slip would find nothing to run)."""
  counts = {p.relative_to(ROOT).as_posix(): len(python_blocks(p)) for p in CODE_PAGES}
  assert counts["README.md"] >= 1, counts
  assert sum(counts.values()) >= 5, counts
  # the parser sees a block exactly as written
  (tag, line, code), = fenced_blocks("text\n```python\nx = 1\n\ny = 2\n```\nmore\n")
  assert (tag, line, code) == ("python", 3, "x = 1\n\ny = 2")


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in CODE_PAGES if python_blocks(p)], ids=lambda p: p.name)
def test_python_blocks_run(page, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  namespace = {"__name__": f"doc_{page.stem}"}
  for line, code in python_blocks(page):
    # padded so a traceback names the page and the line of the Markdown file
    exec(compile("\n" * (line - 1) + code, str(page), "exec"), namespace)


def broken_links(page: pathlib.Path) -> list[str]:
  """Relative links of a page whose file, or whose heading in a Markdown file, does not exist."""
  broken = []
  for target in _LINK.findall(prose(page.read_text())):
    if _EXTERNAL.match(target):
      continue
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    if not dest.exists():
      broken.append(f"{page.name}: ({target}): no such file")
    elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
      broken.append(f"{page.name}: ({target}): no heading with that anchor in {dest.name}")
  return broken


def test_relative_links_point_to_existing_files():
  links = sum(len(_LINK.findall(prose(p.read_text()))) for p in LINK_PAGES)
  assert links >= 20  # the pages do link to each other, so the check below has something to check
  assert [b for p in LINK_PAGES for b in broken_links(p)] == []


def test_a_broken_link_is_caught(tmp_path):
  (tmp_path / "other.md").write_text("# Layers under `lax.scan`\n## Your first real run: SmolLM2-135M-Instruct\n")
  page = tmp_path / "page.md"
  page.write_text("# Top\n[ok](other.md#layers-under-laxscan) ![img](other.md) [self](#top)\n"
                  "[file](missing.md) [anchor](other.md#nowhere) [web](https://example.org/x.md)\n"
                  "`[code](not-a-link.md)`\n```\n[fenced](nope.md)\n```\n")
  assert anchors(tmp_path / "other.md") == {"layers-under-laxscan", "your-first-real-run-smollm2-135m-instruct"}
  assert broken_links(page) == ["page.md: (missing.md): no such file",
                                "page.md: (other.md#nowhere): no heading with that anchor in other.md"]


# every command that runs a module of the lab or train/ (the docs, configs' comments, scripts, the lab's docstrings
# and tests' strings), so a moved module cannot leave a stale command behind
COMMAND_FILES = [*CODE_PAGES, *sorted((ROOT / "configs").glob("*.yaml")), *sorted((ROOT / "scripts").glob("*")),
                 *sorted((ROOT / "experiments").rglob("*.py")), *sorted((ROOT / "tests").rglob("*.py"))]
_COMMAND = re.compile(r"(?:python -m |fixed_op_times\.py )((?:experiments|train)(?:\.\w+)+)")


def missing_modules(text: str) -> list[str]:
  """Modules the text's commands run that are neither a module file nor a package with a __main__.py."""
  out = []
  for mod in _COMMAND.findall(text):
    path = ROOT.joinpath(*mod.split("."))
    if not (path.with_suffix(".py").is_file() or (path / "__main__.py").is_file()):
      out.append(mod)
  return out


def test_commands_run_existing_modules():
  texts = {f: f.read_text() for f in COMMAND_FILES if f.is_file() and f != pathlib.Path(__file__).resolve()}
  assert sum(len(_COMMAND.findall(t)) for t in texts.values()) >= 50  # the pages do name commands
  assert [f"{f.relative_to(ROOT)}: {m}" for f, t in texts.items() for m in missing_modules(t)] == []


def test_a_stale_command_is_caught():
  text = ("`python -m experiments.bench_exposure --config x`, python -m experiments.exposure.main --config x,\n"
          "python -m train.grpo, python scripts/fixed_op_times.py experiments.bench --out DIR, python -m train.nope.")
  assert missing_modules(text) == ["experiments.bench_exposure", "experiments.bench", "train.nope"]
