"""Structured annotations: a job's JSON Schema, its Arrow columns, and the model's JSON parsed into them.

No engine and no I/O here: the generate stage asks the engine; this module only
maps schemas to columns and parses text.

The job gives a JSON Schema for an object; each top-level property becomes one
typed output column (prefixed by `annotations.column_prefix`). vLLM generates
against the schema with structured outputs, so the text is valid JSON of that
shape unless `max_tokens` cut it off; every output is still parsed and
validated here, and one that fails keeps its raw text.

JSON Schema to Arrow:

    string (any format, enum or const of strings)  -> string
    integer                                         -> int64
    number                                          -> float64
    boolean                                         -> bool
    array with `items`                              -> list<item>
    object with `properties`                        -> struct<property...>
    ["T", "null"], anyOf/oneOf of T and null        -> T (nullable)
    {"$ref": "#/$defs/X"}                           -> X's type

Anything else (an object without properties, an array without items, a union
of different types) has no single Arrow type and is refused with the path of
the offending key, before any model loads.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from jsonschema.validators import validator_for

_SCALARS = {"string": pa.string(), "integer": pa.int64(), "number": pa.float64(), "boolean": pa.bool_()}


class SchemaMappingError(ValueError):
    """The JSON Schema is invalid or has no Arrow equivalent; `path` names the key."""

    def __init__(self, path: str, message: str):
        super().__init__(f"{path}: {message}" if path else message)
        self.path = path


def _join(path: str, *keys: Any) -> str:
    return ".".join([path, *map(str, keys)]) if path else ".".join(map(str, keys))


def _resolve(node: dict[str, Any], root: dict[str, Any], path: str, seen: tuple[str, ...]) -> dict[str, Any]:
    ref = node.get("$ref")
    if ref is None:
        return node
    if not isinstance(ref, str) or not ref.startswith("#/"):
        raise SchemaMappingError(path, f"only local references (#/...) are supported, got {ref!r}")
    if ref in seen:
        raise SchemaMappingError(path, f"recursive reference {ref} has no fixed Arrow type")
    target: Any = root
    for key in ref[2:].split("/"):
        if not isinstance(target, dict) or key not in target:
            raise SchemaMappingError(path, f"reference {ref} points nowhere")
        target = target[key]
    return _resolve(target, root, path, (*seen, ref))


def _literal_type(values: list[Any], path: str) -> pa.DataType:
    kinds = {type(v) for v in values if v is not None}
    if kinds == {str}:
        return pa.string()
    if kinds == {int}:
        return pa.int64()
    if kinds <= {int, float} and kinds:
        return pa.float64()
    if kinds == {bool}:
        return pa.bool_()
    raise SchemaMappingError(path, f"enum/const values {values!r} do not share one type")


def arrow_type(node: Any, root: dict[str, Any] | None = None, path: str = "",
               seen: tuple[str, ...] = ()) -> pa.DataType:
    """The Arrow type for a JSON Schema node; SchemaMappingError naming the path if none fits."""
    if not isinstance(node, dict):
        raise SchemaMappingError(path, f"expected a schema object, got {node!r}")
    root = node if root is None else root
    node = _resolve(node, root, path, seen)
    if "$ref" in node:
        seen = (*seen, node["$ref"])
    for key in ("anyOf", "oneOf"):
        if key in node:
            options = [o for o in node[key] if not (isinstance(o, dict) and o.get("type") == "null")]
            types = {arrow_type(o, root, _join(path, key, i), seen) for i, o in enumerate(options)}
            if len(types) != 1:
                raise SchemaMappingError(path, f"{key} mixes types ({', '.join(map(str, types))}); "
                                               f"an Arrow column holds one")
            return types.pop()
    kind = node.get("type")
    if isinstance(kind, list):
        kinds = [k for k in kind if k != "null"]
        if len(kinds) != 1:
            raise SchemaMappingError(path, f"type {kind!r} mixes types; an Arrow column holds one")
        kind = kinds[0]
    if kind is None:
        if "enum" in node:
            return _literal_type(list(node["enum"]), path)
        if "const" in node:
            return _literal_type([node["const"]], path)
        raise SchemaMappingError(path, "has no type; say which (string, integer, number, boolean, array, object)")
    if kind in _SCALARS:
        return _SCALARS[kind]
    if kind == "array":
        if not isinstance(node.get("items"), dict):
            raise SchemaMappingError(path, "an array needs `items` (one schema) to map to an Arrow list")
        return pa.list_(arrow_type(node["items"], root, _join(path, "items"), seen))
    if kind == "object":
        props = node.get("properties")
        if not isinstance(props, dict) or not props:
            raise SchemaMappingError(path, "an object needs `properties` to map to an Arrow struct; "
                                           "free-form objects have no fixed columns")
        return pa.struct([pa.field(name, arrow_type(p, root, _join(path, "properties", name), seen))
                          for name, p in props.items()])
    raise SchemaMappingError(path, f"unknown type {kind!r}")


def check_schema(schema: Any) -> list[pa.Field]:
    """Check a job's annotation schema; return one Arrow field per top-level property."""
    if not isinstance(schema, dict):
        raise SchemaMappingError("", f"expected a JSON Schema object, got {type(schema).__name__}")
    try:
        validator_for(schema, default=Draft202012Validator).check_schema(schema)
    except SchemaError as e:
        where = ".".join(map(str, e.path)) or ".".join(map(str, e.schema_path))
        raise SchemaMappingError(where, f"not valid JSON Schema: {e.message}") from None
    if schema.get("type") != "object":
        raise SchemaMappingError("type", "the annotation schema must describe an object (type: object); "
                                         "its properties become the output columns")
    struct = arrow_type(schema)
    return [struct.field(i) for i in range(struct.num_fields)]


class AnnotationParser:
    """Model text -> a validated dict, or the reason it is not one."""

    def __init__(self, schema: dict[str, Any]):
        self.fields = check_schema(schema)
        self.validator = validator_for(schema, default=Draft202012Validator)(schema)

    def parse(self, text: str | None) -> tuple[dict[str, Any] | None, str | None]:
        if text is None:
            return None, "no output"
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            return None, f"output is not valid JSON ({e.msg} at character {e.pos})"
        error = next(iter(sorted(self.validator.iter_errors(value), key=lambda e: list(e.path))), None)
        if error is not None:
            where = ".".join(map(str, error.path)) or "the top level"
            return None, f"output does not match the schema at {where}: {error.message}"
        return value, None

    def columns(self, values: list[dict[str, Any] | None], prefix: str = "") -> dict[str, pa.Array]:
        """One typed array per schema property; a row without a value gets null."""
        return {
            prefix + f.name: pa.array([None if v is None else v.get(f.name) for v in values], f.type)
            for f in self.fields
        }

