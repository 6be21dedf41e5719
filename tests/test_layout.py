"""The code's shape, as the layering and the style guide ask: small files and functions, no import circles, imports
one way (calm_cli -> gateway -> adapters -> calm_core; training -> calm_core), each package's parts in layers, and
project imports at the top of a file."""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gateway", "adapters", "training", "calm_core", "calm_cli")
MAX_FILE_LINES, MAX_FUNCTION_LINES, MAX_CLI_FILE_LINES = 400, 60, 200
# What each package may import from the project (besides itself): the layering of the README's Layout section.
ALLOWED = {"calm_core": set(), "training": {"calm_core"}, "adapters": {"calm_core"}, "gateway": {"adapters", "calm_core"},
           "calm_cli": {"gateway", "adapters", "training", "calm_core"}}
# The parts of a package (its subpackages and top-level modules), lowest first: a part imports only parts below it, so
# parts make no circle and nothing points up. Parts not listed sit at no fixed height (training's recipe modules:
# their module graph must still have no circle).
LAYERS = {
    "gateway": ["protocol", "errors", "records", "observe", "policy", "settings", "edge", "serving", "state", "routers",
                "fast_lane", "app"],
    "adapters": ["hosting", "vllm_plugins", "clients"],
}
GATEWAY_TOP_MODULES = 8
# What `calm --help` must not load: each costs from tens of milliseconds (numpy, httpx, pydantic models) to seconds
# (torch, vLLM); with all of them at the top of the CLI's modules `calm --help` took 2.2 s, without them 0.3 s, as
# before the CLI was split. The CLI imports a project module that loads one of them inside the command that runs it,
# and no other project module there.
HEAVY = ("torch", "vllm", "peft", "transformers", "fastapi", "scipy", "sqlalchemy", "aiohttp", "numpy", "httpx",
         "pydantic", "uvicorn")


def sources(packages=PACKAGES) -> dict[str, Path]:
    found = {}
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(path: Path) -> list[tuple[str, bool]]:
    """(module imported, whether inside a function) for every project import of a file."""
    tree = ast.parse(path.read_text())
    local = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
    # Imports under TYPE_CHECKING count too: a circle of types is still two modules that cannot be read apart.
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, id(node) in local))
            found += [(f"{node.module}.{alias.name}", id(node) in local) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, id(node) in local) for alias in node.names]
    return [(m, inside) for m, inside in found if m.split(".")[0] in PACKAGES]


def resolver(modules: dict[str, Path]):
    def resolve(target: str) -> str | None:  # `from a.b import c` names module a.b.c or a name in a.b
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target or None
    return resolve


@functools.cache
def imports_on_load(path: Path) -> list[str]:
    """Every module, the project's or not, that importing a file imports: its imports outside functions, except those
    under TYPE_CHECKING, which never run."""
    found = []

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.extend([node.module] + [f"{node.module}.{alias.name}" for alias in node.names])
            elif isinstance(node, ast.Import):
                found.extend(alias.name for alias in node.names)
            visit([child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt)])

    visit(ast.parse(path.read_text()).body)
    return found


def heavy_imports(module: str, modules: dict[str, Path]) -> set[str]:
    """The heavy packages importing a project module loads: those its top-level imports name, followed through the
    project's modules (and the packages above each, whose __init__ runs first)."""
    resolve, seen, heavy, todo = resolver(modules), set(), set(), [module]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        parents = current.split(".")
        todo += [p for i in range(1, len(parents)) if (p := ".".join(parents[:i])) in modules]
        for name in imports_on_load(modules[current]):
            if name.split(".")[0] in HEAVY:
                heavy.add(name.split(".")[0])
            elif name.split(".")[0] in PACKAGES and (target := resolve(name)):
                todo.append(target)
    return heavy


