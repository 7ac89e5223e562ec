"""Reading a spec file: YAML -> validated `Spec` + the model's config, every failure a one-line `SpecError`.

Line numbers come from YAML's composed node tree, walked along the failing key path.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel, ValidationError

from rollplex.errors import SpecError
from rollplex.graph.spec import Spec
from rollplex.graph.yamlread import MAX_SPEC_BYTES, read_yaml
from rollplex.models.config import ModelConfig, load_model_config


@dataclass(frozen=True)
class LoadedSpec:
    spec: Spec
    model: ModelConfig
    path: Path
    yaml_root: yaml.Node | None = None

    def locate(self, e: SpecError) -> SpecError:
        """The same error with this spec's file name and the YAML line of its key path."""
        return e.located(str(self.path), _line(self.yaml_root, e.where.split(".")))


def load_spec(path: str | Path) -> LoadedSpec:
    path = Path(path)
    try:
        if path.is_dir():
            raise SpecError("", "is a directory, not a spec file", "give the YAML file", file=str(path))
        if path.stat().st_size > MAX_SPEC_BYTES:
            raise SpecError("", f"the file is {path.stat().st_size:,} bytes; a spec is at most {MAX_SPEC_BYTES:,}",
                            file=str(path))  # fmt: skip
        raw = path.read_bytes()
    except OSError as e:
        raise SpecError("", f"cannot read spec: {e.strerror}", file=str(path)) from None
    if path.suffix == ".json":  # JSON is YAML but for tabs between its tokens (inside its strings they are escaped)
        raw = raw.replace(b"\t", b" ")
    return parse_spec(raw, file=str(path), base=path.parent)


def parse_spec(text: str | bytes, file: str = "spec", base: Path | None = None) -> LoadedSpec:
    data, root = read_yaml(text, file)
    if not isinstance(data, dict):
        raise SpecError("", "the spec must be a YAML mapping of sections (model, cluster, ...)", file=file)
    if "rollplex_plan_version" in data:
        raise SpecError("", "is a plan written by `rollplex compile`, not a spec", "`rollplex run` takes a plan; "
                        "compile its spec", file=file)  # fmt: skip
    try:
        spec = Spec.model_validate(data)
    except ValidationError as e:
        raise _first_error(e, root, file) from None
    try:
        model = load_model_config(spec.model.name, base)
        check_model_fits_parallel(spec, model)
        check_layers_kept(spec, model)
        check_context(spec, model)
    except SpecError as e:
        raise e.located(file, _line(root, e.where.split("."))) from None
    except (OSError, ValueError) as e:
        raise SpecError("model", str(e), line=_line(root, ["model"]), file=file) from None
    return LoadedSpec(spec, model, Path(file), root)


def check_model_fits_parallel(spec: Spec, model: ModelConfig) -> None:
    """TP degrees must split attention heads evenly and KV heads evenly (or replicate them whole)."""
    t = model.text
    for key in ("train_tp", "rollout_tp"):
        tp = getattr(spec.parallel, key)
        ok_kv = t.num_key_value_heads % tp == 0 or tp % t.num_key_value_heads == 0
        if t.num_attention_heads % tp or not ok_kv:
            good = [d for d in range(1, t.num_attention_heads + 1) if _tp_ok(d, t)]
            raise SpecError(
                f"parallel.{key}",
                f"{tp} does not divide the {t.num_attention_heads} attention heads / "
                f"{t.num_key_value_heads} KV heads of {model.name}",
                f"use one of {', '.join(map(str, good))}",
            )


def check_layers_kept(spec: Spec, model: ModelConfig) -> None:
    """`memory.layers_kept`, where a number, names at most the decoder's layers."""
    kept, layers = spec.memory.layers_kept, model.text.num_hidden_layers
    if kept != "auto" and kept > layers:
        raise SpecError("memory.layers_kept", f"{kept} is more than {model.name}'s {layers} decoder layers",
                        f"use at most {layers}, or auto")  # fmt: skip


