"""Command-line pieces shared by the experiment scripts.

`fill_unset(args, values)`: a run-size preset (--quick, --tiny) or the defaults for the options
the command line did not give; the options are declared with `default=argparse.SUPPRESS`, so an
explicit value always wins over the preset.
`comma_list(parser, name, text, conv, valid, what)`: a comma-separated option's values, or a
usage error. `shape_arg(parser, name, text)`: an "OUTxIN" option as two positive ints, or a
usage error. `add_grid(ap)` / `grid(ap, args)`: the --shape / --sparsity / --batch options of the
scripts that time a grid of points, and their values.
`out_arg(parser, name, path)`: a usage error unless a result file can be written at `path`
(checked before a run, not after it). `figure_arg(parser, name, path)`: the same for a figure,
whose extension must be a format matplotlib writes (none: .png); returns the path written.
`csv_to_plot(path, default, writer)`: whether a plot script has its CSV, or one line saying why
not.
`read_rows(path, required, writer)`: a script's input CSV rows, or one line saying why they
cannot be read (missing, not a CSV text, a CSV of another script, no rows).
`bool_arg(text)`: an argparse type for a boolean option (true/false, yes/no, on/off, 1/0; anything
else is a usage error).
"""
from __future__ import annotations

import argparse
import csv
import os
import tempfile
from pathlib import Path


def fill_unset(args: argparse.Namespace, values: dict) -> None:
    """Sets every option of `values` that is not in `args` (not given on the command line)."""
    for key, value in values.items():
        if not hasattr(args, key):
            setattr(args, key, value)


def comma_list(parser: argparse.ArgumentParser, name: str, text: str, conv, valid=None, what: str = "") -> list:
    """[conv(v) for each comma-separated v of the option --name's `text`]; a usage error (exit 2)
    naming the option when it is empty or conv raises ValueError on a value, or when `valid` is
    given and some value fails it ("--name must be <what>")."""
    try:
        vals = [conv(v) for v in text.split(",") if v.strip()]
    except ValueError:
        vals = []
    if not vals:
        parser.error(f"--{name} must be a comma-separated list, got {text!r}")
    if valid is not None and not all(valid(v) for v in vals):
        parser.error(f"--{name} must be {what}, got {text!r}")
    return vals


def shape_arg(parser: argparse.ArgumentParser, name: str, text: str):
    """(out, in) from the option --name's "OUTxIN" text (positive ints), or a usage error."""
    parts = text.lower().split("x")
    try:
        out_f, in_f = (int(p) for p in parts)
    except ValueError:
        out_f = in_f = 0
    if out_f < 1 or in_f < 1:
        parser.error(f"--{name} must be OUTxIN with positive ints (e.g. 4096x4096), got {text!r}")
    return out_f, in_f


def add_grid(ap: argparse.ArgumentParser, batch: str = "1,8,32,128") -> None:
    """The --shape, --sparsity and --batch options of a script that times a grid of points."""
    ap.add_argument("--shape", default="4096x4096", help="the layer's OUTxIN (default 4096x4096)")
    ap.add_argument("--sparsity", default="0.9,0.95,0.99", help="comma list in [0, 1) (default 0.9,0.95,0.99)")
    ap.add_argument("--batch", default=batch, help=f"comma list of batch sizes (default {batch})")


def grid(ap: argparse.ArgumentParser, args: argparse.Namespace):
    """(n_out, n_in, sparsities, batches) from add_grid's options, or a usage error naming the
    option."""
    n_out, n_in = shape_arg(ap, "shape", args.shape)
    sparsities = comma_list(ap, "sparsity", args.sparsity, float, lambda s: 0 <= s < 1, "in [0, 1)")
    batches = comma_list(ap, "batch", args.batch, int, lambda b: b >= 1, "positive ints")
    return n_out, n_in, sparsities, batches


