"""The two renderings of the span attribute model (attributes.py): the SDK's dict and OTLP
protobuf fields.

A group of the model is a function that writes its attributes through a `Writer`
(`w.double(key, v)`, `w.count(key, v)`, ...). `DictWriter` renders it as the attribute dict and
Event list the SDK's span processors take. `compile_fields` renders it as protobuf fields: it
compiles the group's own source once, at import, with every writer call replaced by the
statement that appends the attribute's field. Calling a writer method per attribute cost
~540 instructions each, ~40k a traced request (~45 attributes, counted with callgrind), more
than 1% of the whole proxy's instructions per request; compiled, the fields path costs what
the hand-written encoder it replaced did. tests/test_telemetry_encoding.py checks that both
renderings give the SDK encoder's bytes.
"""

from __future__ import annotations

import ast
import copy
import functools
import inspect
import logging
import textwrap
from collections.abc import Callable
from typing import Any, Protocol

from opentelemetry.sdk.trace import Event

from proxy.telemetry.wire import (
    ATTR,
    SMALL,
    AttrKey,
    attributes,
    events_bytes,
    ld,
    pack_d,
    pack_q,
    varint,
)

log = logging.getLogger("warmroute.telemetry")


class Writer(Protocol):
    """Where a group's attributes go; each method writes one attribute (or one group)."""

    def double(self, key: AttrKey, v: float) -> None:
        """A timing or ratio: always a double on the wire."""

    def count(self, key: AttrKey, v: int) -> None:
        """An int whose values repeat (token counts, chunks, status codes): cached per key."""

    def text(self, key: AttrKey, v: str) -> None:
        """A str whose values repeat (backends, models, error types): cached per key."""

    def ident(self, key: AttrKey, v: str) -> None:
        """A str unique to the request (ids): never cached."""

    def value(self, key: AttrKey, v: Any) -> None:
        """A value of any attribute type (request parameters, scores)."""

    def texts(self, key: AttrKey, v: tuple[Any, ...], cache: dict[Any, bytes]) -> None:
        """A tuple of strs whose values repeat, cached in `cache` by value."""

    def group(
        self,
        cache: dict[Any, bytes],
        cache_key: Any,
        build: Callable[..., dict[str, Any]],
        *args: Any,
    ) -> None:
        """The attributes build(*args) gives, cached whole by cache_key (None: not cached)."""

    def event(self, name: str, time_ns: int) -> None:
        """Start a span event: the attributes that follow are the event's."""


class DictWriter:
    """Renders attributes into a dict, as the SDK's ReadableSpan holds them (events: into
    `events`, as (name, attributes, time) of each)."""

    __slots__ = ("attrs", "events")

    def __init__(self, attrs: dict[str, Any]) -> None:
        self.attrs = attrs
        self.events: list[tuple[str, dict[str, Any], int]] = []

    def double(self, key: AttrKey, v: float) -> None:
        self.attrs[key.name] = float(v)

    def count(self, key: AttrKey, v: int) -> None:
        self.attrs[key.name] = v

    def text(self, key: AttrKey, v: str) -> None:
        self.attrs[key.name] = v

    def ident(self, key: AttrKey, v: str) -> None:
        self.attrs[key.name] = v

    def value(self, key: AttrKey, v: Any) -> None:
        self.attrs[key.name] = v

    def texts(self, key: AttrKey, v: tuple[Any, ...], cache: dict[Any, bytes]) -> None:
        self.attrs[key.name] = v

    def group(
        self,
        cache: dict[Any, bytes],
        cache_key: Any,
        build: Callable[..., dict[str, Any]],
        *args: Any,
    ) -> None:
        self.attrs.update(build(*args))

    def event(self, name: str, time_ns: int) -> None:
        self.attrs = {}
        self.events.append((name, self.attrs, time_ns))

    def event_objects(self) -> list[Event]:
        return [Event(name, attrs, t) for name, attrs, t in self.events]


