"""YAML that refuses a key given twice in one mapping: the one parser of config files and of the
values of `--set` (PyYAML alone keeps the last value silently, so a run would do what the user
did not read).

    data = parse_yaml("iterations: 1\\niterations: 2\\n")   # raises DuplicateKeyError
    error.key, error.first_line, error.line                 # 'iterations', 1, 2 (1-based)

Merge keys (`<<: *defaults`) still override what they merge in: only keys written in the mapping
itself are compared.
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.constructor import ConstructorError

MERGE_TAG = "tag:yaml.org,2002:merge"


class DuplicateKeyError(ConstructorError):
    """A mapping names `key` twice: first on `first_line`, again on `line` (1-based lines)."""

    def __init__(self, key: Any, first: yaml.Node, again: yaml.Node) -> None:
        self.key, self.first_line, self.line = key, first.start_mark.line + 1, again.start_mark.line + 1
        super().__init__(problem=f"key {key!r} given twice (lines {self.first_line} and {self.line}); "
                                 "remove one of them", problem_mark=again.start_mark)


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader whose mappings refuse a key written twice."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, yaml.Node] = {}
            for key_node, _ in node.value:
                if key_node.tag == MERGE_TAG:
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node)
                except TypeError:  # an unhashable key: SafeLoader's own error says so below
                    continue
                if first is not key_node:
                    raise DuplicateKeyError(key, first, key_node)
        return super().construct_mapping(node, deep=deep)


def parse_yaml(text: str) -> Any:
    """The data of YAML `text` (PyYAML's safe subset); a yaml.YAMLError for bad YAML, a
    DuplicateKeyError (one of them) for a key given twice in one mapping."""
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)
