"""mkdocs hooks for the docs site (mkdocs.yml names this file).

- The result plots committed under experiments/results/ and benchmarks/results/ are published
  at assets/<their path in the repository>, so pages embed them without a second copy in docs/.
- Before the build, every public module, class, function and method of the library must have a
  docstring (its own or one inherited from a base class), and every public module must be
  rendered somewhere in the API reference (a `::: module` line under docs/api/). Each gap is a
  warning, so `mkdocs build --strict` fails on it.
- Every table on a results page (docs/results/) is followed by its provenance line:
  `Recorded DATE, MACHINE: `COMMAND` -> `RESULT FILE`` (a date, the machine in words: CPU
  cores or a GPU, the command in backticks, and at least one backticked result path that
  exists in the repository). A table without one is a warning, so --strict fails on it.
- Tables that the library declares are generated where a page has their marker
  (`<!-- generated: parameters -->`, `<!-- generated: algorithms -->`): grace_from_params'
  keys from spardl_grace.registry.PARAMS, the communicators from ALGORITHMS.
"""
from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

import griffe
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("spardl_grace", "deepreduce_compat")
RESULT_DIRS = ("experiments/results", "benchmarks/results")
log = logging.getLogger("mkdocs.hooks.spardl")


def _public(name: str) -> bool:
    return not name.startswith("_")


def load(packages: tuple[str, ...] = PACKAGES,
         search_paths: list[Path] | None = None) -> list[griffe.Module]:
    """`packages` read statically by griffe (as mkdocstrings reads them), with docstrings
    inherited from base classes."""
    loader = griffe.GriffeLoader(search_paths=[str(p) for p in search_paths or [ROOT]],
                                 extensions=griffe.load_extensions("griffe_inherited_docstrings"))
    modules = [loader.load(name) for name in packages]
    loader.resolve_aliases(implicit=False, external=False)
    return modules


def _walk(obj: griffe.Object):
    """obj and its public modules, classes and functions, depth first (aliases skipped)."""
    yield obj
    for name, member in obj.members.items():
        if member.is_alias or not _public(name):
            continue
        if member.is_module or member.is_class:
            yield from _walk(member)
        elif member.is_function:
            yield member


def missing_docstrings(packages: list[griffe.Module]) -> list[str]:
    """Dotted paths of the public modules, classes, functions and methods of the loaded
    `packages` that have no docstring of their own and inherit none."""
    missing = []
    for package in packages:
        for obj in _walk(package):
            if not obj.docstring or not obj.docstring.value.strip():
                missing.append(obj.path)
    return missing


def public_modules(packages: list[griffe.Module]) -> list[str]:
    """Dotted names of every public module of the loaded `packages`, the packages included."""
    return [obj.path for package in packages for obj in _walk(package) if obj.is_module]


def modules_missing_from_reference(api_dir: Path, modules: list[str]) -> list[str]:
    """The modules that no `::: name` line of the API reference's pages renders."""
    rendered = set()
    for page in api_dir.glob("*.md"):
        rendered |= set(re.findall(r"^::: ([\w.]+)", page.read_text(), flags=re.MULTILINE))
    return [m for m in modules if m not in rendered]


def on_pre_build(config) -> None:
    packages = load()
    for path in missing_docstrings(packages):
        log.warning("no docstring: %s (public API must say what it promises)", path)
    api_dir = Path(config["docs_dir"]) / "api"
    for module in modules_missing_from_reference(api_dir, public_modules(packages)):
        log.warning("module %s is not in the API reference: add '::: %s' to a page of %s",
                    module, module, api_dir.relative_to(ROOT))


def parameters_table() -> str:
    """grace_from_params' keys as a markdown table, from the registry's declaration."""
    from spardl_grace.params import markdown_table
    from spardl_grace.registry import PARAMS
    return markdown_table(PARAMS)


def algorithms_table() -> str:
    """The communicators as a markdown table, from the registry's declaration."""
    from spardl_grace.registry import ALGORITHMS
    rows = ["| communicator | family | what it is |", "|---|---|---|"]
    rows += [f"| {a.name} | {a.family} | {a.doc} |" for a in ALGORITHMS.values()]
    return "\n".join(rows)


