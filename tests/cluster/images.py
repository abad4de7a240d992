"""The images the test node runs, built here without a registry or a daemon.

- `disaggpool.local/pause:3.4`: the pod sandbox, Kubernetes' own pause.c (compiled by
  scripts/k8s_env.sh) alone in an image, packed with umoci.
- `disaggpool.local/debian-python:bookworm`: the Debian bookworm root filesystem with Python 3.11
  that scripts/k8s_env.sh debootstraps, as an image: what the others are built on.
- `disaggpool.local/disaggpool:test`: the project's own `Dockerfile`, unchanged, built by buildah
  with `BASE` set to that image. The build reaches no index: pip inside it reads a pip.conf,
  mounted for the build only, that points at a folder of wheels downloaded here beforehand (this
  checkout's dependencies, and its build backend, from PyPI).
- `disaggpool.local/vllm-emulator:test`: that image plus a `vllm` command (vllm_shim.py) that runs
  the emulator with the command line the operator renders for an engine pod.
- `disaggpool.local/vllm-cpu:0.32.0`: the Debian image plus a `vllm` command (vllm_cpu.py) that
  runs a real vLLM CPU engine from scripts/vllm_env.sh's virtual environment, which the pool
  mounts read-only.

buildah keeps its image store in the work folder (the `vfs` driver: plain copies, no mounts left
behind) and runs RUN steps with chroot isolation (no container runtime, no network namespace);
each image leaves as an OCI archive that `ctr images import` takes.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
PAUSE = ("disaggpool.local/pause", "3.4")
BASE = ("disaggpool.local/debian-python", "bookworm")
PROJECT = ("disaggpool.local/disaggpool", "test")
EMULATED_ENGINE = ("disaggpool.local/vllm-emulator", "test")
REAL_ENGINE = ("disaggpool.local/vllm-cpu", "0.32.0")
#: Where the Dockerfile puts the project's virtual environment.
PROJECT_VENV = "/opt/disaggpool"

_BASE_CONTAINERFILE = """\
FROM scratch
ADD base-rootfs.tar /
ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
"""
# An engine image: its base plus one `vllm` command (the file `vllm` in the build context).
_ENGINE_CONTAINERFILE = """\
ARG BASE
FROM ${BASE}
COPY vllm /usr/local/bin/vllm
"""
_OFFLINE_PIP_CONF = """\
[global]
no-index = true
find-links = /wheels
"""


def _run(*cmd: str | Path, cwd: Path | None = None) -> None:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed:\n{proc.stdout}\n{proc.stderr}")


def _ref(image: tuple[str, str]) -> str:
    return f"{image[0]}:{image[1]}"


class Buildah:
    """buildah with a private image store under `work`, removed by `close`."""

    def __init__(self, work: Path) -> None:
        self.work = work
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        # Only local images are ever read: accept them without signatures.
        self.policy = work / "policy.json"
        self.policy.write_text('{"default": [{"type": "insecureAcceptAnything"}]}\n')

    def __call__(self, *args: str | Path) -> None:
        store = ["--root", self.work / "storage", "--runroot", self.work / "run"]
        _run("buildah", *store, "--storage-driver", "vfs", *args)

    def build(
        self,
        image: tuple[str, str],
        containerfile: Path,
        context: Path,
        base: tuple[str, str] | None = None,
        volumes: tuple[str, ...] = (),
    ) -> None:
        args: list[str | Path] = ["bud", "--isolation", "chroot", "--pull=never"]
        args += ["--signature-policy", self.policy, "--quiet", "-f", containerfile, "-t"]
        args.append(_ref(image))
        if base:
            args += ["--build-arg", f"BASE={_ref(base)}"]
        for volume in volumes:
            args += ["--volume", volume]
        self(*args, context)

    def export(self, image: tuple[str, str], archive: Path) -> Path:
        """`image` as an OCI archive (uncompressed layers: containerd unpacks them at once)."""
        self("push", "--signature-policy", self.policy, "--quiet", "--disable-compression",
             _ref(image), f"oci-archive:{archive}:{image[1]}")  # fmt: skip
        return archive

    def close(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)


def _pause_image(work: Path, bin_dir: Path) -> Path:
    """The sandbox image, one static binary: an OCI layout made with umoci, as a tar archive."""
    umoci = bin_dir / "umoci"
    layout, bundle = work / "layout", work / "bundle"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    tag = f"{layout}:{PAUSE[1]}"
    _run(umoci, "init", "--layout", layout)
    _run(umoci, "new", "--image", tag)
    _run(umoci, "unpack", "--image", tag, bundle)
    shutil.copy2(bin_dir / "pause", bundle / "rootfs" / "pause")
    _run(umoci, "repack", "--image", tag, bundle)
    _run(umoci, "config", "--image", tag, "--config.entrypoint", "/pause",
         "--config.user", "65535:65535")  # fmt: skip
    archive = work / "image.tar"
    _run("tar", "-C", layout, "-cf", archive, ".")
    shutil.rmtree(bundle, ignore_errors=True)
    return archive


def project_wheels(dest: Path) -> Path:
    """Every wheel the Dockerfile's `pip install .` needs, for CPython 3.11 on x86_64: this
    checkout's dependencies and its build backend (setuptools, wheel)."""
    shutil.rmtree(dest, ignore_errors=True)
    pip = [sys.executable, "-m", "pip"]
    _run(*pip, "wheel", "--quiet", "--no-deps", "-w", dest, REPO)
    (wheel,) = dest.glob("disaggpool-*.whl")
    platform = ["--python-version", "3.11", "--implementation", "cp", "--abi", "cp311"]
    for tag in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any"):
        platform += ["--platform", tag]
    _run(*pip, "download", "--quiet", "--dest", dest, "--only-binary=:all:", *platform,
         wheel, "setuptools>=77", "wheel")  # fmt: skip
    wheel.unlink()  # the Dockerfile builds the project from its source, as it does anywhere
    return dest


