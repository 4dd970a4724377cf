"""Writing result files: whole or not at all.

`write_csv(path, rows)` writes the rows (dicts, the first one's keys as the header unless
`fieldnames` is given) to a temporary file beside `path` and renames it over `path`, so that a
crash or a full disk leaves the previous results file whole instead of a truncated one; the
folder is created when missing. `write_text(path, text)` does the same for a text file.
"""
from __future__ import annotations

import csv
import os
import uuid
from pathlib import Path
from typing import Iterable, List, Optional


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
