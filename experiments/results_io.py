"""Writing result files: whole or not at all.

`write_csv(path, rows)` writes the rows (dicts, the first one's keys as the header unless
`fieldnames` is given) to a temporary file beside `path` and renames it over `path`, so that a
crash or a full disk leaves the previous results file whole instead of a truncated one; the
folder is created when missing. `write_text(path, text)` does the same for a text file,
`save_torch(path, obj)` for `torch.save`.
`git_commit()` is the commit every results row records.
"""
from __future__ import annotations

import csv
import os
import subprocess
import uuid
from pathlib import Path
from typing import Iterable, List, Optional

#: the largest relative error (2-norm, against float64) of a timed SNACK op, per dtype name: a
#: point past it is not timed (bench_kernels.py) and its timings do not count (targets.py)
MAX_REL_ERR = {"float32": 1e-5, "float16": 4e-3, "bfloat16": 3e-2}

ROOT = Path(__file__).resolve().parents[1]
# what the results depend on: a modified file here marks the commit "-dirty"
_CODE = ("core", "gpu", "layers", "snack", "experiments")


def git_commit() -> str:
    """The checkout's short commit, "-dirty" when the library or the experiments differ from it,
    "unknown" without git. SNACK_COMMIT overrides it, for copies of the tree whose .git is
    missing or stale (a GPU machine that receives the working tree)."""
    env = os.environ.get("SNACK_COMMIT")
    if env:
        return env
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, timeout=10)
        if out.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", *_CODE], cwd=ROOT,
                               capture_output=True, text=True, timeout=10)
        return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _replace(path, write) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")  # unique per writer
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def save_figure(fig, path, **savefig_kwargs) -> Path:
    """fig.savefig to `path` atomically (a failed save leaves the figure there before whole), in
    the format its extension names (figure_arg gives every figure path one); returns the path."""
    import matplotlib
    fmt = Path(path).suffix.lstrip(".").lower() or matplotlib.rcParams["savefig.format"]  # (as savefig)
    return _replace(path, lambda tmp: fig.savefig(tmp, format=fmt, **savefig_kwargs))


def write_csv(path, rows: List[dict], fieldnames: Optional[Iterable[str]] = None) -> Path:
    """rows -> CSV at path (atomically); returns the path."""
    if not rows:
        raise ValueError(f"no rows to write to {path}")
    names = list(fieldnames) if fieldnames is not None else list(rows[0])

    def write(tmp):
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=names)
            w.writeheader()
            w.writerows(rows)
    return _replace(path, write)


def write_text(path, text: str) -> Path:
    """text -> path (atomically); returns the path."""
    return _replace(path, lambda tmp: Path(tmp).write_text(text))


def save_torch(path, obj) -> Path:
    """torch.save(obj) -> path (atomically); returns the path."""
    import torch
    return _replace(path, lambda tmp: torch.save(obj, tmp))
