"""Checks a structured-output spec must pass before anything compiles it.

A grammar compiler's cost is not linear in its input: xgrammar took 0.1 s for a 4,000-entry
``choice`` and 5 s for 20,000 (on a 2-core Xeon), 18 s for a 4,000-long chain of ``$ref``
(and a 4,000-long chain of nested objects crashed it: a native stack overflow, signal 11).
So a spec is measured first, in linear time, and refused with a 400 that says which limit
it broke and how to change it::

    spec text longer than max_spec_chars ............ "structured_outputs.json is 2,000,000 characters ..."
    choice with more than max_choices entries ....... "structured_outputs.choice has 20,000 entries ..."
    JSON schema nested deeper than max_schema_depth . "... nested 4,001 levels deep (via $ref) ..."
      (each tool's schema in a structural tag, too)

Nesting counts both the document's own levels and the levels a ``$ref`` leads to: a chain
``d0 -> d1 -> ... -> d4000`` is 4,000 deep even though each definition is flat. A ``$ref``
that leads back to a definition already on the path (a recursive schema: a tree, a linked
list) is fine: the compiler keeps it as one recursive rule, so it adds no depth.

These limits make the known crashes unreachable; the compile workers (``compile_workers.py``)
catch what no limit foresaw.
"""

from __future__ import annotations

import json

from microvllm.config.structured_outputs import StructuredOutputsConfig


def check_spec(structured, spec: str, limits: StructuredOutputsConfig) -> None:
    """Raise ``ValueError`` naming ``structured_outputs.<kind>`` if ``structured`` (a
    ``StructuredOutputsParams``; ``spec`` is its text) breaks one of ``limits``'s."""
    kind, field = structured.kind, f"structured_outputs.{structured.kind}"
    if len(spec) > limits.structured_outputs_max_spec_chars:
        raise ValueError(f"{field} is {len(spec):,} characters long, more than this server compiles "
                         f"({limits.structured_outputs_max_spec_chars:,}, --structured-outputs-max-spec-chars): "
                         "shorten it")
    if kind == "choice":
        if len(structured.choice) > limits.structured_outputs_max_choices:
            raise ValueError(f"{field} has {len(structured.choice):,} entries, more than this server compiles "
                             f"({limits.structured_outputs_max_choices:,}, --structured-outputs-max-choices): "
                             "send fewer, or a regex or grammar that describes them")
    elif kind in ("json", "structural_tag"):
        max_depth = limits.structured_outputs_max_schema_depth
        value = getattr(structured, kind)
        value = json.loads(spec) if isinstance(value, str) else value
        # A structural tag (strict tools) holds one JSON schema per tool: each is measured.
        for where, schema in ([("", value)] if kind == "json" else _tag_schemas(value)):
            if schema_depth(schema, stop_at=max_depth + 1) > max_depth:
                raise ValueError(f"{field}{where} is nested more than {max_depth} levels deep "
                                 f"(counting what each $ref leads to; --structured-outputs-max-schema-depth): "
                                 "flatten the schema")


def _tag_schemas(tag) -> list[tuple[str, object]]:
    """Every ``{"type": "json_schema", "json_schema": ...}`` in a structural tag, with where
    it is; found with an explicit stack (a tag is a client's document too)."""
    found, stack = [], [(tag, "")]
    while stack:
        node, where = stack.pop()
        if isinstance(node, dict):
            if node.get("type") == "json_schema" and "json_schema" in node:
                found.append((f"{where}.json_schema", node["json_schema"]))
                continue
            stack.extend((child, f"{where}.{key}") for key, child in node.items() if isinstance(child, (dict, list)))
        elif isinstance(node, list):
            stack.extend((child, f"{where}[{i}]") for i, child in enumerate(node) if isinstance(child, (dict, list)))
    return found


def schema_depth(schema, stop_at: int) -> int:
    """How deep ``schema`` nests, following local ``$ref``s ("#/$defs/x", "#/definitions/x").

    A depth-first walk with an explicit stack (a deep document must not overflow Python's
    own stack). What a ``$ref`` leads to is measured once and remembered (``memo``), so a
    definition used a thousand times costs one walk; a ``$ref`` back to a definition still
    being measured (recursion) adds nothing. Stops as soon as the depth reaches ``stop_at``."""
    memo: dict[str, int] = {}     # ref -> how deep its target nests
    on_path: set[str] = set()     # refs whose target is being measured
    # A frame: [node, its children as (child, ref it is reached through or None), next child,
    #           deepest child so far, ref this node was reached through]
    stack = [[schema, _children(schema, schema), 0, 0, None]]
    while True:
        frame = stack[-1]
        node, kids, i, deepest_child, ref = frame
        if len(stack) + deepest_child >= stop_at:
            return len(stack) + deepest_child
        if i < len(kids):
            frame[2] += 1
            child, via = kids[i]
            if via is not None:
                if via in memo:
                    frame[3] = max(deepest_child, memo[via])
                    continue
                if via in on_path:
                    continue
                on_path.add(via)
            stack.append([child, _children(child, schema), 0, 0, via])
            continue
        stack.pop()
        height = deepest_child + 1
        if ref is not None:
            memo[ref] = height
            on_path.discard(ref)
        if not stack:
            return height
        stack[-1][3] = max(stack[-1][3], height)


def _children(node, root) -> list:
    """(child, the $ref it is reached through or None) for each container below ``node``."""
    if isinstance(node, dict):
        kids = [(child, None) for key, child in node.items() if key != "$ref" and isinstance(child, (dict, list))]
        ref = node.get("$ref")
        if isinstance(ref, str) and (target := _resolve(root, ref)) is not None:
            kids.append((target, ref))
        return kids
    if isinstance(node, list):
        return [(child, None) for child in node if isinstance(child, (dict, list))]
    return []


def _resolve(schema, ref: str):
    """The node a local JSON pointer ("#/$defs/a") names, or None (remote refs are the
    compiler's business)."""
    if not ref.startswith("#"):
        return None
    node = schema
    for part in ref[1:].split("/"):
        if not part:
            continue
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