# -- protobuf fields --------------------------------------------------------------------------
# Each writer call `w.<method>(K, V, C, B, *A)` becomes these statements, with the call's
# arguments in place of K, V, C (a cache), B (a builder) and A (its arguments); `_add` appends
# a field to the span's (or the current event's) list. Arguments other than names and
# constants are evaluated once, into a temporary, before the statement.
_TEMPLATES = {
    "double": "_add(K.fprefix + _wr_pack_d(V))",
    "count": "_add(K.ints.get(V) or K.any(V))",
    "text": "_add(K.strs.get(V) or K.any(V))",
    "ident": "_add(K.unique(V) if type(V) is str else K.any(V))",
    "value": "_add(K.any(V))",
    "texts": "_add(C.get(V) or _wr_texts(K, V, C))",
    "group": "_add(C.get(V) or _wr_group(C, V, B, *A))",
    # Event: time_unix_nano (fixed64), name, then its attributes (tag 3) as they follow.
    "event": "_event = [b'\\x09' + _wr_pack_q(V), _wr_event_name(K)]\n"
    "_events.append(_event)\n"
    "_add = _event.append",
}
_PARAMETERS = {
    "double": "KV",
    "count": "KV",
    "text": "KV",
    "ident": "KV",
    "value": "KV",
    "texts": "KVC",
    "group": "CVBA",
    "event": "KV",
}


def _texts(key: AttrKey, v: tuple[Any, ...], cache: dict[Any, bytes]) -> bytes:
    b = key.new(v)
    if all(type(x) is str for x in v):  # (1,) == (True,): only str tuples are cached
        _bounded(cache, v, b)
    return b


def _group(
    cache: dict[Any, bytes], cache_key: Any, build: Callable[..., dict[str, Any]], *args: Any
) -> bytes:
    b = attributes(ATTR, build(*args))
    if cache_key is not None:
        _bounded(cache, cache_key, b)
    return b


_EVENT_NAMES: dict[str, bytes] = {}


def _event_name(name: str) -> bytes:
    b = _EVENT_NAMES.get(name)
    if b is None:
        b = ld(b"\x12", name.encode())
        if len(_EVENT_NAMES) < 64:
            _EVENT_NAMES[name] = b
    return b


def _bounded(cache: dict[Any, bytes], key: Any, value: bytes) -> None:
    if len(cache) >= 1024:
        cache.clear()
    cache[key] = value


def _fallback_fields(group: Callable[..., None], *args: Any) -> bytes:
    """The group's fields through the dict: what protobuf cannot carry (a seed beyond int64)
    is left out and logged, as the SDK path's encoder does."""
    w = DictWriter({})
    group(w, *args)
    return attributes(ATTR, w.attrs)


def _fallback_events(group: Callable[..., None], *args: Any) -> bytes:
    w = DictWriter({})
    group(w, *args)
    return events_bytes(w.event_objects())


def _join_events(events: list[list[bytes]]) -> bytes:
    """Span.events fields, one per event's list of fields (ld() inlined: one event a span)."""
    out = []
    for fields in events:
        body = b"".join(fields)
        n = len(body)
        out.append(b"\x5a" + (SMALL[n] if n < 0x80 else varint(n)) + body)
    return b"".join(out)


_HELPERS = {
    "_wr_pack_d": pack_d,
    "_wr_pack_q": pack_q,
    "_wr_texts": _texts,
    "_wr_group": _group,
    "_wr_event_name": _event_name,
    "_wr_ld": ld,
    "_wr_fallback_fields": _fallback_fields,
    "_wr_fallback_events": _fallback_events,
    "_wr_join": _join_events,
}


