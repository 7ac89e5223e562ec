"""Reading a spec's YAML from any file, safely: an answer within a second and bounded memory, or a `SpecError`.

Before anything is built from it the text is checked as events (no recursion): at most MAX_SPEC_BYTES, UTF-8 text,
nesting at most MAX_DEPTH deep, at most MAX_NODES nodes, no aliases (a spec never needs one, and an alias bomb
expands into billions of nodes); then keys are checked for duplicates, which YAML would let the last one win.
Only the safe loader ever runs: nothing in a spec executes.
"""

from __future__ import annotations

import yaml

from rollplex.errors import SpecError

MAX_SPEC_BYTES = 1 << 20
MAX_DEPTH = 32
MAX_NODES = 10_000
# libyaml's safe loader where PyYAML has it, ten times faster, once the events are checked (they stream through
# Python's, which stops at the first fault and lets no deep nesting reach libyaml's own limit and message)
LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def read_yaml(raw: bytes | str, file: str) -> tuple[object, yaml.Node | None]:
    """The parsed document and its composed node tree (for line numbers)."""
    text = _text(raw, file)
    _check_events(text, file)
    try:
        root = yaml.compose(text, Loader=LOADER)
        _check_duplicates(root, file, [])
        data = yaml.load(text, Loader=LOADER)
    except yaml.YAMLError as e:
        raise _syntax_error(e, file) from None
    return data, root


def _text(raw: bytes | str, file: str) -> str:
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogatepass")
    if len(raw) > MAX_SPEC_BYTES:
        raise SpecError("", f"the file is {len(raw):,} bytes; a spec is at most {MAX_SPEC_BYTES:,}", file=file)
    sample = raw[:4096]
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")) or max(_nul_share(sample[0::2]), _nul_share(sample[1::2])) > 0.9:
        raise SpecError(
            "", "the file is UTF-16 text", "save it as UTF-8", file=file
        )  # ASCII in UTF-16: every other byte 0
    if b"\x00" in raw:
        raise SpecError("", "not a text file (it holds NUL bytes)", "give a YAML spec", file=file)
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise SpecError("", f"not UTF-8 text (byte {e.start})", "save it as UTF-8", line=line, file=file) from None


def _nul_share(data: bytes) -> float:
    return data.count(0) / len(data) if data else 0.0


def _check_events(text: str, file: str) -> None:
    depth = nodes = 0
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            line = event.start_mark.line + 1 if event.start_mark else None
            if isinstance(event, yaml.AliasEvent):
                raise SpecError("", f"a YAML alias (*{event.anchor})", "write the value out: a spec takes no aliases",
                                line=line, file=file)  # fmt: skip
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                depth += 1
                if depth > MAX_DEPTH:
                    raise SpecError("", f"nested more than {MAX_DEPTH} deep", "a spec is a few levels deep",
                                    line=line, file=file)  # fmt: skip
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                depth -= 1
            if isinstance(event, (yaml.ScalarEvent, yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                nodes += 1
                if nodes > MAX_NODES:
                    raise SpecError("", f"more than {MAX_NODES:,} values", "a spec holds a few hundred",
                                    line=line, file=file)  # fmt: skip
    except yaml.YAMLError as e:
        raise _syntax_error(e, file) from None


def _check_duplicates(node: yaml.Node | None, file: str, path: list[str]) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key, value in node.value:
            name, line = str(key.value), key.start_mark.line + 1
            if name in seen:
                where = ".".join([*path, name])
                lines = f"lines {seen[name]} and {line}" if seen[name] != line else f"twice on line {line}"
                raise SpecError(where, f"duplicate key ({lines})", "keep one", line=line, file=file)
            seen[name] = line
            _check_duplicates(value, file, [*path, name])
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_duplicates(item, file, [*path, str(i)])


def _syntax_error(e: yaml.YAMLError, file: str) -> SpecError:
    mark = getattr(e, "problem_mark", None)
    line = mark.line + 1 if mark else None
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    return SpecError("", f"YAML syntax error: {problem}", "fix the YAML at that line", line=line, file=file)
