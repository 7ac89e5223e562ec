import json

import numpy as np
import pytest
import torch
from PIL import Image

from rollplex.data.decode import FrameSampling, decode_video
from rollplex.data.rewards import get_reward
from rollplex.data.tokenizer import CharTokenizer
from rollplex.data.types import AnswerKind
from rollplex.data.video import VisionSpec, preprocess_video
from rollplex.data.video_r1 import VideoR1Dataset

from .conftest import write_video

ROWS = [
    {
        "problem_id": 1,
        "problem": "What colour is the bar?",
        "data_type": "video",
        "problem_type": "multiple choice",
        "options": ["A. red", "B. green", "C. blue"],
        "solution": "<answer>B</answer>",
        "path": "./clips/a.mp4",
        "data_source": "LLaVA-Video-178K/test",
    },
    {
        "problem_id": 2,
        "problem": "How many bars are there?",
        "data_type": "video",
        "problem_type": "numerical",
        "options": [],
        "solution": "<answer>1</answer>",
        "path": "./clips/a.mp4",
    },
    {"question": "Which way does the bar move?", "answer": "to the right", "videos": ["clips/a.mp4"]},
    {"problem": "Is it dark?", "problem_type": "free-form", "solution": "<answer> Yes </answer>", "image": "i.png"},
]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("video_r1")
    (root / "clips").mkdir()
    write_video(root / "clips" / "a.mp4", num_frames=16, fps=8)
    Image.fromarray(np.full((60, 80, 3), 30, np.uint8)).save(root / "i.png")
    (root / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    (root / "rows.json").write_text(json.dumps(ROWS))
    return root


def make(path, **kwargs) -> VideoR1Dataset:
    return VideoR1Dataset(path, CharTokenizer(), sampling=FrameSampling(num_frames=4), **kwargs)


@pytest.mark.parametrize(
    ("problem_type", "kind"),
    [("multiple choice", AnswerKind.CHOICE), ("numerical", AnswerKind.NUMBER), ("OCR", AnswerKind.OCR),
     ("free-form", AnswerKind.FREE_FORM), ("open-ended", AnswerKind.FREE_FORM),
     ("regression", AnswerKind.REGRESSION)],
)  # fmt: skip
def test_each_video_r1_problem_type_is_scored_by_its_own_rule(data_dir, tmp_path, problem_type, kind):
    row = {"problem": "q", "problem_type": problem_type, "solution": "<answer>A</answer>", "path": "clips/a.mp4"}
    row["options"] = ["A. x", "B. y"]
    (data_dir / f"{kind}.jsonl").write_text(json.dumps(row) + "\n")
    assert make(data_dir / f"{kind}.jsonl").rows[0].answer_kind is kind


def test_video_r1_rows_become_examples_with_their_answers_and_kinds(data_dir):
    ds = make(data_dir / "rows.jsonl")
    assert len(ds) == 4
    assert [(ds.rows[i].answer, ds.rows[i].answer_kind) for i in range(4)] == [
        ("B", AnswerKind.CHOICE),
        ("1", AnswerKind.NUMBER),
        ("to the right", AnswerKind.EXACT),
        ("Yes", AnswerKind.FREE_FORM),
    ]
    e = ds[0]
    text = CharTokenizer().decode(e.prompt.input_ids.tolist())
    assert "What colour is the bar?\nOptions:\nA. red\nB. green\nC. blue\n" in text
    assert e.meta["problem_id"] == 1 and e.meta["data_source"] == "LLaVA-Video-178K/test"
    assert e.meta["where"].endswith("rows.jsonl:1")


def test_a_video_rows_pixels_are_its_decoded_and_preprocessed_frames(data_dir):
    e = make(data_dir / "rows.jsonl")[1]
    (visual,) = e.prompt.visuals
    decoded = decode_video(data_dir / "clips" / "a.mp4", FrameSampling(num_frames=4))
    expected = preprocess_video(decoded.frames, VisionSpec(), fps=decoded.sampled_fps)
    assert visual.is_video and visual.grid_thw == expected.grid_thw == (2, 20, 28)  # upscaled to min_pixels
    assert torch.equal(visual.pixel_values, expected.pixel_values)
    assert visual.second_per_grid_t == 1.0  # 4 frames over 2 s: 2 fps, 2 frames per grid step


def test_an_image_row_gives_an_image_visual(data_dir):
    e = make(data_dir / "rows.jsonl")[3]
    (visual,) = e.prompt.visuals
    assert not visual.is_video and visual.grid_thw[0] == 1
    assert int((e.prompt.input_ids == CharTokenizer().special.image).sum()) == visual.num_patches // 4


def test_a_json_list_and_a_jsonl_file_give_the_same_examples(data_dir):
    a, b = make(data_dir / "rows.json"), make(data_dir / "rows.jsonl")
    for i in range(len(a)):
        assert torch.equal(a[i].prompt.input_ids, b[i].prompt.input_ids) and a[i].answer == b[i].answer


def test_media_paths_resolve_against_a_given_media_root(data_dir, tmp_path):
    (tmp_path / "rows.jsonl").write_text(json.dumps(ROWS[1]) + "\n")
    assert len(make(tmp_path / "rows.jsonl", media_root=data_dir)) == 1


def one_line_error(tmp_path, lines: list[str]) -> str:
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError) as info:
        make(path)
    message = str(info.value)
    assert "\n" not in message and f"{path}:" in message
    return message


