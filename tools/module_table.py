"""Write the module table of docs/design.md from the package's own docstrings.

    python tools/module_table.py          # rewrite the table in docs/design.md
    python tools/module_table.py --check  # exit 1 if the table there differs (tests/test_layers.py)

Each row is a layer folder or a module with the first sentence of its docstring, in the order
of the layers (top first, as pyproject.toml's import-linter contract lists them), so the table
cannot fall behind the code.
"""

from __future__ import annotations

import ast
import os
import re
import sys
import tomllib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DESIGN = os.path.join(REPO, "docs", "design.md")
START, END = "<!-- module table: tools/module_table.py writes it -->", "<!-- end of module table -->"


def layers() -> list[str]:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        contracts = tomllib.load(f)["tool"]["importlinter"]["contracts"]
    return next(c["layers"] for c in contracts if c["type"] == "layers")


def first_sentence(path: str) -> str:
    with open(path) as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    text = " ".join(doc.split()).replace("``", "`")
    text = re.sub(r"^Layer `\w+`(, [^:]+)?: ", "", text)  # the folder's name is in the row already
    match = re.match(r"(.+?\.)(\s|$)", text)
    sentence = match.group(1) if match else text
    sentence = sentence.rstrip(":.").replace("|", "\\|") + "."
    return sentence[:1].upper() + sentence[1:]


def rows() -> list[tuple[str, str]]:
    out = []
    for layer in layers():
        path = os.path.join(REPO, *layer.split("."))
        if os.path.isdir(path):
            out.append((f"**`{layer.removeprefix('spmdzero.')}/`**", first_sentence(os.path.join(path, "__init__.py"))))
            for dirpath, dirnames, filenames in sorted(os.walk(path)):
                dirnames.sort()
                rel = os.path.relpath(dirpath, os.path.join(REPO, "spmdzero"))
                if dirpath != path:
                    out.append((f"`{rel}/`", first_sentence(os.path.join(dirpath, "__init__.py"))))
                for name in sorted(filenames):
                    if name.endswith(".py") and name not in ("__init__.py", "__main__.py"):
                        out.append((f"`{rel}/{name}`", first_sentence(os.path.join(dirpath, name))))
        else:
            out.append((f"**`{layer.removeprefix('spmdzero.')}.py`**", first_sentence(path + ".py")))
    return out


def table() -> str:
    lines = ["| layer / module | what it is |", "|---|---|"]
    lines += [f"| {name} | {what} |" for name, what in rows()]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    with open(DESIGN) as f:
        text = f.read()
    if START not in text or END not in text:
        print(f"{DESIGN} has no {START!r} ... {END!r} section", file=sys.stderr)
        return 1
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    new = f"{head}{START}\n{table()}\n{END}{tail}"
    if "--check" in argv:
        if new != text:
            print("docs/design.md's module table is out of date: run python tools/module_table.py", file=sys.stderr)
            return 1
        return 0
    with open(DESIGN, "w") as f:
        f.write(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
