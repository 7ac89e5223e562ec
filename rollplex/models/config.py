"""Qwen2.5-VL model configuration: frozen dataclasses read from HF `config.json` files.

Pure Python (no torch), so the compiler can read model shapes without importing a deep-learning stack.
Accepts both layouts of the public files: language-model keys at the top level (the released checkpoints)
or under `text_config` (files written by newer transformers). Shipped configs live in `rollplex/configs/`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

MLP_ALIGN = 64  # the vision MLP's width is stored rounded up to a multiple of this (`rollplex.models.vision`)

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


@dataclass(frozen=True, slots=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, int, int]
    tie_word_embeddings: bool
    max_position_embeddings: int

    def __post_init__(self) -> None:
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "max_position_embeddings"):  # fmt: skip
            _positive_int(key, getattr(self, key))
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of {self.num_attention_heads} heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"{self.num_attention_heads} attention heads are not a multiple of {self.num_key_value_heads} kv heads"
            )
        if 2 * sum(self.mrope_section) != self.head_dim:
            raise ValueError(f"mrope_section {self.mrope_section} must sum to head_dim/2 = {self.head_dim // 2}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_query_groups(self) -> int:
        return self.num_key_value_heads

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads


@dataclass(frozen=True, slots=True)
class VisionConfig:
    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    window_size: int
    fullatt_block_indexes: tuple[int, ...]
    in_channels: int
    tokens_per_second: float

    def __post_init__(self) -> None:
        for key in ("depth", "hidden_size", "num_heads", "intermediate_size", "out_hidden_size", "patch_size",
                    "temporal_patch_size", "spatial_merge_size", "window_size", "in_channels"):  # fmt: skip
            _positive_int(f"vision_config.{key}", getattr(self, key))
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"vision_config.hidden_size {self.hidden_size} is not a multiple of {self.num_heads} heads"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merge_unit(self) -> int:
        """Patches merged into one visual token."""
        return self.spatial_merge_size**2

    @property
    def stored_intermediate_size(self) -> int:
        """The MLP width as the runtime stores it: rounded up to a multiple of `MLP_ALIGN` (`VisionMLP`)."""
        return -(-self.intermediate_size // MLP_ALIGN) * MLP_ALIGN


@dataclass(frozen=True, slots=True)
class TokenIds:
    eos: int  # <|im_end|>: ends every turn of the chat template
    vision_start: int
    vision_end: int
    image: int
    video: int
    stops: tuple[int, ...] = ()  # the ids that end a sampled response beside `eos` (Qwen's <|endoftext|>)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """What ends a sampled response: `eos`, then the config's and its generation config's other end ids."""
        return (self.eos, *self.stops)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    name: str
    text: TextConfig
    vision: VisionConfig
    tokens: TokenIds

    @staticmethod
    def from_dict(d: dict) -> ModelConfig:
        """The inverse of `dataclasses.asdict` through JSON (lists back to tuples)."""
        text = {**d["text"], "mrope_section": tuple(d["text"]["mrope_section"])}
        vision = {**d["vision"], "fullatt_block_indexes": tuple(d["vision"]["fullatt_block_indexes"])}
        tokens = {**d["tokens"], "stops": tuple(d["tokens"].get("stops", ()))}
        return ModelConfig(d["name"], TextConfig(**text), VisionConfig(**vision), TokenIds(**tokens))


def _text_from_hf(d: dict) -> TextConfig:
    rope = d.get("rope_scaling") or d.get("rope_parameters") or {}
    section = rope.get("mrope_section", [16, 24, 24])
    theta = d.get("rope_theta", rope.get("rope_theta", 1_000_000.0))
    return TextConfig(
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=d["num_attention_heads"],
        num_key_value_heads=d.get("num_key_value_heads", d["num_attention_heads"]),
        rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        mrope_section=tuple(section),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        max_position_embeddings=d.get("max_position_embeddings", 128000),
    )


def _vision_from_hf(d: dict, text_hidden: int) -> VisionConfig:
    return VisionConfig(
        depth=d["depth"],
        hidden_size=d.get("hidden_size", d.get("embed_dim")),
        num_heads=d["num_heads"],
        intermediate_size=d["intermediate_size"],
        out_hidden_size=d.get("out_hidden_size", text_hidden),
        patch_size=d.get("patch_size", 14),
        temporal_patch_size=d.get("temporal_patch_size", 2),
        spatial_merge_size=d.get("spatial_merge_size", 2),
        window_size=d.get("window_size", 112),
        fullatt_block_indexes=tuple(d.get("fullatt_block_indexes", ())),
        in_channels=d.get("in_chans", d.get("in_channels", 3)),
        tokens_per_second=float(d.get("tokens_per_second", 2)),
    )


def config_from_hf(d: dict, name: str, generation: dict | None = None) -> ModelConfig:
    """Builds a ModelConfig from the dict of an HF Qwen2.5-VL `config.json` (either layout); a response stops at
    any of its `eos_token_id`s and of its `generation_config.json`'s (`generation`), as transformers and vLLM
    stop."""
    text_d = {**d, **d.get("text_config", {})}
    text = _text_from_hf(text_d)
    generated = (generation or {}).get("eos_token_id")
    ends = [*_ids(text_d.get("eos_token_id", 151645)), *(_ids(generated) if generated is not None else [])]
    tokens = TokenIds(
        eos=ends[0],
        vision_start=d.get("vision_start_token_id", 151652),
        vision_end=d.get("vision_end_token_id", 151653),
        image=d.get("image_token_id", 151655),
        video=d.get("video_token_id", 151656),
        stops=tuple(x for x in dict.fromkeys(ends) if x != ends[0]),
    )
    return ModelConfig(
        name=name, text=text, vision=_vision_from_hf(d["vision_config"], text.hidden_size), tokens=tokens
    )


def _ids(value: int | list[int]) -> list[int]:
    ids = value if isinstance(value, list) else [value]
    if not ids or not all(isinstance(x, int) and not isinstance(x, bool) for x in ids):
        raise ValueError(f"eos_token_id must be a token id or a list of them, not {value!r}")
    return ids


def shipped_model_names() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def resolve_config_path(name_or_path: str, base: Path | None = None) -> Path:
    """A shipped name (`qwen2_5_vl_7b`), a `config.json`, or a checkpoint directory holding one."""
    path = Path(name_or_path).expanduser()
    if not path.is_absolute() and base is not None:
        path = base / path
    try:
        if (CONFIG_DIR / f"{name_or_path}.json").is_file():
            return CONFIG_DIR / f"{name_or_path}.json"
        if path.is_dir():
            path = path / "config.json"
        found = path.is_file()
    except OSError as e:  # a name too long for a path, ...
        raise ValueError(f"model '{name_or_path[:40]}...' is not a shipped config or a path ({e.strerror})") from None
    if not found:
        names = ", ".join(shipped_model_names())
        raise FileNotFoundError(f"model '{name_or_path}' is neither a shipped config ({names}) nor a config.json path")
    return path


def load_model_config(name_or_path: str, base: Path | None = None) -> ModelConfig:
    """The config of a shipped name or an HF `config.json`; any flaw in the file is a ValueError naming it."""
    path = resolve_config_path(name_or_path, base)
    name = path.stem if path.parent == CONFIG_DIR else str(path)
    try:
        d = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a JSON config ({e})") from None
    if not isinstance(d, dict) or not isinstance(d.get("vision_config", {}), dict):
        raise ValueError(f"{path}: not a Qwen2.5-VL config (a JSON object with a vision_config object)")
    generation = path.parent / "generation_config.json"  # a checkpoint's: the ends its sampling stops at
    try:
        extra = json.loads(generation.read_bytes()) if path.parent != CONFIG_DIR and generation.is_file() else None
        return config_from_hf(d, name, extra if isinstance(extra, dict) else None)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{generation}: not a JSON config ({e})") from None
    except KeyError as e:
        raise ValueError(f"{path}: lacks {e.args[0]!r}") from None
    except (TypeError, ValueError, ZeroDivisionError, AttributeError) as e:
        raise ValueError(f"{path}: {e}") from None


def _positive_int(key: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key} must be a positive integer, not {value!r}")
