"""Kernel tests: the `backend` fixture every op test (test_op_*.py) runs on, see _backends.py.

TRITON_INTERPRET is set in tests/conftest.py (it must precede any import of triton, which
torch._dynamo and transformers perform at import time). The `triton` backend is marked
`triton_interpret` when it runs in the interpreter, the `cuda` backend `gpu`.

`@pytest.mark.backend_grid(reason=..., interpreter=..., reference=...)` on a test narrows what it runs
on a backend: `interpreter` (the Triton backend in the interpreter, which pays per launch) or any
backend name, given False (not run there) or {param: (values, ...)} (only the cases whose parameter
is one of those values). The other cases are deselected (counted in the summary), never skipped.
"""
import pytest
from _backends import INTERPRET, make_backend

BACKENDS = [
    pytest.param("reference"),
    pytest.param("native"),
    pytest.param("triton", marks=[pytest.mark.triton_interpret] if INTERPRET else []),
    pytest.param("cuda", marks=[pytest.mark.gpu]),
]


@pytest.fixture(params=BACKENDS)
def backend(request):
    return make_backend(request.param)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "backend_grid(reason, interpreter=..., <backend>=...): the part of a test's grid a backend runs"
    )


def _outside_backend_grid(item) -> bool:
    spec = getattr(item, "callspec", None)
    mark = item.get_closest_marker("backend_grid")
    if spec is None or mark is None or "backend" not in spec.params:
        return False
    assert mark.kwargs.get("reason"), f"{item.nodeid}: backend_grid needs a reason"
    name = spec.params["backend"]
    key = "interpreter" if name == "triton" and INTERPRET else name
    if key not in mark.kwargs:
        return False
    grid = mark.kwargs[key]
    return grid is False or any(spec.params[param] not in values for param, values in grid.items())


def pytest_collection_modifyitems(config, items):
    outside = [item for item in items if _outside_backend_grid(item)]
    if outside:
        config.hook.pytest_deselected(items=outside)
        items[:] = [item for item in items if not _outside_backend_grid(item)]
