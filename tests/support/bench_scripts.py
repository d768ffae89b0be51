"""Load a script of bench/ as a module, as the tests of its pure parts need (bench/ is not a
package; each script puts bench/ on sys.path itself, as when it runs)."""

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_bench(name: str):
    """bench/<name>.py as a module named bench_<name>."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