def test_a_missing_video_is_an_error_naming_the_file_and_line(tmp_path, data_dir):
    ok = json.dumps({**ROWS[1], "path": str(data_dir / "clips" / "a.mp4")})
    message = one_line_error(tmp_path, [ok, json.dumps({**ROWS[1], "path": "nope.mp4"})])
    assert message.startswith(f"{tmp_path / 'bad.jsonl'}:2:") and "nope.mp4 does not exist" in message


def test_malformed_rows_are_errors_naming_the_file_and_line(tmp_path, data_dir):
    video = str(data_dir / "clips" / "a.mp4")
    assert ":1: malformed JSON" in one_line_error(tmp_path, ['{"problem": "x",'])
    assert ":1: row has no problem" in one_line_error(tmp_path, [json.dumps({"path": video, "solution": "1"})])
    assert ":1: expected a JSON object" in one_line_error(tmp_path, ["[1, 2]"])
    bad_type = {**ROWS[1], "path": video, "problem_type": "essay"}
    assert "unknown problem_type 'essay'" in one_line_error(tmp_path, [json.dumps(bad_type)])
    no_options = {**ROWS[0], "path": video, "options": []}
    assert "needs a non-empty 'options'" in one_line_error(tmp_path, [json.dumps(no_options)])


def test_an_undecodable_video_is_an_error_naming_the_row(tmp_path):
    (tmp_path / "broken.mp4").write_bytes(b"not a video at all")
    (tmp_path / "rows.jsonl").write_text(json.dumps({**ROWS[1], "path": "broken.mp4"}) + "\n")
    ds = make(tmp_path / "rows.jsonl")
    with pytest.raises(ValueError, match=r"rows.jsonl:1: cannot read .*broken.mp4"):
        ds[0]


def test_options_given_as_a_string_are_an_error_naming_the_row(tmp_path, data_dir):
    row = {**ROWS[0], "path": str(data_dir / "clips" / "a.mp4"), "options": "A. red"}
    message = one_line_error(tmp_path, [json.dumps(row)])
    assert ":1: 'options' must be a list" in message and "got 'A. red'" in message


def test_options_labelled_out_of_their_order_are_an_error_naming_the_row(tmp_path, data_dir):
    row = {**ROWS[0], "path": str(data_dir / "clips" / "a.mp4"), "options": ["B. red", "A. blue"]}
    message = one_line_error(tmp_path, [json.dumps(row)])
    assert ":1: option 1 is labelled B, not A" in message


@pytest.mark.parametrize(
    "options, shown",
    [
        (["red", "U.S. flag", "blue"], ["A. red", "B. U.S. flag", "C. blue"]),
        (["A.M. radio", "FM radio"], ["A. A.M. radio", "B. FM radio"]),  # a label's letter, but no label
        (["3:2 ratio", "B:3 ratio"], ["A. 3:2 ratio", "B. B:3 ratio"]),
    ],
)
def test_options_whose_text_starts_like_a_label_are_options_not_labels(data_dir, options, shown):
    path = data_dir / "flag.jsonl"
    path.write_text(json.dumps({**ROWS[0], "options": options}) + "\n")
    e = make(path)[0]
    assert "\nOptions:\n" + "\n".join(shown) + "\n" in CharTokenizer().decode(e.prompt.input_ids.tolist())
    assert get_reward("accuracy")("<answer>B</answer>", e) == 1.0


@pytest.mark.parametrize("solution", ["<answer>B</answer>", "<answer>(B)</answer>", "B. green", "<answer> b </answer>"])
def test_a_multiple_choice_solution_is_read_as_its_option_letter(data_dir, solution):
    path = data_dir / "solution.jsonl"
    path.write_text(json.dumps({**ROWS[0], "solution": solution}) + "\n")
    e = make(path)[0]
    assert e.answer == "B" and get_reward("accuracy")("<answer>B</answer>", e) == 1.0


@pytest.mark.parametrize("solution", ["<answer>green</answer>", "<answer>D</answer>"])
def test_a_multiple_choice_solution_naming_no_option_is_an_error_naming_the_row(tmp_path, data_dir, solution):
    row = {**ROWS[0], "path": str(data_dir / "clips" / "a.mp4"), "solution": solution}
    assert ":1: the solution" in one_line_error(tmp_path, [json.dumps(row)])


@pytest.mark.parametrize("text", ["", "\n\n", "[]"])
def test_a_dataset_file_without_rows_is_an_error_naming_the_file(tmp_path, text):
    path = tmp_path / ("rows.json" if text == "[]" else "rows.jsonl")
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        make(path)
    assert str(info.value) == f"dataset file {path} has no rows"


@pytest.mark.parametrize(
    "options", [["red", "blue"], ["A. red", "B. blue"], ["(A) red", "(B) blue"], ["A) red", "B) blue"]]
)
def test_every_accepted_option_form_is_shown_and_scored_by_the_same_letters(data_dir, options):
    path = data_dir / "forms.jsonl"
    path.write_text(json.dumps({**ROWS[0], "options": options}) + "\n")
    e = make(path)[0]
    text = CharTokenizer().decode(e.prompt.input_ids.tolist())
    assert "\nOptions:\nA" in text or "\nOptions:\n(A" in text
    fn = get_reward("answer_format")
    assert fn("<answer>A</answer>", e) == fn("<answer>B</answer>", e) == 1.0
    assert fn("<answer>C</answer>", e) == 0.25
