"""Containers for a job step: Apptainer (``apptainer exec`` inside the srun task) and
Enroot/Pyxis (``srun --container-*`` options).

Only the step runs in the container. The batch shell, which traps the preemption signal
and calls ``scontrol requeue``, stays on the host: Slurm's commands are rarely inside an
image ("scontrol: not found"), and the trap must outlive the step anyway.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from hpctrain.core.errors import UserError

Runtime = Literal["apptainer", "pyxis"]
RUNTIMES: tuple[Runtime, ...] = ("apptainer", "pyxis")


@dataclass(frozen=True, kw_only=True)
class Container:
    image: str
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
