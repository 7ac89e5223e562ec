"""Video-R1-style datasets: a JSON list or a JSONL file of QA rows over real video (or image) files.

The Video-R1 format (Video-R1-260k.json and friends), one row:

    {"problem_id": 2, "problem": "What appears on the screen ...?", "data_type": "video",
     "problem_type": "multiple choice", "options": ["A. ...", "B. ...", "C. ...", "D. ..."],
     "solution": "<answer>A</answer>", "path": "./LLaVA-Video-178K/....mp4", "data_source": "..."}

Accepted aliases: media `path` | `video` | `videos` | `image` | `images` (a string or a one-item list);
question `problem` | `question`; answer `solution` | `answer` (an `<answer>` wrapper is removed). Problem
types: `multiple choice` -> choice, `numerical` -> number, `regression` -> regression, `OCR` -> ocr,
`free-form` and `open-ended` -> free_form; without one, options mean choice and none mean exact. `options`
is a list; option i is shown (and scored) as letter i, A, B, C, ... (`rewards.option_letter`), keeping its
own label when that label is the same letter ('A. red', '(A) red', 'A) red') and given one otherwise ('red'
-> 'A. red'). Media paths are relative to `media_root` (default: the data file's folder). Rows are read and
checked when the dataset is built (a malformed row or a missing file is a ValueError naming the file and
line, a file without rows a ValueError naming the file); frames are decoded when an example is asked for.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rollplex.data.chat import DEFAULT_SYSTEM, R1_INSTRUCTION, build_prompt
from rollplex.data.decode import FrameSampling, decode_video
from rollplex.data.rewards import choice_letter, option_letter
from rollplex.data.tokenizer import Tokenizer
from rollplex.data.types import AnswerKind, Example
from rollplex.data.video import VisionSpec, preprocess_image, preprocess_video
from rollplex.models.inputs import Visual

PROBLEM_TYPES = {
    "multiple choice": AnswerKind.CHOICE,
    "numerical": AnswerKind.NUMBER,
    "regression": AnswerKind.REGRESSION,
    "free-form": AnswerKind.FREE_FORM,
    "open-ended": AnswerKind.FREE_FORM,
    "ocr": AnswerKind.OCR,
}
ANSWER_HINTS = {
    AnswerKind.CHOICE: "Give only the option letter.",
    AnswerKind.NUMBER: "Give only the number.",
    AnswerKind.OCR: "Give the text exactly as it appears.",
    AnswerKind.FREE_FORM: "Give a short text answer.",
    AnswerKind.REGRESSION: "Give only the number.",
    AnswerKind.EXACT: "Give a short text answer.",
}
MEDIA_KEYS = ("path", "video", "videos", "image", "images")
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif"}
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


@dataclass(frozen=True)
class Row:
    """One checked row: where it came from, its media file, its question text and answer."""

    where: str  # "file:line"
    media: Path
    is_video: bool
    question: str
    answer: str
    answer_kind: AnswerKind
    meta: dict


def read_rows(path: Path) -> Iterator[tuple[int, object]]:
    """(line number, parsed row) for a JSONL file, or (item number, row) for a JSON list."""
    text = path.read_text()
    if path.suffix == ".jsonl":
        for number, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                yield number, _json(line, f"{path}:{number}")
        return
    rows = _json(text, str(path))
    if not isinstance(rows, list):
        raise ValueError(f"{path}: expected a JSON list of rows (or a .jsonl file), got {type(rows).__name__}")
    yield from enumerate(rows, start=1)


def _json(text: str, where: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None


def parse_row(row: object, where: str, media_root: Path) -> Row:
    """Checks one raw row and resolves its media file; ValueError('file:line: ...') if it cannot be used."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    media_key = next((k for k in MEDIA_KEYS if k in row), None)
    question = row.get("problem", row.get("question"))
    answer = row.get("solution", row.get("answer"))
    for label, value in (
        ("media path (path, video or image)", media_key),
        ("problem", question),
        ("solution", answer),
    ):
        if value is None:
            raise ValueError(f"{where}: row has no {label}; its keys are {sorted(row)}")
    media = _media_path(row[media_key], where, media_root)
    options = _options(row.get("options"), where)
    kind = _answer_kind(row.get("problem_type"), options, where)
    data_type = row.get("data_type") or ("image" if media.suffix.lower() in IMAGE_SUFFIXES else "video")
    meta = {k: row[k] for k in ("problem_id", "problem_type", "data_source") if k in row}
    reference = _strip_answer(str(answer))
    return Row(
        where=where,
        media=media,
        is_video=data_type != "image",
        question=_question_text(str(question), options, kind),
        answer=_choice_answer(reference, options, where) if kind is AnswerKind.CHOICE else reference,
        answer_kind=kind,
        meta={**meta, "options": tuple(options)},
    )


