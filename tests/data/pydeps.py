"""pydeps.py - the PyPI packages a test reads meshrun's output with (never
a dependency of meshrun), installed on first use into the build's pydeps
folder ($MESHRUN_BUILD_DIR/pydeps) and imported from there."""
import importlib
import os
import subprocess
import sys
import tempfile


def _importable(modules):
    try:
        for m in modules:
            importlib.import_module(m)
        return True
    except Exception:
        return False


def ensure(modules, requirement):
    """Whether `modules` import, after `pip install requirement` into the
    pydeps folder where they did not; prints why not (a test then skips)."""
    target = os.path.join(os.environ.get("MESHRUN_BUILD_DIR", tempfile.gettempdir()), "pydeps")
    if target not in sys.path:
        sys.path.insert(0, target)
    if _importable(modules):
        return True
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--target", target,
           "--break-system-packages", requirement]
    try:
        subprocess.run(cmd, check=True, timeout=300)
    except Exception as e:
        print("SKIP: could not install %s from PyPI (%s)" % (requirement, e))
        return False
    # the folder may not have existed when it went on sys.path: forget that
    sys.path_importer_cache.pop(target, None)
    importlib.invalidate_caches()
    if not _importable(modules):
        print("SKIP: %s installed in %s but %s not importable" %
              (requirement, target, ", ".join(modules)))
        return False
    return True