def check_context(spec: Spec, model: ModelConfig) -> None:
    """A prompt's text and its response, at their budgets, fit the model's context (`max_position_embeddings`).
    Visual tokens are left out: under mrope a video advances the positions by its grid's largest side, not its
    token count, so only the text is sure to take one position a token."""
    w, most = spec.workload, model.text.max_position_embeddings
    text = w.prompt_tokens - w.num_visual_tokens
    if text + w.response_tokens > most:
        raise SpecError(
            "workload.prompt_tokens",
            f"{text} prompt text + {w.response_tokens} response tokens exceed {model.name}'s context of {most}",
            "lower prompt_tokens or response_tokens",
        )


def _tp_ok(tp: int, t) -> bool:
    kv = t.num_key_value_heads
    return t.num_attention_heads % tp == 0 and (kv % tp == 0 or tp % kv == 0)


def _first_error(e: ValidationError, root: yaml.Node | None, file: str) -> SpecError:
    """The error to report: an unknown key before anything else (a misspelt key also shows as the key it
    shadows, missing), then the first; a rejected value echoed at most ECHO characters long."""
    errors = e.errors()
    err = next((x for x in errors if x["type"] == "extra_forbidden"), errors[0])
    loc = [str(p) for p in err["loc"] if not str(p).startswith("function-")]
    msg = err["msg"].removeprefix("Value error, ")
    first_word = msg.split(" ", 1)[0]
    if err["type"] == "value_error" and _is_key(first_word, loc):
        loc = loc + first_word.split(".")
    where = ".".join(loc)
    if err["type"] == "extra_forbidden":
        return SpecError(where, "unknown key", _suggest(e, loc), line=_line(root, loc), file=file)
    if err["type"] == "missing":
        return SpecError(where, "required key is missing", f"add `{loc[-1]}:`", line=_line(root, loc[:-1]), file=file)
    got = f" (got {_echo(err['input'])})" if err["type"] != "value_error" and not isinstance(err["input"], dict) else ""
    return SpecError(where, msg + got, line=_line(root, loc), file=file)


ECHO = 60


def _echo(value: object) -> str:
    text = repr(value)
    return text if len(text) <= ECHO else text[: ECHO - 3] + "..."


def _is_key(word: str, loc: list[str]) -> bool:
    """Whether a validator's message starts with a key of the model at `loc` (`train_tp 3 ...`), which then
    locates it."""
    model = _model_at(loc)
    return model is not None and word.split(".")[0] in {f.alias or n for n, f in model.model_fields.items()}


def _model_at(loc: list[str]) -> type[BaseModel] | None:
    model: type[BaseModel] | None = Spec
    for part in loc:
        if model is None or part.isdigit():
            continue
        model = _field_model(model, part)
    return model


def _suggest(e: ValidationError, loc: list[str]) -> str:
    model = _model_at(loc[:-1])
    if model is None:
        return "remove it"
    names = [f.alias or n for n, f in model.model_fields.items()]
    close = difflib.get_close_matches(loc[-1], names, n=1)
    hint = f"did you mean `{close[0]}`? " if close else ""
    return f"{hint}allowed here: {', '.join(names)}"


def _field_model(model: type[BaseModel], name: str) -> type[BaseModel] | None:
    field = model.model_fields.get(name)
    if field is None:
        return None
    for candidate in (field.annotation, *getattr(field.annotation, "__args__", ())):
        for inner in (candidate, *getattr(candidate, "__args__", ())):
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                return inner
    return None


def _line(root: yaml.Node | None, loc: list[str]) -> int | None:
    """1-based line of the deepest node reachable along `loc` (a key path)."""
    node, line = root, None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            match = next(((k, v) for k, v in node.value if k.value == part), None)
            if match is None:
                break
            line, node = match[0].start_mark.line + 1, match[1]
        elif isinstance(node, yaml.SequenceNode) and part.isdigit() and int(part) < len(node.value):
            node = node.value[int(part)]
            line = node.start_mark.line + 1
        else:
            break
    return line
