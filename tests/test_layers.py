"""The package's shape: layers whose imports point down, no import cycle anywhere (function-local
imports included), a docstring on every module, long modules only with a stated reason, and
docs/design.md's module table in step with the code."""

import os
import subprocess
import sys

import grimp
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "spmdzero")
LONG = 500  # lines; a longer module says why in its docstring ("Why one module: ...")


@pytest.fixture(scope="module")
def graph():
    return grimp.build_graph("spmdzero", cache_dir=None)


def cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.find_modules_directly_imported_by(node):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return out


def test_no_module_imports_another_that_imports_it_back(graph):
    # the package root re-exports the API and imports the top layers; no module imports it
    importers_of_root = graph.find_modules_that_directly_import("spmdzero")
    assert importers_of_root <= {"spmdzero.compat.deepspeed"}, importers_of_root
    found = [c for c in cycles(graph) if c != ["spmdzero", "spmdzero.compat.deepspeed"]]
    assert found == [], found


def test_nothing_imports_the_cli_or_the_compatibility_layer(graph):
    for top in ("spmdzero.cli", "spmdzero.compat"):
        inside = {top} | graph.find_descendants(top)
        importers = set().union(*(graph.find_modules_that_directly_import(m) for m in inside)) - inside
        # the package root's alias_deepspeed() and spmdzero launch (in cli) install the alias
        assert importers <= {"spmdzero", "spmdzero.__main__", "spmdzero.cli.launch", "spmdzero.cli.main"}, \
            (top, importers)


def test_the_layers_contract_holds():
    """import-linter's contracts in pyproject.toml (also run by `make test` before pytest)."""
    proc = subprocess.run([os.path.join(os.path.dirname(sys.executable), "lint-imports")], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]


def modules():
    for dirpath, _, filenames in os.walk(PACKAGE):
        for name in filenames:
            if name.endswith(".py"):
                yield os.path.relpath(os.path.join(dirpath, name), REPO)


@pytest.mark.parametrize("path", sorted(modules()))
def test_every_module_says_what_it_is_and_long_ones_say_why(path):
    import ast

    with open(os.path.join(REPO, path)) as f:
        source = f.read()
    doc = ast.get_docstring(ast.parse(source))
    assert doc and "TODO" not in doc, f"{path} has no docstring"
    if source.count("\n") > LONG:
        assert "Why one module:" in doc, f"{path} is over {LONG} lines and its docstring does not say why"


def test_design_docs_module_table_is_generated_from_the_docstrings():
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", "module_table.py"), "--check"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
