"""Running code in a fresh interpreter: fresh plugin discovery, its own environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_python(code: str, site: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (fresh plugin discovery), ``site`` on its path."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("DLCORE_") or k == "DLCORE_CACHE_DIR"}
    full_env.update(env)
    if site is not None:
        full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), full_env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=600)


def run_json(code: str, site: Path | None = None, **env: str) -> dict:
    """Run ``code``, which prints one JSON document last; return it."""
    done = run_python(code, site, **env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])
