"""Every import inside `posttrain/` points down the module map of docs/architecture.md (read with `ast`,
nothing is imported): a module may import from its own layer or a lower one, never from a higher one."""

import ast
from pathlib import Path

import posttrain

PACKAGE_DIR = Path(posttrain.__file__).parent

# The module map, bottom (0) to top. A module belongs to the layer of its longest matching prefix.
LAYERS = {
    "posttrain": 0,  # the package itself (version)
    "posttrain.config": 0,
    "posttrain.utils": 0,
    "posttrain.distributed": 1,
    "posttrain.data": 1,
    "posttrain.algorithms.loss": 1,
    "posttrain.algorithms.preference_loss": 1,
    "posttrain.algorithms.advantages": 1,
    "posttrain.algorithms.health": 1,
    "posttrain.models": 2,  # weights: build, tokenizer, LoRA, vision-language, GGUF
    "posttrain.environments": 2,
    "posttrain.workers": 3,  # Ray actors and their driver-side handles: policy, generation, refit
    "posttrain.experience": 3,
    "posttrain.evals": 3,
    "posttrain.algorithms": 4,  # the loops: sft, grpo, dpo, rm and their shared run plumbing
    "posttrain.tinker": 4,  # the Tinker-compatible training service, over the policy and generation code
    "posttrain.cli": 5,
    "posttrain.demo": 5,
    "posttrain.export": 5,
}
LAYER_NAMES = [
    "config, utils",
    "distributed, data, loss math",
    "models, environments",
    "workers, experience, evals",
    "algorithm loops, tinker service",
    "commands",
]


def layer_of(module: str) -> int:
    matches = [prefix for prefix in LAYERS if module == prefix or module.startswith(prefix + ".")]
    assert matches, f"{module} is not in the layer table of this test: add it"
    return LAYERS[max(matches, key=len)]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, source: str | None = None) -> list[tuple[int, str]]:
    """(line, module) of every posttrain import in a file, module-level or inside functions; a
    `from package import name` counts as importing `package.name` when that is a module."""
    found = []
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    source = path.read_text() if source is None else source
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                is_module = (PACKAGE_DIR.parent / candidate.replace(".", "/")).with_suffix(
                    ".py"
                ).exists() or (PACKAGE_DIR.parent / candidate.replace(".", "/")).is_dir()
                found.append((node.lineno, candidate if is_module else base))
    return [(line, name) for line, name in found if name == "posttrain" or name.startswith("posttrain.")]


def test_every_import_points_down_the_module_map():
    upward = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        importer = module_name(path)
        for line, imported in imported_modules(path):
            if layer_of(imported) > layer_of(importer):
                upward.append(
                    f"{path.relative_to(PACKAGE_DIR.parent)}:{line}: {importer} "
                    f"({LAYER_NAMES[layer_of(importer)]}) "
                    f"imports {imported} ({LAYER_NAMES[layer_of(imported)]})"
                )
    assert not upward, "imports pointing up the module map:\n" + "\n".join(upward)


def test_the_policy_workers_get_their_loss_as_a_callable_and_import_no_algorithm():
    workers = sorted((PACKAGE_DIR / "workers").rglob("*.py"))
    assert len(workers) > 10
    found = [
        (path.name, name)
        for path in workers
        for _, name in imported_modules(path)
        if name.startswith("posttrain.algorithms")
    ]
    assert found == []


def test_models_hold_weights_and_start_no_worker():
    """models/ is what the weights are (build, tokenizer, LoRA, VLM, GGUF): no Ray actor lives there."""
    models = sorted((PACKAGE_DIR / "models").rglob("*.py"))
    assert not [
        path.name for path in models if "import ray" in path.read_text() or "ray.remote" in path.read_text()
    ]


def test_the_walk_resolves_absolute_relative_and_nested_imports():
    """The walk is not vacuous: an upward import written any of these ways is found and ranked higher."""
    source = (
        "from posttrain.environments.sliding_puzzle import STOP_STRINGS\n"
        "from ..environments import interface\n"
        "def late():\n    import posttrain.algorithms.grpo\n"
    )
    found = imported_modules(PACKAGE_DIR / "data" / "tasks.py", source)
    assert found == [
        (1, "posttrain.environments.sliding_puzzle"),
        (2, "posttrain.environments.interface"),
        (4, "posttrain.algorithms.grpo"),
    ]
    assert all(layer_of(name) > layer_of("posttrain.data.tasks") for _, name in found)


def test_no_import_cycles_not_even_through_imports_inside_functions():
    """The graph of posttrain's modules, with every import (module-level or inside a function) an edge,
    has no cycle: a depth-first walk never meets a module that is still on its path."""
    modules = {module_name(path): path for path in PACKAGE_DIR.rglob("*.py")}

    def owner(name: str) -> str:
        while name not in modules:
            name = name.rpartition(".")[0]
        return name

    edges = {
        name: {owner(imported) for _, imported in imported_modules(path)} - {name}
        for name, path in modules.items()
    }
    state: dict[str, str] = {}
    cycles = []

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for target in sorted(edges[name]):
            if state.get(target) == "open":
                cycles.append(" -> ".join(path[path.index(target) :] + [name, target]))
            elif target not in state:
                visit(target, path + [name])
        state[name] = "done"

    for name in sorted(modules):
        if name not in state:
            visit(name, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_importing_the_configs_loads_neither_ray_nor_a_backend():
    """The generation and policy packages import their configs eagerly and their Ray-backed parts on first
    use: a fresh interpreter that imports the configs has not imported Ray."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from posttrain.workers.generation import GenerationConfig\n"
        "from posttrain.workers.policy import PolicyConfig\n"
        "print(sorted(m for m in ('ray', 'posttrain.workers.generation.hf_worker') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_architecture_docs_table_is_this_map():
    """docs/architecture.md's module map lists exactly these packages, each in its layer."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text()
    rows = [line.split("|") for line in text.splitlines() if line[:4] in {f"| {n} " for n in range(10)}]
    documented = {f"posttrain.{name.strip(' `')}": int(row[1]) for row in rows for name in row[2].split(",")}
    assert documented == {name: layer for name, layer in LAYERS.items() if name != "posttrain"}
