"""``data.name=imagefolder:PATH`` straight into ``train``: images decoded as they are read.

``PATH`` holds ``train/<class>/<image>`` (and ``val/`` or ``test/`` alike), or is itself the
training split's class folders. Labels follow the class names of the training split, so a
validation folder lacking a class is numbered right (one with an extra class is refused). The
same checks as ``hpctrain data shard imagefolder:PATH``, from the image headers only: every image
must share one size unless ``data.image_size`` resizes them, and the minority of gray/RGB images
is converted to the majority mode. A file that cannot be decoded mid-run stops the run naming it.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import numpy as np
import torch
from torch.utils.data import Dataset

from hpctrain.config.data import DataConfig
from hpctrain.data.errors import ShardError
from hpctrain.data.files import Look, _class_names, _target_look
from hpctrain.data.manifest import IMAGE_EXTS
from hpctrain.data.pack import PackOptions, pillow
from hpctrain.data.user import UserData


class ImageFolderDataset(Dataset):
    """``(CHW float32 in [0, 1], class id)`` per image file, at one size and mode (``look``)."""

    def __init__(self, files: list[Path], labels: list[int], look: Look, classes: list[str],
                 root: Path | None = None) -> None:
        self.files, self.labels, self.look, self.classes, self.root = files, labels, look, classes, root

    def __len__(self) -> int:
        return len(self.files)

    def sample_name(self, index: int) -> str:
        """The image's path below the split's folder (``cat/001.png``): what predictions are keyed by."""
        file = self.files[index]
        return file.relative_to(self.root).as_posix() if self.root is not None else file.name

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = pillow()
        file = self.files[index]
        size, mode = self.look
        try:
            with image.open(file) as img:
                out = img.convert(mode)
                if out.size != size:
                    out = out.resize(size, image.Resampling.BILINEAR)
                pixels = np.array(out)  # a writable copy: torch.from_numpy shares it
        except Exception as err:  # noqa: BLE001 - PIL raises many kinds for a bad file; each is the file's fault
            raise ShardError(f"image {file} cannot be read: {type(err).__name__}: {err}; hint: delete or replace "
                             "the file (`hpctrain data shard imagefolder:PATH` checks every image first)") from None
        x = torch.from_numpy(pixels).float().div_(255.0)
        return (x.unsqueeze(0) if x.ndim == 2 else x.permute(2, 0, 1)).contiguous(), self.labels[index]


def _header_look(image: ModuleType, file: Path) -> Look:
    """Size and mode from the header alone (cheap: no pixels decoded)."""
    try:
        with image.open(file) as img:
            return img.size, "L" if img.mode == "L" else "RGB"
    except Exception as err:  # noqa: BLE001 - not an image PIL can read: the file's fault
        raise ShardError(f"image {file} cannot be read: {type(err).__name__}: {err}; hint: delete or replace the "
                         "file") from None


def _folder(root: Path, split: str, classes: tuple[str, ...] | None, image_size: int | None,
            look: Look | None = None) -> ImageFolderDataset:
    image = pillow()
    found = sorted(p.name for p in root.iterdir() if p.is_dir())
    names = _class_names(str(root), split, found, PackOptions(classes=classes, allow_missing_classes=True))
    files = [(i, f) for i, c in enumerate(names) if (root / c).is_dir() for f in sorted((root / c).iterdir())
             if f.suffix.lower().lstrip(".") in IMAGE_EXTS]
    if not files:
        raise ShardError(f"imagefolder {root} holds no .png/.jpg files in class subfolders; hint: "
                         "PATH/<class>/<image>, or PATH/train/<class>/<image>")
    looks = [_header_look(image, f) for _, f in files]
    target = _target_look(str(root), looks, [f for _, f in files], image_size)
    if look is not None and target[0] != look[0]:  # another split: the training split's size and mode
        raise ShardError(f"imagefolder {root} ({split}) holds {target[0][0]}x{target[0][1]} images, the training "
                         f"split {look[0][0]}x{look[0][1]}; hint: data.image_size=N resizes both")
    return ImageFolderDataset([f for _, f in files], [i for i, _ in files], look or target, names, root)


def imagefolder_splits(data: DataConfig, arg: str, seed: int) -> UserData:
    """Source hook (``data.name=imagefolder:PATH``)."""
    base = Path(arg)
    if not base.is_dir():
        raise ShardError(f"imagefolder {arg} is not a directory; hint: imagefolder:PATH with one subfolder per "
                         "class, or with train/ and val/ holding them")
    nested = (base / "train").is_dir()
    train = _folder(base / "train" if nested else base, "train", None, data.image_size)
    val_dir = base / data.val_split
    val = None
    if nested and val_dir.is_dir():
        val = _folder(val_dir, data.val_split, tuple(train.classes), data.image_size, train.look)
    return UserData(data.name, train, val, len(train.classes))
