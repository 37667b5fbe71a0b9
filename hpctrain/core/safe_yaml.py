"""YAML read as untrusted text: ``yaml.safe_load`` with aliases bounded and every error one line.

In ``core`` because both the config loader and the run directory's check (which reads a run's
``config.yaml`` before any config exists) read YAML, and ``core`` imports no higher layer.
"""
from __future__ import annotations

from typing import Any

import yaml

from hpctrain.core.section import ConfigError

MAX_YAML_VALUES = 100_000  # values after expanding aliases: a 700-byte alias bomb expands to billions


def safe_yaml(text: str, where: str) -> Any:
    """``yaml.safe_load`` with aliases bounded: the document's values are counted as if every
    alias were expanded (what building the config, ``config show`` and a checkpoint's copy of
    it do), and more than :data:`MAX_YAML_VALUES`, or an alias inside itself, is refused
    before anything is built. Any YAML error is one line naming ``where``, line and column."""
    try:
        loader = yaml.SafeLoader(text)  # checks the characters first: control characters are refused here
    except yaml.YAMLError as err:
        raise ConfigError(f"{where} is not valid YAML: {' '.join(str(err).split())}") from None
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expanded_size(node, where)
        try:
            return loader.construct_document(node)
        # a tag's value (!!float x, 5000 digits, a month 99) or PyYAML's own slip on one (an AttributeError
        # from its timestamp constructor): the safe loader builds only plain data, so any of these is the input's
        except (ValueError, TypeError, OverflowError, AttributeError, KeyError, IndexError) as err:
            raise ConfigError(f"{where}: a value YAML cannot build ({' '.join(str(err).split())}); hint: quote it to "
                              "keep it as text") from None
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = " ".join(str(err.problem or err.context or "syntax error").split())
        raise ConfigError(f"{where} is not valid YAML: {problem}{at}; hint: quote text that starts with one of "
                          "YAML's indicators (` @ % [ { & * ! | > ' \" #)") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{where} is not valid YAML: {' '.join(str(err).split())}") from None
    except RecursionError:
        raise ConfigError(f"{where} nests too deeply to be a config; hint: is it the right file?") from None
    finally:
        loader.dispose()


def _check_expanded_size(root: yaml.Node, where: str) -> None:
    """Count the values of ``root`` with every alias expanded, by memo (each node once), without
    expanding anything; refuse a cycle (``&a [*a]``) and a count above the bound."""
    size: dict[int, int] = {}
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    open_nodes: set[int] = set()
    while stack:
        node, children_done = stack.pop()
        if id(node) in size:
            continue
        children = _children(node)
        if children_done:
            open_nodes.discard(id(node))
            size[id(node)] = 1 + sum(size[id(c)] for c in children)
            if size[id(node)] > MAX_YAML_VALUES:
                raise ConfigError(f"{where}: its aliases (*name) expand to more than {MAX_YAML_VALUES} values (a "
                                  "YAML alias bomb?); hint: write the values out, or use fewer aliases")
            continue
        if id(node) in open_nodes:
            raise ConfigError(f"{where}: an alias refers to a value that contains it (a cycle); hint: remove it")
        open_nodes.add(id(node))
        stack.append((node, True))
        stack.extend((c, False) for c in children if id(c) not in size)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []
