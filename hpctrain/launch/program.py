"""A user's own program on the ranks: ``SCRIPT.py ARGS`` or ``-m MODULE ARGS``, as torchrun
and ``python`` take them (``hpctrain run`` and ``hpctrain slurm``). No torch here: the Slurm
script is written on a login node.
"""

from __future__ import annotations

import sys
from pathlib import Path

from hpctrain.core.errors import UserError

_PYTHONS = ("python", "python3", Path(sys.executable).name)


def user_program(rest: list[str], module: list[str] | None = None, base: Path | None = None) -> list[str] | None:
    """``[SCRIPT.py, ARGS]`` or ``[-m, MODULE, ARGS]`` for a user's program, None for hpctrain's
    own train/eval. A leading ``python`` is dropped: the ranks run the job's interpreter. A
    script must exist (relative to ``base``, default the current directory)."""
    if module is not None:
        if not module:
            raise UserError("-m needs a module, e.g. hpctrain run -n 2 -m mypkg.train --lr 0.1")
        return ["-m", *module]
    if rest[:1] and Path(rest[0]).name in _PYTHONS:
        rest = rest[1:]
        if rest[:1] == ["-m"]:
            return user_program([], rest[1:], base)
        if not rest:
            raise UserError("python needs a script, e.g. hpctrain run -n 2 python train.py --lr 0.1")
    if not rest or not rest[0].endswith(".py"):
        return None
    base = base or Path.cwd()
    if not (base / rest[0]).is_file():
        raise UserError(f"script {rest[0]} does not exist; hint: a path relative to {base}")
    return rest

