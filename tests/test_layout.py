"""The test tree's own module names stay clear of names other packages import or probe for.

pytest puts tests/ on sys.path (pyproject's `pythonpath`), so a test package named like a real one hides
it: a `tests/kernels` package once made transformers 5.25 believe Hugging Face's `kernels` was installed
and fail on import, which broke every test that builds a checkpoint. tests/kernels mirrors kvflow/kernels
as a plain folder instead (no __init__.py): a folder without one is at most a portion of a namespace
package, which an installed package of the same name always wins over, and which transformers does not
take for an installed one."""

import importlib.metadata
import importlib.util
from pathlib import Path

import transformers.utils.import_utils as transformers_imports

TESTS = Path(__file__).parent


def _top_level_names() -> list[str]:
    packages = [p.name for p in TESTS.iterdir() if (p / "__init__.py").is_file()]
    modules = [p.stem for p in TESTS.glob("*.py") if p.stem != "conftest"]
    return sorted(packages + modules)


def test_the_walk_finds_the_test_packages() -> None:
    names = _top_level_names()
    assert {"engine", "server", "tiny_models"} <= set(names), names
    assert "kernels" not in names, "tests/kernels must stay a plain folder: see this file's docstring"


def test_the_kernel_tests_hide_no_kernels_package() -> None:
    spec = importlib.util.find_spec("kernels")
    assert spec is None or spec.origin is None or TESTS not in Path(spec.origin).parents, spec
    assert not transformers_imports._is_package_available("kernels")[0] or spec.origin is not None


def test_no_test_module_shares_a_name_with_an_installed_package() -> None:
    installed = importlib.metadata.packages_distributions()
    clashes = {name: installed[name] for name in _top_level_names() if name in installed}
    assert not clashes, f"test modules hide installed packages: {clashes}"


def test_no_test_module_shares_a_name_transformers_probes_for() -> None:
    probed = {
        name[len("is_") : -len("_available")]
        for name in dir(transformers_imports)
        if name.startswith("is_") and name.endswith("_available")
    }
    assert "kernels" in probed, "transformers no longer probes by is_<name>_available: rewrite this check"
    clashes = sorted(set(_top_level_names()) & probed)
    assert not clashes, f"transformers probes for these names and would find the test modules: {clashes}"


def test_only_packages_have_a_conftest_below_the_top() -> None:
    # A conftest.py in a plain folder is imported as `conftest`, hiding tests/conftest.py from the tests that
    # import its helpers (`from conftest import default_gguf_path`).
    plain = [p for p in TESTS.rglob("conftest.py") if p.parent != TESTS and not (p.parent / "__init__.py").exists()]
    assert not plain, plain