def bool_arg(text: str) -> bool:
    """True or False from a boolean option's text; argparse.ArgumentTypeError for anything else."""
    v = str(text).strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false), got {text!r}")


def auto_int(text: str):
    """None for "auto", else int(text) (ValueError otherwise): a comma_list converter."""
    return None if text.strip() == "auto" else int(text)


def out_arg(parser: argparse.ArgumentParser, name: str, path) -> None:
    """A usage error naming --name unless a file can be written at `path`: it is a regular file or
    not there yet, and the nearest existing folder on its way (the writers make the missing
    ones) is a folder in which a file can be made (tried: a temporary file, removed)."""
    p = Path(path)
    if p.exists() and not p.is_file():
        parser.error(f"--{name} {path} is {'a directory' if p.is_dir() else 'not a regular file'}: "
                     "give the path of a file")
    d = p.parent
    while not d.exists() and d != d.parent:
        d = d.parent
    if not d.is_dir():
        parser.error(f"--{name} {path}: {d} is not a directory")
    try:
        with tempfile.NamedTemporaryFile(dir=d, prefix=".snack-write-check-"):
            pass
    except OSError as e:
        parser.error(f"--{name} {path}: cannot write a file in {d} ({e.strerror or e})")


def figure_arg(parser: argparse.ArgumentParser, name: str, path: str) -> str:
    """The path a figure is written to: `path`, with .png added when it has no extension (as
    matplotlib's savefig does); a usage error naming --name when the extension is not a format
    matplotlib writes or the file cannot be written there (out_arg)."""
    from matplotlib.backend_bases import FigureCanvasBase
    if Path(path).is_dir():
        parser.error(f"--{name} {path} is a directory: give the path of a file")
    ext = os.path.splitext(path)[1]
    if not ext:
        path = f"{path}.png"
    elif ext[1:].lower() not in FigureCanvasBase.get_supported_filetypes():
        parser.error(f"--{name} {path}: {ext!r} is not a figure format matplotlib writes (one of "
                     f"{', '.join(sorted(FigureCanvasBase.get_supported_filetypes()))})")
    out_arg(parser, name, path)
    return path


def csv_to_plot(path, default, writer: str, hint: str = "") -> bool:
    """True when the CSV `path` exists. Without it: for the script's default CSV (not measured
    yet; `make figures` redraws what has been measured) prints that nothing is drawn and returns
    False; for any other path stops with one line naming `writer`, the script that writes it
    (`hint`: what else to say about running it)."""
    if Path(path).exists():
        return True
    if str(path) == str(default):
        print(f"no {path} yet (python experiments/{writer} on a GPU writes it): nothing drawn")
        return False
    raise SystemExit(f"{path} does not exist: give --csv a CSV written by experiments/{writer} "
                     f"(python experiments/{writer} --out {path} writes one{hint})")


def read_rows(path, required, writer: str, option: str = "--csv") -> list:
    """The rows (dicts) of the CSV at `path`. Stops with one line naming `writer`, the script whose
    CSV is expected (and `option`, the option that takes it), when the file is missing or cannot
    be read, is not CSV text, lacks a column of `required` (e.g. a CSV of another script), or has
    no rows."""
    hint = f"give {option} a CSV written by experiments/{writer}"
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            rows = list(reader)
            names = reader.fieldnames or []
    except FileNotFoundError:
        raise SystemExit(f"{path} does not exist: {hint}") from None
    except OSError as e:
        raise SystemExit(f"{path} cannot be read ({e.strerror or e}): {hint}") from None
    except (UnicodeDecodeError, csv.Error) as e:
        raise SystemExit(f"{path} is not a readable CSV text file ({type(e).__name__}: {e}): {hint}") from None
    missing = [c for c in required if c not in names]
    if missing:
        raise SystemExit(f"{path} lacks the column(s) {', '.join(missing)}: {hint}")
    if not rows:
        raise SystemExit(f"{path} has no rows")
    return rows
