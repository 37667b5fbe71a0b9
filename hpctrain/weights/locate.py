"""Where a user points at checkpoints (``hpctrain eval --weights``, ``hpctrain ckpt list / verify /
export``): a run directory, its ``checkpoints/`` folder, or one checkpoint (``step-N``) all work,
read by this one function, and each command says which checkpoint it took. A path that holds no
committed checkpoint is bad input (:class:`~hpctrain.checkpoint.layout.NoCheckpointError`,
exit 2), named with where it looked. Torch-free: ``ckpt list`` runs on login nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hpctrain.checkpoint import layout
from hpctrain.checkpoint.view import manifest_format, view_class

if TYPE_CHECKING:
    from hpctrain.weights.export import Source

RUN, FOLDER, ONE = "run directory", "checkpoints folder", "checkpoint"


@dataclass(frozen=True)
class Located:
    """What ``given`` is (:data:`RUN`, :data:`FOLDER` or :data:`ONE`), the folder that holds its
    checkpoints (``root``: retention's and best.json's), and its committed checkpoints, oldest first."""

    given: Path
    kind: str
    root: Path
    checkpoints: list[tuple[int, Path]]

    def describe(self) -> str:
        """``run directory R: 3 checkpoints in R/checkpoints``, for the commands' first line."""
        if self.kind == ONE:
            return f"checkpoint {self.given}"
        count = len(self.checkpoints)
        return f"{self.kind} {self.given}: {count} committed checkpoint{'s' * (count != 1)} in {self.root}"


def locate(path: str | Path) -> Located:
    """The checkpoints ``path`` names: itself when it holds a manifest, else those of
    ``path/checkpoints`` (a run directory), else those of ``path`` (a checkpoints folder).
    Nothing committed there: :class:`~hpctrain.checkpoint.layout.NoCheckpointError` (exit 2)."""
    path = Path(path)
    if not path.is_dir():
        what = "is not a directory" if path.exists() else "does not exist"
        raise layout.NoCheckpointError(f"{path} {what}; hint: give a run directory, its checkpoints/ folder "
                                       "or one checkpoint (RUN/checkpoints/step-N)")
    if (path / layout.MANIFEST).is_file():
        return Located(path, ONE, path.parent, [(layout.step_of(path) or 0, path)])
    for kind, root in ((RUN, layout.checkpoints_dir(path)), (FOLDER, path)):
        found = layout.committed(root)
        if found:
            return Located(path, kind, root, found)
    raise layout.NoCheckpointError(_nothing_there(path))


def _nothing_there(path: Path) -> str:
    if layout.step_of(path) is not None or path.name.startswith(layout.PARTIAL_PREFIX):
        return (f"{path} is not a committed checkpoint (no {layout.MANIFEST}: its save never finished); hint: "
                f"`hpctrain ckpt list {path.parent}` lists the committed ones")
    return (f"{path} holds no committed checkpoint (looked for {layout.MANIFEST} in it, and for step-N folders in "
            f"{layout.checkpoints_dir(path)} and in {path}); hint: give a run directory, its checkpoints/ folder or "
            "one checkpoint, or `hpctrain ckpt list RUN_DIR`")


def newest_intact(located: Located) -> layout.Found:
    """The newest of ``located``'s checkpoints whose files match their manifest (corrupt ones
    are warned about and skipped); the one checkpoint given must be intact itself."""
    if located.kind == ONE:
        step, path = located.checkpoints[0]
        return layout.Found(path, step, layout.verify(path))
    for step, path in reversed(located.checkpoints):
        problems = layout.verify(path)
        if not problems:
            return layout.Found(path, step, [])
        layout.log.warning("checkpoint %s is corrupt and is skipped: %s", path, "; ".join(problems))
    raise layout.CheckpointError(f"{located.describe()}, none of them intact; hint: `hpctrain ckpt verify "
                                 f"{located.given}` names the damage")


def checkpoint_source(path: Path) -> Source:
    """A committed checkpoint's model tensors, without a process group, from the view class of
    its manifest's format (a sharded checkpoint's read one at a time, never the optimizer state)."""
    source: Source = view_class(manifest_format(layout.read_manifest(path))).export(path)
    return source