def _engine_context(work: Path, launcher: str) -> Path:
    """A build context of `_ENGINE_CONTAINERFILE` whose `vllm` is `launcher` (a script's text)."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "Containerfile").write_text(_ENGINE_CONTAINERFILE)
    command = work / "vllm"
    command.write_text(launcher)
    command.chmod(0o755)
    return work


def build_images(work: Path, bin_dir: Path) -> list[tuple[Path, str]]:
    """(archive, name without tag) of every image the node needs, built in `work`."""
    shutil.rmtree(work, ignore_errors=True)
    archives = [(_pause_image(work / "pause", bin_dir), PAUSE[0])]
    buildah = Buildah(work / "buildah")
    try:
        base_file = work / "base.Containerfile"
        base_file.write_text(_BASE_CONTAINERFILE)
        buildah.build(BASE, base_file, bin_dir.parent / "images")

        wheels = project_wheels(work / "wheels")
        pip_conf = work / "pip.conf"
        pip_conf.write_text(_OFFLINE_PIP_CONF)
        volumes = (f"{wheels}:/wheels:ro", f"{pip_conf}:/etc/pip.conf:ro")
        buildah.build(PROJECT, REPO / "Dockerfile", REPO, base=BASE, volumes=volumes)

        shim = f"#!{PROJECT_VENV}/bin/python\n" + (HERE / "vllm_shim.py").read_text()
        emulated = _engine_context(work / "emulated-engine", shim)
        buildah.build(EMULATED_ENGINE, emulated / "Containerfile", emulated, base=PROJECT)

        launcher = "#!/usr/bin/python3\n" + (HERE / "vllm_cpu.py").read_text()
        real = _engine_context(work / "real-engine", launcher)
        buildah.build(REAL_ENGINE, real / "Containerfile", real, base=BASE)

        for image in (PROJECT, EMULATED_ENGINE, REAL_ENGINE):
            archive = buildah.export(image, work / f"{image[0].rsplit('/', 1)[1]}.tar")
            archives.append((archive, image[0]))
    finally:
        buildah.close()
    return archives
