"""The shape of the house: the guide's files and the few a user runs or edits at the top,
tools in tools/, the engine in engine/; imports flow one way (top -> engine, tools -> both),
no circle, a function-level import of the project's own only for an engine module whose
feature is off in a plain run (and none of those imported by one); each augmentation defined
once. (No line limit: a module's size follows its concern.)"""

import ast
import re
import subprocess
import sys

import pytest

from conftest import REPO, TINY_MODEL

TOP = {"train", "train_ddp", "model", "dataset_utils", "train_utils", "device_utils", "recipe", "check_network",
       "predict"}


def project_modules():
    """{module name: path} of every Python file outside tests/: 'train_utils', 'engine.log', 'tools.report'."""
    found = {}
    for path in [*REPO.glob("*.py"), *REPO.glob("engine/*.py"), *REPO.glob("tools/*.py")]:
        parts = path.relative_to(REPO).with_suffix("").parts
        found[".".join(p for p in parts if p != "__init__") or parts[0]] = path
    return found


def imports_of(path, modules):
    """(module imported, at module level?) for each import of a project module in ``path``
    (module level: a with block there too, engine.cli.recipe_imported's)."""
    tree = ast.parse(path.read_text())
    top_level = {id(node) for top in tree.body for node in [top, *(top.body if isinstance(top, ast.With) else [])]}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            submodules = [f"{node.module}.{alias.name}" for alias in node.names
                          if f"{node.module}.{alias.name}" in modules]  # from engine import files
            names = submodules or [node.module]
        else:
            continue
        for name in names:
            if name in modules:
                found.append((name, id(node) in top_level))
    return found


def test_the_top_holds_the_guides_files_and_the_users_and_nothing_else():
    top = {path.stem for path in REPO.glob("*.py")}
    assert top <= TOP and len(top) <= 10, sorted(top - TOP)
    assert {p.stem for p in (REPO / "tools").glob("*.py")} >= {"benchmark", "report", "gpu_report", "demo_data"}


def test_the_engines_docstring_names_each_of_its_modules():
    """engine/__init__.py is the map of the engine: one line per module, none missing or gone."""
    listed = set(re.findall(r"^    (\w+\.py) ", (REPO / "engine" / "__init__.py").read_text(), re.MULTILINE))
    assert listed == {path.name for path in (REPO / "engine").glob("*.py")} - {"__init__.py"}


# Machinery a plain run does not use, imported where its feature is on (issue 52).
FEATURES = {"engine.dali_loader", "engine.image_cache", "engine.image_folder", "engine.image_list", "engine.user_data",
            "engine.finetune", "engine.model_ema", "engine.folder_lock", "engine.tensorboard_log", "engine.interfaces",
            "engine.nccl_log", "engine.profiling", "engine.monitor", "engine.data_formats",
            "engine.compiling", "engine.checkpoints", "engine.weights", "engine.files", "engine.out_of_memory",
            "engine.own_scheduler"}


def test_imports_flow_one_way_with_no_circle_and_lazy_only_for_features():
    modules = project_modules()
    graph = {}
    for name, path in modules.items():
        found = imports_of(path, modules)
        lazy = {imported for imported, at_top in found if not at_top} - FEATURES
        assert not lazy, f"{name} imports {lazy} inside a function"
        graph[name] = {imported for imported, _ in found} - {name}
        if name.startswith("engine"):
            assert all(i.startswith("engine") for i in graph[name]), f"{name} imports {graph[name]}"
        elif not name.startswith("tools"):
            assert not any(i.startswith("tools") for i in graph[name]), f"{name} imports a tool: {graph[name]}"
    # No circle: a topological order exists.
    done, visiting = set(), []

    def visit(name):
        assert name not in visiting, "import circle: " + " -> ".join([*visiting[visiting.index(name):], name])
        if name not in done:
            visiting.append(name)
            for imported in graph.get(name, ()):
                visit(imported if imported in graph else imported.rpartition(".")[0])
            visiting.pop()
            done.add(name)

    for name in graph:
        visit(name)


