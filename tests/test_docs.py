"""The docs a person reads stay true to the code: the flag references are what scripts/reference.py
renders from the parsers now, every HTTP route and gRPC method is in docs/API.md, README.md stays
short, and every relative link points to a file (and heading) that exists. No model is compiled."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from service.routes import router

ROOT = Path(__file__).resolve().parents[1]


def _script(name: str):
    """A module of scripts/ (not a package: run as `.venv/bin/python scripts/NAME.py`)."""
    spec = importlib.util.spec_from_file_location(f"scripts.{name}", ROOT / "scripts" / f"{name}.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


reference = _script("reference")
API = ROOT / "docs" / "API.md"
PROTOS = sorted((ROOT / "service" / "grpc_api").glob("*.proto"))  # TEI's tei.v1 and our bertserve.v1
LINKED_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "experiments").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("ref", reference.REFERENCES, ids=lambda ref: ref.command)
def test_flag_reference_is_what_the_parser_renders(ref):
    """Edit the flag's help in its parser, then run `.venv/bin/python scripts/reference.py`."""
    text = ref.doc.read_text()
    assert reference.rewritten(ref, text) == text, f"{ref.doc.name} is out of date: run scripts/reference.py"


@pytest.mark.parametrize("ref", reference.REFERENCES, ids=lambda ref: ref.command)
def test_flag_reference_lists_every_flag(ref):
    rendered = reference.render(ref)
    options = [option for action in ref.parser()._actions for option in action.option_strings if option != "-h"]
    assert options and all(f"`{option}" in rendered for option in options if option != "--help")


def test_every_http_route_is_in_the_api_doc():
    text = API.read_text()
    routes = {(method, route.path) for route in router.routes for method in route.methods if method != "HEAD"}
    routes |= {("GET", "/docs"), ("GET", "/openapi.json")}  # the app's own, beside the router's
    assert len(routes) > 20
    missing = sorted(f"{method} {path}" for method, path in routes if f"`{method} {path}`" not in text)
    assert not missing, f"docs/API.md lacks {missing}"


def test_every_grpc_method_is_in_the_api_doc():
    methods = [method for proto in PROTOS for method in re.findall(r"^\s*rpc\s+(\w+)\s*\(", proto.read_text(), re.M)]
    assert {"Embed", "RerankStream", "EmbedMulti", "EmbedHybridStream"} <= set(methods)
    text = API.read_text()
    assert not [method for method in methods if f"`{method}`" not in text]


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) < 250


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    return {_slug(heading) for heading in re.findall(r"^#+ (.+)$", text, re.M)}


@pytest.mark.parametrize("doc", LINKED_DOCS, ids=lambda path: str(path.relative_to(ROOT)))
def test_relative_links_point_to_existing_files(doc):
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(target)
    assert not broken, f"{doc.relative_to(ROOT)} links to what does not exist: {broken}"


def test_docs_cited_in_code_exist():
    """Comments and configs cite the doc that holds a measurement (docs/experiments/NAME.md)."""
    sources = [path for folder in ("artifact", "compile", "service", "loadtest", "configs", "scripts")
               for path in sorted((ROOT / folder).rglob("*")) if path.suffix in (".py", ".yaml", ".sh", ".c", ".h")]
    cited = {(path.relative_to(ROOT), doc) for path in sources
             for doc in re.findall(r"\bdocs/[\w./-]+\.md\b", path.read_text())}
    assert cited
    missing = sorted(f"{path}: {doc}" for path, doc in cited if not (ROOT / doc).exists())
    assert not missing, missing
