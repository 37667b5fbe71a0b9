"""The shard index of one split: a manifest and its per-shard indexes as flat arrays over global
sample ids (shard-major numbering), checked when opened (every shard present and a regular file;
which are truncated)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from hpctrain.data.errors import ShardError
from hpctrain.data.manifest import data_dir, load_index, load_manifest, manifest_path
from hpctrain.data.remote import remote_of, remote_sizes


class ShardIndex:
    """Manifest + per-shard indexes of one split, as flat arrays over global sample ids."""

    def __init__(self, root: str | Path, split: str) -> None:
        self.root, self.split = Path(root), split
        self.manifest = load_manifest(root, split)
        self.data_root = data_dir(root, self.manifest)  # the tars; root holds manifest and indexes
        self.shards = self.manifest["shards"]
        self.fields: list[str] = list(self.manifest["fields"])
        self.decode: dict[str, Any] = self.manifest.get("decode") or {}
        self.classes: list[str] = list(self.manifest.get("classes") or [])
        # shards on object storage: their sizes from one listing, their bytes read by hpctrain.data.remote
        self.remote = remote_of(self.manifest)
        self._remote_sizes = remote_sizes(self.manifest) if self.remote else {}
        self._check_present()
        # load_index checks every range (non-negative, inside the declared bytes) and gives int64 arrays
        indexes = [load_index(root, s, self.fields) for s in self.shards]
        self.sizes = [len(ix["keys"]) for ix in indexes]
        self.keys: list[str] = [k for ix in indexes for k in ix["keys"]]
        self.shard_of = np.repeat(np.arange(len(indexes), dtype=np.int32), self.sizes)
        self.start = np.concatenate([ix["start"] for ix in indexes])
        self.length = np.concatenate([ix["end"] for ix in indexes]) - self.start
        self.crc = np.concatenate([ix["crc32"] for ix in indexes])
        self.offsets = np.concatenate([ix["offsets"] for ix in indexes])
        # what each shard held when opened: a read never asks for more than is there (see ShardDataset.read)
        self.file_bytes = [self._remote_sizes[s["name"]] if self.remote else (self.data_root / s["name"]).stat().st_size
                           for s in self.shards]

    def __len__(self) -> int:
        return len(self.keys)

    def where(self, shard: int | str) -> str:
        """Shard ``shard``'s location (by number or name), for messages: a path, or its URL on the store
        (never the metadata mirror's directory, where no tar is)."""
        name = shard if isinstance(shard, str) else self.shards[int(shard)]["name"]
        return f"{self.remote[0]}/{name}" if self.remote else str(self.data_root / name)

    def place(self) -> str:
        """Where the split's data is, for hints (``hpctrain data verify PLACE``)."""
        return self.remote[0] if self.remote else str(self.root)

    def _check_present(self) -> None:
        """A shard the manifest lists but the directory lacks is missing input (not a truncated one)."""
        if self.remote:
            self._check_listed()
            return
        if not self.shards:
            raise ShardError(f"{manifest_path(self.root, self.split)} lists no shards; hint: write the split again "
                             "(`hpctrain data shard` or `hpctrain data index`)")
        odd = [s["name"] for s in self.shards if (self.data_root / s["name"]).exists()
               and not (self.data_root / s["name"]).is_file()]
        if odd:  # a FIFO would block the first read, a device stream forever
            raise ShardError(f"shard {self.data_root / odd[0]} is not a regular file (a FIFO, device or directory); "
                             f"hint: put the tar file itself there, then `hpctrain data verify {self.root}`")
        missing = [s["name"] for s in self.shards if not (self.data_root / s["name"]).is_file()]
        if missing:
            shown = ", ".join(missing[:3]) + (" ..." if len(missing) > 3 else "")
            manifest = manifest_path(self.root, self.split)
            raise ShardError(f"{len(missing)} of the {len(self.shards)} shards that {manifest} lists are missing from "
                             f"{self.data_root}: {shown}; hint: copy them back (or stage the data again), then check "
                             f"with `hpctrain data verify {self.root}`")

    def _check_listed(self) -> None:
        assert self.remote is not None
        if not self.shards:
            raise ShardError(f"{self.remote[0]}/{self.split}.manifest.json lists no shards; hint: write the split "
                             f"again (hpctrain data shard SOURCE {self.remote[0]} --split {self.split})")
        missing = [s["name"] for s in self.shards if s["name"] not in self._remote_sizes]
        if missing:
            shown = ", ".join(missing[:3]) + (" ..." if len(missing) > 3 else "")
            raise ShardError(f"{len(missing)} of the {len(self.shards)} shards that {self.remote[0]}/{self.split}"
                             f".manifest.json lists are missing from the store: {shown}; hint: upload them again "
                             f"(hpctrain data shard SOURCE {self.remote[0]}), then `hpctrain data verify "
                             f"{self.remote[0]}`")

    def truncated(self) -> list[tuple[str, str]]:
        """(shard, first sample key past the end) for each shard shorter than its index says."""
        out, first = [], 0
        for shard, count, size in zip(self.shards, self.sizes, self.file_bytes):
            ends = self.start[first : first + count] + self.length[first : first + count]
            beyond = np.nonzero(ends > size)[0]
            if len(beyond):
                out.append((shard["name"], self.keys[first + int(beyond[0])]))
            first += count
        return out
