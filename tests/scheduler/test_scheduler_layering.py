"""The scheduler stays below the patch layer: no module of slimfit/scheduler/ imports slimfit.patching or
slimfit.config (the patch's SlimFitConfig), and the Trainer callback above them (slimfit.integrations) is
reached only from inside a function, on first use."""
import ast
import pathlib

SCHEDULER = pathlib.Path(__file__).resolve().parents[2] / "slimfit" / "scheduler"
FORBIDDEN = ("slimfit.patching", "slimfit.config")
LAZY_ONLY = ("slimfit.integrations",)


def _absolute(node: ast.AST, package: str) -> list[str]:
    """The absolute module names an import statement names (relative ones resolved against `package`)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level == 0:
        base = node.module or ""
    else:
        parts = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(parts + ([node.module] if node.module else []))
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def _imports(tree: ast.Module, package: str):
    """(module name, at module level?) for every import statement of a file."""
    top = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for name in _absolute(node, package):
                yield name, id(node) in top


def _under(name: str, roots: tuple) -> bool:
    return any(name == root or name.startswith(root + ".") for root in roots)


def test_scheduler_imports_neither_patching_nor_config():
    files = sorted(SCHEDULER.glob("*.py"))
    assert files, SCHEDULER
    for file in files:
        for name, at_top in _imports(ast.parse(file.read_text()), "slimfit.scheduler"):
            assert not _under(name, FORBIDDEN), (file.name, name)
            assert not (at_top and _under(name, LAZY_ONLY)), (file.name, name)


def test_relative_imports_resolve_against_the_package():
    tree = ast.parse("from ..config import SlimFitConfig\nfrom .config import SchedulerConfig\n")
    names = [name for name, _ in _imports(tree, "slimfit.scheduler")]
    assert "slimfit.config" in names and "slimfit.scheduler.config" in names
    assert not _under("slimfit.scheduler.config", FORBIDDEN)


def test_the_callback_is_still_reached_through_the_scheduler():
    import slimfit.integrations
    import slimfit.scheduler
    from slimfit.integrations.trainer import SlimFitCallback

    assert slimfit.scheduler.SlimFitCallback is SlimFitCallback
    assert slimfit.scheduler.HFCallback is SlimFitCallback
    assert slimfit.integrations.SlimFitCallback is SlimFitCallback