def module_graph() -> dict[str, set[str]]:
    modules = sources()
    resolve = resolver(modules)
    return {m: {t for name, _ in imports(p) if (t := resolve(name)) and t != m} for m, p in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[str]:
    """Every circle a depth-first walk of `graph` meets, as "a -> b -> a"."""
    state: dict[str, int] = {}
    found = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                found.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def part(module: str) -> str:
    """The part of its package a module belongs to: gateway.serving.service -> serving; gateway.app -> app."""
    return module.split(".")[1] if "." in module else ""


def test_no_file_or_function_is_too_long():
    long_files, long_functions = [], []
    for module, path in sources().items():
        text = path.read_text()
        if text.count("\n") > (MAX_CLI_FILE_LINES if module.startswith("calm_cli") else MAX_FILE_LINES):
            long_files.append(f"{module}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long_functions.append(f"{module}.{node.name}: {length} lines")
    assert not long_files, long_files
    assert not long_functions, long_functions


def test_packages_import_only_downwards():
    wrong = [f"{module} imports {target}" for module, path in sources().items() for target, _ in imports(path)
             if (mine := module.split(".")[0]) != (theirs := target.split(".")[0]) and theirs not in ALLOWED[mine]]
    assert not wrong, wrong


def test_no_import_circles_even_through_imports_inside_functions_or_for_types():
    found = circles(module_graph())
    assert not found, found


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_a_packages_parts_import_only_the_parts_below_them(package):
    """gateway/ was 33 modules side by side with 109 arrows and a circle (64): its parts are layers now, and so are
    adapters/ (hosting, then what vLLM loads, then the clients that start it)."""
    layers = LAYERS[package]
    graph = {m: t for m, t in module_graph().items() if m.startswith(package + ".")}
    parts = {part(m) for m in graph} - {""}
    assert parts <= set(layers), f"{package}: parts with no layer: {sorted(parts - set(layers))}"
    up = [f"{m} -> {t}" for m, targets in graph.items() for t in targets
          if t.startswith(package + ".") and part(m) and part(t) and part(m) != part(t)
          and layers.index(part(t)) > layers.index(part(m))]
    assert not up, up


@pytest.mark.parametrize("package", PACKAGES)
def test_a_packages_parts_make_no_circle(package):
    """Where no layers are written down (training/ with its retrain/ worker, calm_core/ with its scorers/, calm_cli/),
    a package's parts (its subpackages and top modules) still import each other one way only."""
    graph: dict[str, set[str]] = {}
    for module, targets in module_graph().items():
        if module.startswith(package + ".") and part(module):
            graph.setdefault(part(module), set()).update(
                part(t) for t in targets if t.startswith(package + ".") and part(t) and part(t) != part(module))
    found = circles(graph)
    assert not found, found


def test_the_gateway_package_keeps_few_modules_at_its_top():
    top = sorted(p.stem for p in (ROOT / "gateway").glob("*.py") if p.stem != "__init__")
    assert len(top) <= GATEWAY_TOP_MODULES, top


@pytest.mark.parametrize("package", PACKAGES)
def test_project_modules_are_imported_at_the_top_of_a_file(package):
    """An import inside a function is for a heavy optional dependency (transformers, peft, vLLM, ...), never to hide
    a circle between the project's own modules. The CLI's commands import the project modules that load a heavy
    package (HEAVY) where they run, so that `calm --help` stays light; only those."""
    modules = sources()
    resolve = resolver(modules)

    def lazy_for_a_reason(target: str) -> bool:
        module = resolve(target)
        return package == "calm_cli" and module is not None and bool(heavy_imports(module, modules))

    inside = [f"{module} imports {target} inside a function" for module, path in sources((package,)).items()
              for target, local in imports(path) if local and not lazy_for_a_reason(target)]
    assert not inside, inside


def test_the_heavy_closure_sees_through_the_project():
    """The rule above stands on heavy_imports: the trainer loads torch (through training/ modules), the registry
    SQLAlchemy, the domain rule none of them."""
    modules = sources()
    assert "torch" in heavy_imports("training.trainer", modules)
    assert "torch" in heavy_imports("training.retrain.worker", modules)
    assert "sqlalchemy" in heavy_imports("calm_core.registry", modules)
    assert heavy_imports("calm_core.domains", modules) == set() and heavy_imports("training.config", modules) == {"pydantic"}


def test_calm_help_loads_no_heavy_package():
    """`calm --help` and every group's and command's help, in a process of their own, import none of HEAVY: a CLI
    module that imported the trainer (say) at its top would take seconds to print a usage."""
    code = """
import sys
from typer.main import get_command
from typer.testing import CliRunner
from calm_cli.main import app

root, runner = get_command(app), CliRunner()
heavy = set(sys.argv[1:])
loaded = lambda: sorted({m.split(".")[0] for m in sys.modules} & heavy)  # noqa: E731
assert runner.invoke(app, ["--help"]).exit_code == 0
assert not loaded(), f"calm --help loaded {loaded()}"
calls = []
for name, command in root.commands.items():
    calls.append([name])
    calls += [[name, sub] for sub in getattr(command, "commands", {})]
for argv in calls:
    result = runner.invoke(app, [*argv, "--help"])
    assert result.exit_code == 0, (argv, result.output)
heavy -= {"pydantic"}  # typer itself builds pydantic adapters for some commands' parameters (typer/_coercion.py)
assert not loaded(), f"a command's --help loaded {loaded()}"
print(len(calls))
"""
    proc = subprocess.run([sys.executable, "-c", code, *HEAVY], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert int(proc.stdout.split()[-1]) > 30  # the groups' commands were reached, not the root's help alone


def test_the_answer_format_has_one_spelling():
    """The answer format was a Literal in calm_core/prompts.py, an enum in calm_core/scorers/registry.py, a string
    check in the CLI, and `AnswerFormat` also named a training Protocol (64): one enum now, in calm_core."""
    defined, spelled = [], []
    for name, path in sources().items():
        tree = ast.parse(path.read_text())
        defined += [f"{name}.{node.name}" for node in ast.walk(tree)
                    if isinstance(node, ast.ClassDef) and node.name.startswith("AnswerFormat")]
        spelled += [f"{name}:{node.lineno}" for node in ast.walk(tree)
                    if isinstance(node, ast.Subscript) and ast.unparse(node.value) == "Literal"
                    and {"letter", "cloze"} & {getattr(e, "value", None) for e in ast.walk(node.slice)}]
    assert defined == ["calm_core.prompts.AnswerFormat"] and spelled == []


def test_the_domain_rule_has_one_spelling():
    """Which names a request's domain may take and which domains a gateway serves were written in the admin API's
    dependencies, the protocol and the CLI (64): calm_core/domains.py holds the pattern, `other` and the rule."""
    pattern, other, rule = [], [], []
    for name, path in sources().items():
        tree = ast.parse(path.read_text())
        pattern += [name for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and "[a-z0-9_\\-]" in node.value]
        other += [name for node in ast.walk(tree) if isinstance(node, ast.Assign) and ast.unparse(node.value) == "'other'"]
        rule += [name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == "known_domains"]
    assert (pattern, other, rule) == (["calm_core.domains"],) * 3


def test_the_training_config_reads_its_method_names_without_torch():
    """The config's method names were a Literal beside the registry in the module that imports torch (64): they are the
    registry's (training/method_specs.py), and a config loads in a process that never imports torch."""
    code = "import sys, training.config; assert 'torch' not in sys.modules, 'torch imported'"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
