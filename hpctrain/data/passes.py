"""Every training loader restarts on each ``iter()``, as a ``DataLoader`` does.

A loader keeps a position (epoch, batches done) so that a checkpoint can resume mid-epoch. A
position set on purpose (a new loader, ``set_epoch``, ``load_state_dict``, the end of an epoch)
is where the next ``iter()`` starts; the training loop calls ``set_epoch`` before each epoch.
Once a pass has started, the next ``iter()`` is a new epoch from its first batch, whether or
not the previous pass ran to its end: Lightning stops after ``len(loader)`` batches without
exhausting the iterator, a plain ``for`` loop may ``break``.
"""

from __future__ import annotations


class Passes:
    """Mixin for training loaders: the epoch and position rules above. A subclass keeps its own
    position and implements :meth:`_rewind` (back to the start of ``self.epoch``)."""

    epoch: int = 0
    batches_done: int = 0
    _placed: bool = True  # the position was set on purpose: the next iter() starts there
    _pass: int = 0  # the current pass; an older iterator that is resumed later stops at once

    def _rewind(self) -> None:
        """Back to the first batch of ``self.epoch`` (subclasses reset their position here)."""
        self.batches_done = 0

    def set_epoch(self, epoch: int) -> None:
        """The next pass is ``epoch``: from its first batch, or, when the loader is in ``epoch``
        already, from ``batches_done`` on (the training loop's protocol: a restored position, or
        the rest of an epoch that ``train.max_steps`` cut short)."""
        if epoch != self.epoch:
            self.epoch = epoch
            self._rewind()
        self._placed = True

    def _place(self) -> None:
        """The position was just restored: the next iter() continues from it."""
        self._placed = True

    def _begin_pass(self) -> int:
        if not self._placed:  # a pass of this epoch ran (in whole or in part): this one is the next epoch
            self.epoch += 1
            self._rewind()
        self._placed = False
        self._pass += 1
        return self._pass

    def _current(self, token: int) -> bool:
        """Whether the pass ``token`` is still the loader's (no newer ``iter()`` began)."""
        return token == self._pass

    def _end_pass(self, token: int) -> None:
        """The pass ran to its end: the next iter() starts the next epoch."""
        if self._current(token):
            self.epoch += 1
            self._rewind()
            self._placed = True
