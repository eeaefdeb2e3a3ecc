"""A state's structure apart from its tensors: what a memory checkpoint stores as JSON
beside the tensors' raw bytes, so that a save neither pickles nor copies more than the
tensors themselves.

``encode(state)`` walks ``state`` (dicts, ``OrderedDict`` with a module's ``_metadata``,
lists, tuples) and returns the tree as JSON-ready nodes, the tensors in the order met, and
the leaves that JSON cannot hold (a ``torch.Size``, a dtype, anything else), which the
caller stores with ``torch.save`` and loads with ``weights_only``, as a whole state would
be. ``decode`` puts the three back together. A node is a one-key dict:

    {"t": i}                 the i-th tensor
    {"v": x}                 a JSON scalar: None, a bool, an int, a str, a finite float
    {"f": "inf"}             a float JSON has no number for: "inf", "-inf", "nan"
    {"d": [[k, v], ...]}     a dict, keys and values as nodes; "o": 1 for an OrderedDict,
                             "m": the node of its ``_metadata`` (a module's state_dict)
    {"l": [...]}, {"u": [...]}   a list, a tuple
    {"x": i}                 the i-th other leaf
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

Node = dict[str, Any]


def encode(state: Any) -> tuple[Node, list[Any], list[Any]]:
    """The tree of ``state``, its tensors and its other leaves (see the module)."""
    import torch

    tensors: list[Any] = []
    others: list[Any] = []

    def node(value: Any) -> Node:
        if isinstance(value, torch.Tensor):
            tensors.append(value)
            return {"t": len(tensors) - 1}
        if value is None or type(value) in (bool, int, str):  # subclasses: other leaves
            return {"v": value}
        if type(value) is float:
            return {"v": value} if math.isfinite(value) else {"f": repr(value)}
        if type(value) in (dict, OrderedDict):
            out: Node = {"d": [[node(k), node(v)] for k, v in value.items()]}
            if type(value) is OrderedDict:
                out["o"] = 1
            metadata = getattr(value, "_metadata", None)
            if metadata is not None:
                out["m"] = node(metadata)
            return out
        if type(value) is list:
            return {"l": [node(v) for v in value]}
        if type(value) is tuple:
            return {"u": [node(v) for v in value]}
        others.append(value)
        return {"x": len(others) - 1}

    return node(state), tensors, others


def decode(tree: Node, tensors: list[Any], others: list[Any]) -> Any:
    """The state ``encode`` took apart."""

    def value(node: Node) -> Any:
        if "t" in node:
            return tensors[node["t"]]
        if "v" in node:
            return node["v"]
        if "f" in node:
            return float(node["f"])
        if "d" in node:
            items = [(value(k), value(v)) for k, v in node["d"]]
            result: dict[Any, Any] = OrderedDict(items) if node.get("o") else dict(items)
            if "m" in node:
                result._metadata = value(node["m"])  # type: ignore[attr-defined]
            return result
        if "l" in node:
            return [value(v) for v in node["l"]]
        if "u" in node:
            return tuple(value(v) for v in node["u"])
        if "x" in node:
            return others[node["x"]]
        raise ValueError(f"not a node of a state's tree: {sorted(node)}")

    return value(tree)


def paths(tree: Node) -> list[str]:
    """The dotted path of each tensor in ``tree``, in the tensors' order (a dict's key as
    it reads, a list's or tuple's index): names for what the tensors are."""
    found: dict[int, str] = {}

    def walk(node: Node, prefix: str) -> None:
        if "t" in node:
            found[node["t"]] = prefix
        elif "d" in node:
            for key, child in node["d"]:
                walk(child, _join(prefix, str(key.get("v", "?"))))
        else:
            for index, child in enumerate(node.get("l") or node.get("u") or []):
                walk(child, _join(prefix, str(index)))

    walk(tree, "")
    return [found[i] for i in sorted(found)]


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key
