"""What a wheel of the project holds: the package with its committed tuning logs as package data,
which an installed (not editable) rlx_tvm finds through importlib.resources."""

import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_wheel_ships_the_tuning_logs_and_an_install_finds_them(tmp_path):
    src = tmp_path / "src"  # a copy: the build leaves build/ and egg-info where it runs
    shutil.copytree(ROOT / "rlx_tvm", src / "rlx_tvm", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src)
    # With this environment's setuptools where it has one (offline, quick); else pip fetches it.
    local = ["--no-build-isolation", "--no-index"] if importlib.util.find_spec("setuptools") else []
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *local, "-q", "-w", str(tmp_path / "dist"),
                    str(src)], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        z.extractall(tmp_path / "site")
    logs_dir = ROOT / "rlx_tvm" / "tuning_logs"
    logs = {p.relative_to(ROOT).as_posix() for p in logs_dir.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert any(n.endswith("/database_tuning_record.json") for n in logs), sorted(logs)
    assert logs <= names, sorted(logs - names)
    # the device pack copies these two out of the installed package
    assert {"rlx_tvm/bench/device_time.py", "rlx_tvm/bench/suite_torch.py", "rlx_tvm/cli/__main__.py"} <= names

    probe = ("import os, rlx_tvm.build as b; print(b.TUNING_LOGS); "
             "print(sorted(d for d in os.listdir(b.TUNING_LOGS) if os.path.isdir(os.path.join(b.TUNING_LOGS, d))))")
    env = {k: v for k, v in os.environ.items() if k != "RLX_TVM_TUNING_LOGS"}
    env["PYTHONPATH"] = str(tmp_path / "site")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                         check=True, timeout=300).stdout.splitlines()
    keys = sorted(p.name for p in logs_dir.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert out[-2] == str(tmp_path / "site" / "rlx_tvm" / "tuning_logs") and out[-1] == str(keys), out
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env={**env, "RLX_TVM_TUNING_LOGS": str(tmp_path)},
                         capture_output=True, text=True, check=True, timeout=300).stdout.splitlines()
    assert out[-2] == str(tmp_path), out  # the override still names another directory of logs
