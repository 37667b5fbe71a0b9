"""Exact evaluation: every validation sample counted once across ranks.

- the metrics (sums and counts, merged across ranks) are the tasks' (:mod:`hpctrain.tasks.metrics`);
- :mod:`~hpctrain.evaluation.evaluate`: the distributed evaluation loop (any model, any world size);
- :mod:`~hpctrain.evaluation.pipeline`: the same through pipeline stages;
- :mod:`~hpctrain.evaluation.job`: ``hpctrain eval`` (saved weights, alone or at any world size).
"""