class _Inline(ast.NodeTransformer):
    """Replaces the writer's calls with their templates, and `return` with the result."""

    def __init__(self, writer: str, result: str) -> None:
        self.writer = writer
        self.result = result
        self.temps = 0

    def visit_Expr(self, node: ast.Expr) -> Any:
        call = node.value
        if not (
            isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute)
            and isinstance(call.func.value, ast.Name)
            and call.func.value.id == self.writer
        ):
            return self.generic_visit(node)
        method = call.func.attr
        names = _PARAMETERS[method]
        args: list[ast.expr] = list(call.args)
        before: list[ast.stmt] = []
        bound: dict[str, Any] = {}
        for i, letter in enumerate(names):
            if letter == "A":
                bound["A"] = args[i:]
                break
            arg = args[i]
            if not isinstance(arg, ast.Name | ast.Constant):
                self.temps += 1
                temp = f"_wr_t{self.temps}"
                before.append(ast.Assign([ast.Name(temp, ast.Store())], arg, lineno=0))
                arg = ast.Name(temp, ast.Load())
            bound[letter] = arg
        event = bound.get("K")
        if method == "event" and isinstance(event, ast.Constant) and type(event.value) is str:
            bound["K"] = ast.Constant(_event_name(event.value))  # the field, built once
            statements = ast.parse(_TEMPLATES["event"].replace("_wr_event_name(K)", "K")).body
        else:
            statements = ast.parse(_TEMPLATES[method]).body
        out = [_Substitute(bound).visit(s) for s in before + statements]
        for s in out:
            ast.copy_location(s, node)
            ast.fix_missing_locations(s)
        return out

    def visit_Return(self, node: ast.Return) -> Any:
        if node.value is not None:
            raise TypeError("a group returns nothing: its writer collects the attributes")
        result = ast.parse(self.result).body[0]
        assert isinstance(result, ast.Return)
        return ast.copy_location(result, node)

    def visit_Name(self, node: ast.Name) -> Any:
        if node.id == self.writer:
            raise TypeError(f"{self.writer} may only be called as {self.writer}.<method>(...)")
        return node


class _Substitute(ast.NodeTransformer):
    def __init__(self, bound: dict[str, Any]) -> None:
        self.bound = bound

    def visit_Name(self, node: ast.Name) -> Any:
        value = self.bound.get(node.id)
        return node if value is None or node.id == "A" else copy.deepcopy(value)

    def visit_Call(self, node: ast.Call) -> Any:
        self.generic_visit(node)
        spread: list[ast.expr] = []
        for arg in node.args:
            if isinstance(arg, ast.Starred) and getattr(arg.value, "id", None) == "A":
                spread.extend(self.bound["A"])
            else:
                spread.append(arg)
        node.args = spread
        return node


def compile_fields(group: Callable[..., None], *, events: bool = False) -> Callable[..., bytes]:
    """group(w, *args) rendered as protobuf fields: a function of *args returning the
    Span.attributes fields (events=True: the Span.events fields) that the writer calls give."""
    try:
        source = textwrap.dedent(inspect.getsource(group))
    except (OSError, TypeError):  # no source to compile (e.g. shipped as .pyc only)
        log.warning("telemetry: %s has no source; spans are encoded through a dict", group)
        return functools.partial(_fallback_events if events else _fallback_fields, group)
    tree = ast.parse(source)
    fn = tree.body[0]
    assert isinstance(fn, ast.FunctionDef)
    ast.increment_lineno(tree, group.__code__.co_firstlineno - 1)
    writer, *params = fn.args.args
    result = "_wr_join(_events)" if events else "b''.join(_out)"
    body = _Inline(writer.arg, f"return {result}").visit(ast.Module(fn.body, []))
    names = ", ".join(p.arg for p in params)
    fallback = "_wr_fallback_events" if events else "_wr_fallback_fields"
    model = f"_wr_model_{fn.name}"
    shell = ast.parse(
        f"def {fn.name}_fields({names}):\n"
        "    _out = []\n"
        f"    {'_events = []' if events else 'pass'}\n"
        "    _add = _out.append\n"
        "    try:\n"
        "        pass\n"
        "    except (TypeError, ValueError, UnicodeError):\n"
        f"        return {fallback}({model}, {names})\n"
        f"    return {result}\n"
    )
    compiled = shell.body[0]
    assert isinstance(compiled, ast.FunctionDef)
    compiled.args.args = params
    for p in params:  # the shell is compiled without `from __future__ import annotations`
        p.annotation = None
    attempt = compiled.body[3]
    assert isinstance(attempt, ast.Try)
    attempt.body = body.body
    ast.fix_missing_locations(shell)
    code = compile(shell, inspect.getsourcefile(group) or "<attributes>", "exec")
    namespace: dict[str, Any] = {}
    # The compiled function runs in the group's module, so that the keys, caches and builders
    # it names are the module's own; the helpers join it there under _wr_ names.
    module_globals = group.__globals__
    module_globals.update(_HELPERS)
    module_globals[model] = group
    exec(code, module_globals, namespace)
    compiled_fn: Callable[..., bytes] = namespace[f"{fn.name}_fields"]
    compiled_fn.__doc__ = f"{fn.name}() as protobuf fields, compiled to:\n\n{ast.unparse(shell)}"
    return compiled_fn
