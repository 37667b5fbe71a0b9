"""The planning layer: what a run will look like, decided before anything is built.

- :mod:`~hpctrain.planning.layout`: the run's :class:`~hpctrain.planning.layout.RunLayout`
  (its topology, batch split, strategy and checkpoint format) from the config and the world;
- :mod:`~hpctrain.planning.auto`: ``parallel.strategy=auto``, the choice of strategy, tp, pp,
  offload, activation checkpointing and micro-batch that fits the memory budget (``hpctrain plan``),
  for the machine of :mod:`~hpctrain.planning.machine` (``parallel.target_gpu`` or the device found)
  and the model of :mod:`~hpctrain.planning.profile` (a built-in transformer's shape, torch-free) or
  :mod:`~hpctrain.planning.autosize` (any other model, measured on the meta device).

It sits above :mod:`hpctrain.parallel` (it asks the strategy classes) and below the trainer and
the command line, which call it. Importing it loads no torch.
"""
