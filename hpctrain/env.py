"""Moved to :mod:`hpctrain.core.env` (the core layer, docs/architecture.md); this old path stays
importable for one release, as the same module object."""

import sys

from hpctrain.core import env as _moved

sys.modules[__name__] = _moved
