"""The routing benchmark's A/B mode (`POLICY@DIR`) runs the router from DIR, not from this tree."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

from routing_common import router_env  # noqa: E402


def test_a_router_from_another_checkout_imports_that_checkout_even_when_started_from_this_repo(tmp_path, monkeypatch):
    """`python -m` puts the working directory first on sys.path, ahead of PYTHONPATH: started from this
    repository's root with PYTHONPATH=DIR, the "other" router imported this tree's tokenmill (both sides of
    an A/B ran the same code)."""
    pkg = tmp_path / "other" / "tokenmill"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text("import tokenmill; print(tokenmill.__file__)\n")
    monkeypatch.chdir(REPO)  # where the benchmark is run from: this tree's tokenmill/ is in the cwd
    env, cwd = router_env(str(tmp_path / "other"))
    out = subprocess.run([sys.executable, "-m", "tokenmill"], env=env, cwd=cwd, capture_output=True, text=True,
                         check=True).stdout.strip()
    assert Path(out).resolve() == (pkg / "__init__.py").resolve()
