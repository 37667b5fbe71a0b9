"""Moved to :mod:`hpctrain.core.errors` (the core layer, docs/architecture.md); this old path stays
importable for one release, as the same module object."""

import sys

from hpctrain.core import errors as _moved

sys.modules[__name__] = _moved