PROVENANCE_START = re.compile(r"^Recorded \d{4}-\d{2}-\d{2}")
MACHINE = re.compile(r"CPU core|GPU|H100|H200")
COMMAND = re.compile(r"`(?:python|bash|horovodrun|torchrun|mpirun)\b[^`]*`")


def _expand(path: str) -> list[str]:
    """A path with {a,b,...} groups as every path they name, as the shell's brace expansion."""
    group = re.search(r"\{([^{}]*)\}", path)
    if not group:
        return [path]
    return [expanded for part in group.group(1).split(",")
            for expanded in _expand(path[: group.start()] + part + path[group.end():])]


def _names_a_result(line: str, root: Path) -> bool:
    """Whether a backticked path in `line` is a result file or folder of the repository ({a,b}
    groups are expanded; every path they name must exist)."""
    for token in re.findall(r"`([^`\s]+)`", line):
        if not token.startswith(RESULT_DIRS):
            continue
        paths = _expand(token)
        if all(list(root.glob(p)) for p in paths):
            return True
    return False


def tables_without_provenance(markdown: str, root: Path = ROOT) -> list[str]:
    """'line N: why' for every table of `markdown` (outside fenced code) whose next non-blank
    line is not a provenance line: it must start 'Recorded YYYY-MM-DD', name the machine (CPU
    cores or a GPU), give the command in backticks and name a result file or folder under
    experiments/results/ or benchmarks/results/ that exists."""
    lines = markdown.splitlines()
    problems, fenced, i = [], False, 0
    while i < len(lines):
        if lines[i].lstrip().startswith("```"):
            fenced = not fenced
        if fenced or not lines[i].startswith("|"):
            i += 1
            continue
        start = i
        while i < len(lines) and lines[i].startswith("|"):
            i += 1
        after = next((line for line in lines[i:] if line.strip()), "")
        why = []
        if not PROVENANCE_START.match(after):
            why.append("no line 'Recorded YYYY-MM-DD, ...' after it")
        else:
            if not MACHINE.search(after):
                why.append("its provenance line names no machine (CPU cores or a GPU)")
            if not COMMAND.search(after):
                why.append("its provenance line gives no command in backticks")
            if not _names_a_result(after, root):
                why.append("its provenance line names no result file that exists")
        if why:
            problems.append(f"table at line {start + 1}: {'; '.join(why)}")
    return problems


GENERATED = {"parameters": parameters_table, "algorithms": algorithms_table}
#: a generated table's place on a page: the table lies between its two markers, in the file
#: as committed (read on GitHub as it is) and as built (made afresh from the registry)
GENERATED_BLOCK = re.compile(r"(<!-- generated: (\w+) -->\n).*?(<!-- end generated -->)", re.S)


def fill_generated(markdown: str) -> str:
    """`markdown` with each generated table between its markers made afresh."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return GENERATED_BLOCK.sub(
        lambda m: f"{m.group(1)}\n{GENERATED[m.group(2)]()}\n\n{m.group(3)}", markdown
    )


def on_page_markdown(markdown: str, page, config, files) -> str:
    markdown = fill_generated(markdown)
    if page.file.src_uri.startswith("results/"):
        for problem in tables_without_provenance(markdown):
            log.warning("%s: %s", page.file.src_uri, problem)
    return markdown


def on_files(files: Files, config) -> Files:
    for folder in RESULT_DIRS:
        for png in sorted((ROOT / folder).rglob("*.png")):
            rel = png.relative_to(ROOT).as_posix()
            files.append(File.generated(config, f"assets/{rel}", abs_src_path=str(png)))
    return files


if __name__ == "__main__":  # python docs/hooks.py: write the generated tables into the pages
    for page in sorted((ROOT / "docs").rglob("*.md")):
        text = page.read_text()
        if GENERATED_BLOCK.search(text):
            page.write_text(fill_generated(text))