def _media_path(value: object, where: str, media_root: Path) -> Path:
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where}: media path must be a string or a one-item list, got {value!r}")
    path = Path(value).expanduser()
    path = path if path.is_absolute() else media_root / path
    if not path.is_file():
        raise ValueError(f"{where}: media file {path} does not exist")
    return path


_LABEL = re.compile(r"^\(?([A-Z])[.):](?:\s|$)")  # an option's own label: 'B. red', '(B) red', 'B)'; not 'U.S. flag'


def _options(value: object, where: str) -> list:
    if not value:
        return []
    if not isinstance(value, list):
        raise ValueError(f"{where}: 'options' must be a list such as ['A. red', 'B. blue'], got {value!r}")
    labels = [_LABEL.match(str(option)) for option in value]
    if all(labels):  # the answer's letter means the option at that letter's place
        for i, label in enumerate(labels):
            if label.group(1) != option_letter(i):
                raise ValueError(f"{where}: option {i + 1} is labelled {label.group(1)}, not {option_letter(i)}: "
                                 "list the options in their letters' order")  # fmt: skip
    return value


def _choice_answer(answer: str, options: list, where: str) -> str:
    """A multiple-choice row's reference as its option letter ('B', '(B)', 'B. red' -> 'B')."""
    letter = choice_letter(answer)
    if letter is None or ord(letter) - ord("A") >= len(options):
        raise ValueError(f"{where}: the solution {answer!r} names none of the {len(options)} options' letters "
                         f"(A-{option_letter(len(options) - 1)})")  # fmt: skip
    return letter


def _answer_kind(problem_type: object, options: list, where: str) -> AnswerKind:
    if problem_type is None:
        return AnswerKind.CHOICE if options else AnswerKind.EXACT
    kind = PROBLEM_TYPES.get(str(problem_type).lower())
    if kind is None:
        raise ValueError(f"{where}: unknown problem_type {problem_type!r}; known: {', '.join(PROBLEM_TYPES)}")
    if kind is AnswerKind.CHOICE and not options:
        raise ValueError(f"{where}: a multiple-choice row needs a non-empty 'options' list")
    return kind


def _question_text(problem: str, options: list, kind: AnswerKind) -> str:
    lines = [problem]
    if kind is AnswerKind.CHOICE:  # shown as labelled where every option is (`_options` checked their order)
        labelled = all(_LABEL.match(str(o)) for o in options)
        lines += ["Options:", *(str(o) if labelled else f"{option_letter(i)}. {o}" for i, o in enumerate(options))]
    return "\n".join([*lines, f"{R1_INSTRUCTION} {ANSWER_HINTS[kind]}"])


def _strip_answer(solution: str) -> str:
    found = _ANSWER_TAG.search(solution)
    return (found.group(1) if found else solution).strip()


class VideoR1Dataset:
    """Examples from a Video-R1-style file; example i decodes row i's media (deterministic, resumable)."""

    def __init__(
        self,
        path: str | Path,
        tokenizer: Tokenizer,
        sampling: FrameSampling | None = None,
        vision: VisionSpec | None = None,
        image_vision: VisionSpec | None = None,
        media_root: str | Path | None = None,
        system: str | None = DEFAULT_SYSTEM,
    ) -> None:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"dataset file {path} does not exist")
        root = Path(media_root) if media_root is not None else path.parent
        self.rows = tuple(parse_row(row, f"{path}:{n}", root) for n, row in read_rows(path))
        if not self.rows:
            raise ValueError(f"dataset file {path} has no rows")
        self.tokenizer = tokenizer
        self.sampling = sampling or FrameSampling()
        self.vision = vision or VisionSpec()
        self.image_vision = image_vision or VisionSpec.for_images()
        self.system = system

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Example:
        row = self.rows[index]
        visual = self._visual(row)
        merge = (self.vision if row.is_video else self.image_vision).merge_size
        prompt = build_prompt(self.tokenizer, row.question, [visual], self.system, merge)
        meta = {"source": "video_r1", "where": row.where, "media": str(row.media), **row.meta}
        return Example(prompt=prompt, answer=row.answer, answer_kind=row.answer_kind, meta=meta)

    def iter_from(self, start: int = 0) -> Iterator[Example]:
        for index in range(start, len(self)):
            yield self[index]

    def _visual(self, row: Row) -> Visual:
        try:
            if row.is_video:
                video = decode_video(row.media, self.sampling)
                return preprocess_video(video.frames, self.vision, fps=video.sampled_fps)
            return preprocess_image(_load_image(row.media), self.image_vision)
        except Exception as e:  # av / PIL raise many types; the row's location is what the user needs
            raise ValueError(f"{row.where}: cannot read {row.media}: {e}") from e


def _load_image(path: Path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as img:
        return np.asarray(img.convert("RGB"))
