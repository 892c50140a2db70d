"""The bench's scripts start where only snap's runtime wheels are installed: bench/gpubox.sh unpacks
those alone on the GPU box (no pytest there), and a device run is one try of a few minutes."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# pytest made unimportable, as on the GPU box; the script run as `python SCRIPT --help` would be.
WITHOUT_PYTEST = """
import runpy, sys
sys.modules["pytest"] = None
sys.argv = [sys.argv[1], "--help"]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("script", ["bench/gpubox.py", "bench/bench.py"])
def test_bench_scripts_start_without_the_test_extra(script):
    r = subprocess.run([sys.executable, "-c", WITHOUT_PYTEST, os.path.join(REPO, script)], cwd="/",
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "usage:" in r.stdout
