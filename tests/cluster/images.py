"""The images the test node runs, built here without a registry or a daemon.

- `disaggpool.local/pause:3.4`: the pod sandbox, Kubernetes' own pause.c (compiled by
  scripts/k8s_env.sh) alone in an image.
- `disaggpool.local/disaggpool:test`: what the project's Dockerfile makes (the `disaggpool`
  console script, uid 65532, no writable path but /tmp), on the Debian bookworm + Python 3.11 root
  filesystem that scripts/k8s_env.sh debootstraps, with this checkout's wheel and its
  dependencies (from PyPI, like the Dockerfile's `pip install`) in a virtual environment, plus
  a `vllm` command (vllm_shim.py) so that the engine pods the operator renders run the emulator.

Each is an OCI image layout made with umoci, handed to containerd as a tar archive.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAUSE = ("disaggpool.local/pause", "3.4")
PROJECT = ("disaggpool.local/disaggpool", "test")
VENV = "/opt/disaggpool"
ENV = [
    f"PATH={VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "PYTHONDONTWRITEBYTECODE=1",
    "PYTHONUNBUFFERED=1",
    "MPLCONFIGDIR=/tmp",
]


def _run(*cmd: str | Path, cwd: Path | None = None) -> None:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed:\n{proc.stdout}\n{proc.stderr}")


def _image(work: Path, bin_dir: Path, tag: str, fill, config: list[str]) -> Path:
    """An OCI layout in `work` with one image `tag`: `fill(rootfs)` writes its files."""
    umoci = bin_dir / "umoci"
    layout, bundle = work / "layout", work / "bundle"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    _run(umoci, "init", "--layout", layout)
    _run(umoci, "new", "--image", f"{layout}:{tag}")
    _run(umoci, "unpack", "--image", f"{layout}:{tag}", bundle)
    fill(bundle / "rootfs")
    _run(umoci, "repack", "--image", f"{layout}:{tag}", bundle)
    _run(umoci, "config", "--image", f"{layout}:{tag}", *config)
    archive = work / "image.tar"
    _run("tar", "-C", layout, "-cf", archive, ".")
    shutil.rmtree(bundle, ignore_errors=True)
    return archive


def _pause_files(bin_dir: Path):
    def fill(rootfs: Path) -> None:
        shutil.copy2(bin_dir / "pause", rootfs / "pause")

    return fill


def _project_files(bin_dir: Path, wheels: Path):
    def fill(rootfs: Path) -> None:
        base = bin_dir.parent / "images" / "base-rootfs.tar"
        _run("tar", "-C", rootfs, "--numeric-owner", "-xf", base)
        staged = rootfs / "tmp" / "wheels"
        shutil.copytree(wheels, staged)
        _run("chroot", rootfs, "python3", "-m", "venv", VENV)
        _run(
            "chroot",
            rootfs,
            f"{VENV}/bin/pip",
            "install",
            "--quiet",
            "--no-cache-dir",
            "--no-index",
            "--find-links",
            "/tmp/wheels",
            "disaggpool",
        )
        shutil.rmtree(staged)
        shim = rootfs / VENV.lstrip("/") / "bin" / "vllm"
        shim.write_text(
            f"#!{VENV}/bin/python\n" + (Path(__file__).parent / "vllm_shim.py").read_text()
        )
        shim.chmod(0o755)

    return fill


def project_wheels(dest: Path) -> Path:
    """This checkout's wheel and every dependency's, for the image's CPython 3.11 on x86_64."""
    shutil.rmtree(dest, ignore_errors=True)
    pip = [sys.executable, "-m", "pip"]
    _run(*pip, "wheel", "--quiet", "--no-deps", "-w", dest, REPO)
    (wheel,) = dest.glob("disaggpool-*.whl")
    _run(
        *pip,
        "download",
        "--quiet",
        "--dest",
        dest,
        "--only-binary=:all:",
        "--python-version",
        "3.11",
        "--implementation",
        "cp",
        "--abi",
        "cp311",
        "--platform",
        "manylinux_2_28_x86_64",
        "--platform",
        "manylinux_2_17_x86_64",
        "--platform",
        "manylinux2014_x86_64",
        "--platform",
        "any",
        wheel,
    )
    return dest


def build_images(work: Path, bin_dir: Path) -> list[tuple[Path, str]]:
    """(archive, name without tag) of every image the node needs, built in `work`."""
    pause = _image(
        work / "pause",
        bin_dir,
        PAUSE[1],
        _pause_files(bin_dir),
        ["--config.entrypoint", "/pause", "--config.user", "65535:65535"],
    )
    wheels = project_wheels(work / "wheels")
    config = ["--config.user", "65532:65532"]
    config += ["--config.cmd", "disaggpool", "--config.cmd", "operator"]
    for env in ENV:
        config += ["--config.env", env]
    project = _image(work / "project", bin_dir, PROJECT[1], _project_files(bin_dir, wheels), config)
    return [(pause, PAUSE[0]), (project, PROJECT[0])]
