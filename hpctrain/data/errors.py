"""What can go wrong with data, as errors that name the file or key and the way out."""

from __future__ import annotations

from hpctrain.core.errors import RunError, UserError


class DataMissingError(UserError, FileNotFoundError):
    """The data is not installed; the message carries the command that installs it."""


class ShardError(UserError):
    """A shard directory, manifest or index is missing or inconsistent; the message names it."""


class CorruptSampleError(RunError):
    """A sample's bytes do not match the index (truncated shard, flipped byte, bad encoding)."""


class TruncatedShardError(UserError, CorruptSampleError):
    """A shard found truncated before training starts: bad input (exit 2), not a failed run."""


class DataFormatError(UserError):
    """A data file is not of the kind its source reads (a random file as MNIST); the message names it."""


class MissingPackageError(UserError):
    """An optional package the data needs is not installed; the message carries the pip command."""