def test_no_engine_module_but_flags_reads_the_command_line():
    """The engine is passed the values it uses: no function of engine/ takes the argparse
    Namespace (a parameter ``args``) or reads one (``.args``), but engine/flags.py, which
    defines and checks it."""
    for path in (REPO / "engine").glob("*.py"):
        if path.name == "flags.py":
            continue
        tree = ast.parse(path.read_text())
        params = [node.arg for node in ast.walk(tree) if isinstance(node, ast.arg) and node.arg == "args"]
        reads = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr == "args"]
        assert not params and not reads, (path.name, params, reads)


def test_a_plain_run_imports_no_machinery_it_does_not_use():
    """train.py --synthetic without a checkpoint folder, --weights, --save-weights, --metrics-file,
    DALI, an image folder, your data, --finetune, --model-ema or --tensorboard imports none of their
    modules (nor DDP's network checks, nor the monitors: on a CPU they would watch nothing)."""
    code = ("import runpy, sys\n"
            f"sys.argv = ['train.py', '--synthetic', '--epochs', '1', '--limit-batches', '1', '--batch-size', '8', "
            f"*{list(TINY_MODEL)!r}]\n"
            "try:\n    runpy.run_path('train.py', run_name='__main__')\nexcept SystemExit as stop:\n"
            "    assert not stop.code, stop.code\n"
            "print(sorted(m for m in sys.modules if m.startswith('engine.')))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    imported = set(eval(done.stdout.splitlines()[-1]))
    assert "engine.stopping" in imported and "engine.task" in imported  # what it does use
    assert not imported & FEATURES, sorted(imported & FEATURES)


def test_the_data_sets_table_and_the_errors_need_no_torch():
    """engine/task.py's DATASETS, the data sets' files (engine/data_formats.py), the one-line
    errors and the one-line command line (engine/cli.py) import no torch: tools/demo_data.py
    writes its data sets without paying that import, and tools/report.py reads metrics files
    where torch is not installed."""
    code = ("import sys\nimport engine.task, engine.data_formats, engine.errors, engine.cli\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


@pytest.mark.parametrize("tool, words, line", [
    ("demo_data.py", ["--datset", "folder", "{new}"], "unrecognized arguments: --datset {new}; did you mean --dataset?"),
    ("report.py", ["--plot", "{new}", "--gpu-lg", "gpu.csv", "metrics.jsonl"],
     "unrecognized arguments: --gpu-lg; did you mean --gpu-log?"),
])
def test_the_torch_free_tools_refuse_a_typo_in_one_line(tmp_path, tool, words, line):
    """tools/demo_data.py and tools/report.py parse as the training scripts do: one line with a
    guess, no usage block, exit 2, and nothing written (demo_data's folder, report's --plot)."""
    new = tmp_path / "new"
    done = subprocess.run([sys.executable, f"tools/{tool}", *(word.format(new=new) for word in words)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    wanted = f"{tool}: error: {line.format(new=new)} (see --help)"
    assert (done.returncode, done.stderr.splitlines(), done.stdout) == (2, [wanted], "")
    assert not new.exists()


def test_each_augmentation_is_defined_once_in_recipe_py():
    import recipe
    ops = {op.__name__ for ops in recipe.AUGMENTATIONS.values() for op in ops}
    for name, path in project_modules().items():
        text = path.read_text()
        defined = {op for op in ops if re.search(rf"^def {op}\(", text, re.M)}
        assert defined == (ops if name == "recipe" else set()), (name, defined)
        # torchvision's own: recipe.py's per-image versions for the DataLoader, and the baselines
        if name not in ("recipe", "tools.baselines"):
            used = {node.attr for node in ast.walk(ast.parse(text)) if isinstance(node, ast.Attribute)}
            assert not used & {"RandomCrop", "RandomHorizontalFlip", "RandomResizedCrop", "hflip"}, name


def test_data_and_caches_go_beside_the_scripts_not_into_the_engine():
    from engine import data_formats, image_cache
    assert data_formats.default_data_dir() == REPO / "datasets"
    assert image_cache.default_cache_dir() == REPO / "datasets" / "cache"
