"""The packages form layers (docs/layout.md): each imports only those below it, whether at the top of a module or
inside a function. An import that runs back up is how circles start."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "maxtrain"
# bottom to top; the entry points (train.py, ...) may import any of them
LAYERS = ("runtime", "ops", "parallel", "models", "data", "config", "observe", "checkpoint", "launch", "infer",
          "training")


def imported_packages(path: Path) -> set[tuple[str, int]]:
    """(maxtrain package, line) for every import of maxtrain in the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module else
                 [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        if isinstance(node, ast.ImportFrom) and node.module == "maxtrain":
            names = [f"maxtrain.{a.name}" for a in node.names]
        found |= {(n.split(".")[1], node.lineno) for n in names if n.startswith("maxtrain.")}
    return found


def test_every_package_imports_only_the_layers_below_it():
    assert sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists() and p.name != "configs") == \
        sorted(LAYERS), "a new package takes a place in LAYERS and in docs/layout.md"
    upward = []
    for rank, package in enumerate(LAYERS):
        allowed = set(LAYERS[:rank + 1])
        for path in sorted((PACKAGE / package).rglob("*.py")):
            upward += [f"{path.relative_to(PACKAGE.parent)}:{line} imports maxtrain.{target}"
                       for target, line in sorted(imported_packages(path)) if target in LAYERS and target not in allowed]
    assert not upward, "\n".join(upward)


def test_the_layers_are_the_ones_the_docs_describe():
    text = (PACKAGE.parent / "docs" / "layout.md").read_text()
    rows = [line.split("|")[1].strip().strip("`/") for line in text.splitlines() if line.startswith("| `")]
    assert rows == list(reversed(LAYERS))
