"""The package's layering, read from the imports themselves (docs/design.md, "Architecture"):
the decoding core stands alone, and the commands at the top of medusa_core are imported by nobody."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "medusa_core"
COMMANDS = {"bench", "bench_gpu", "bench_synthetic", "calibrate", "export", "smol_build", "train"}


def imports(path: Path) -> set[str]:
    """Absolute module names ``path`` imports, relative imports resolved, at any depth of the file."""
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = list(package[:len(package) - node.level + 1]) if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.add(module)
            if not node.module:                      # from . import a, b: the modules a and b
                found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def modules(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.py"))


def test_the_decoding_core_imports_no_quantization_training_benchmark_or_app_code():
    banned = ("medusa_core.quant", "medusa_core.training", "medusa_core.benchmarks", "medusa_core.loading", "app")
    for path in modules(PACKAGE / "decoding"):
        wrong = sorted(m for m in imports(path) if m.startswith(banned))
        assert not wrong, f"{path.relative_to(ROOT)} imports {wrong}: the step learns about quantization " \
                          "through the loaded model, not an import"


def test_the_package_never_imports_the_app_or_its_own_commands():
    for path in modules(PACKAGE):
        name = path.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".")
        for module in imports(path):
            assert not module.startswith("app"), f"{name} imports {module}: the core must run without the UI"
            command = module.removeprefix("medusa_core.")
            if module.startswith("medusa_core.") and command in COMMANDS and name != "medusa_core.bench_gpu":
                pytest.fail(f"{name} imports the command {module}: move what it needs into a subpackage")


def test_top_level_holds_only_the_commands_and_errors():
    top = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    assert top == COMMANDS | {"errors"}


def test_every_cuda_graph_capture_in_the_package_is_thread_local_and_free_of_garbage_collection():
    """Review: the kernel tuner captured in global mode from a loading thread while an answer ran on another;
    a CUDA call there breaks the capture. graphs.capturing is the one way to record (it cannot run here)."""
    for path in modules(PACKAGE):
        if path.name == "graphs.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("torch.cuda.graph", "torch.cuda.CUDAGraph"):
                pytest.fail(f"{path.relative_to(ROOT)}:{node.lineno} captures with {ast.unparse(node.func)}: use "
                            "medusa_core.decoding.graphs.captured")


def test_every_command_line_refuses_a_bad_flag_in_one_line():
    """QA: the commands' own checks were one line, and argparse's refusals (a bad number, a missing value, their
    own p.error) printed the whole usage first. Every entry point builds its parser as OneLineParser."""
    import subprocess
    import sys

    plain = [path.relative_to(ROOT) for path in [ROOT / "launch.py", *modules(PACKAGE), *modules(ROOT / "app")]
             if "argparse.ArgumentParser(" in path.read_text() and path.name != "errors.py"]
    assert not plain, f"{plain} build a plain argparse.ArgumentParser: use medusa_core.errors.OneLineParser"
    for command in (["-m", "medusa_core.smol_build", "--steps", "0"], ["-m", "medusa_core.bench", "--warmup", "x"]):
        proc = subprocess.run([sys.executable, *command], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.count("\n") == 1, proc.stderr
        assert proc.stderr.startswith("error: ") and proc.stderr.endswith(" --help lists the flags)\n"), proc.stderr


def test_every_command_says_ctrl_c_in_one_line():
    """CLI QA: Ctrl-C in a benchmark ended in KeyboardInterrupt's traceback. Every module run as a command goes through
    errors.run_command or errors.exit_status, which say it in one line (exit 130)."""
    commands = [path for path in [*modules(PACKAGE), *modules(ROOT / "app")]
                if 'if __name__ == "__main__":' in path.read_text()]
    assert len(commands) >= 20
    bare = [str(path.relative_to(ROOT)) for path in commands
            if not {"exit_status", "run_command"} & {node.id if isinstance(node, ast.Name) else node.attr
                                                       for node in ast.walk(ast.parse(path.read_text()))
                                                       if isinstance(node, (ast.Name, ast.Attribute))}]
    assert not bare, bare
