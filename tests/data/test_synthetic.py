from dataclasses import replace

import numpy as np
import pytest
import torch

from rollplex.data.chat import num_text_tokens
from rollplex.data.presets import PRESETS
from rollplex.data.scene import COLOURS, render, sample_scene
from rollplex.data.synthetic import QuestionKind, SyntheticVideoQA, ask
from rollplex.data.tokenizer import CharTokenizer, HFTokenizer
from rollplex.data.types import AnswerKind
from rollplex.data.video import preprocess_video


@pytest.fixture(scope="module")
def dataset() -> SyntheticVideoQA:
    return SyntheticVideoQA(PRESETS["clevrer"].tiny(), CharTokenizer(), seed=3, num_examples=40)


def same_example(a, b) -> bool:
    pa, pb = a.prompt, b.prompt
    return (
        torch.equal(pa.input_ids, pb.input_ids)
        and all(torch.equal(x.pixel_values, y.pixel_values) for x, y in zip(pa.visuals, pb.visuals, strict=True))
        and (a.answer, a.answer_kind, a.meta) == (b.answer, b.answer_kind, b.meta)
    )


def test_example_i_depends_only_on_the_seed_and_i(dataset):
    fresh = SyntheticVideoQA(dataset.preset, CharTokenizer(), seed=3, num_examples=40)
    assert same_example(fresh[7], dataset[7])
    resumed = list(fresh.iter_from(37))
    assert len(resumed) == 3 and all(same_example(e, dataset[37 + j]) for j, e in enumerate(resumed))


def test_another_seed_gives_other_examples(dataset):
    other = SyntheticVideoQA(dataset.preset, CharTokenizer(), seed=4, num_examples=40)
    assert not torch.equal(other[0].prompt.input_ids, dataset[0].prompt.input_ids)


def test_every_question_kind_and_answer_kind_occurs(dataset):
    examples = [dataset[i] for i in range(len(dataset))]
    assert {e.meta["question_kind"] for e in examples} == set(dataset.preset.questions)
    assert {e.answer_kind for e in examples} == {AnswerKind.CHOICE, AnswerKind.NUMBER, AnswerKind.EXACT}


def test_answers_have_the_form_their_kind_promises(dataset):
    for i in range(len(dataset)):
        e = dataset[i]
        if e.answer_kind is AnswerKind.CHOICE:
            letters = [o.split(".")[0] for o in e.meta["options"]]
            assert e.answer in letters and len(letters) == dataset.preset.num_options
        elif e.answer_kind is AnswerKind.NUMBER:
            assert e.answer.isdigit()
        else:
            assert e.answer in ("circle", "square")


def test_the_fastest_colour_option_names_the_fastest_thing():
    rng = np.random.default_rng(0)
    for _ in range(20):
        scene = sample_scene(rng)
        q = ask(QuestionKind.FASTEST_COLOUR, scene, np.zeros(len(scene.things)), rng, num_options=4)
        chosen = next(o for o in q.options if o.startswith(q.answer + "."))
        fastest = max(scene.things, key=lambda t: np.hypot(*t.velocity))
        assert chosen == f"{q.answer}. {fastest.colour}"
        assert len(set(q.options)) == 4


def test_the_colour_preset_asks_the_one_objects_colour_with_fixed_letters_each_in_turn():
    ds = SyntheticVideoQA(PRESETS["colour"].tiny(), CharTokenizer(), seed=0, num_examples=200)
    examples = [ds[i] for i in range(len(ds))]
    assert {e.meta["options"] for e in examples} == {("A. red", "B. green", "C. blue", "D. yellow")}
    assert [e.answer for e in examples[:8]] == list("ABCDABCD")  # any 4 consecutive examples ask each once
    assert {e.meta["question_kind"] for e in examples} == {QuestionKind.COLOUR}
    for i, e in enumerate(examples[:8]):  # the video shows that colour: the object's pixels
        (thing,) = ds._scene(i, np.random.default_rng([0, i, 0x5CE7E])).things
        assert thing.colour == ["red", "green", "blue", "yellow"][i % 4] and thing.radius >= 0.3
        layout = ds.preset.layout(0, i)
        frames = render(ds._scene(i, np.random.default_rng([0, i, 0x5CE7E])), layout.num_frames,
                        *ds.preset.frame_size(layout))  # fmt: skip
        expected = preprocess_video(frames, ds.preset.vision, size=ds.preset.frame_size(layout)).pixel_values
        assert torch.equal(e.prompt.visuals[0].pixel_values, expected)
        assert (frames == np.array(COLOURS[thing.colour], dtype=np.uint8)).all(-1).mean() > 0.1  # a large object


def test_the_prompt_holds_one_video_whose_pixels_are_the_rendered_scene(dataset):
    e = dataset[5]
    (visual,) = e.prompt.visuals
    t, h, w = visual.grid_thw
    assert int((e.prompt.input_ids == CharTokenizer().special.video).sum()) == t * h * w // 4
    assert t == -(-e.meta["num_frames"] // 2) and (h * 14, w * 14) == e.meta["frame_size"]
    rng = np.random.default_rng([3, 5, 0x5CE7E])
    frames = render(sample_scene(rng), e.meta["num_frames"], *e.meta["frame_size"])
    assert torch.equal(visual.pixel_values, preprocess_video(frames, dataset.preset.vision).pixel_values)


def test_filler_brings_the_text_to_the_layouts_token_count_and_no_further_than_a_word():
    preset = replace(PRESETS["star"].tiny(), text_tokens=(400, 500))
    tok = CharTokenizer()
    ds = SyntheticVideoQA(preset, tok, seed=0, num_examples=8)
    for i in range(len(ds)):
        e = ds[i]
        question = tok.decode(e.prompt.input_ids.tolist()).split("<|vision_end|>")[1].split("<|im_end|>")[0]
        target = preset.layout(0, i).num_text_tokens
        assert 0 <= num_text_tokens(tok, question) - target <= len(max(question.split(), key=len)) + 1


def test_full_scale_prompt_lengths_match_the_preset_estimate_when_the_text_budget_exceeds_the_question():
    preset = replace(PRESETS["clevrer"], text_tokens=(300, 400))
    ds = SyntheticVideoQA(preset, CharTokenizer(), seed=0, num_examples=2)
    for i in range(2):
        estimate = preset.prompt_tokens(preset.layout(0, i))
        assert 0 <= ds[i].prompt.num_tokens - estimate <= 15


def test_a_text_budget_below_the_question_keeps_the_whole_question():
    preset = replace(PRESETS["clevrer"].tiny(), text_tokens=(1, 1))
    e = SyntheticVideoQA(preset, CharTokenizer(), seed=0, num_examples=1)[0]
    assert CharTokenizer().decode(e.prompt.input_ids.tolist()).count("<answer> </answer>") == 1


def test_a_bpe_tokenizer_builds_the_same_questions(tokenizer_json):
    preset = PRESETS["clevrer"].tiny()
    char = SyntheticVideoQA(preset, CharTokenizer(), seed=1, num_examples=4)[2]
    bpe = SyntheticVideoQA(preset, HFTokenizer.from_dir(tokenizer_json), seed=1, num_examples=4)[2]
    assert (char.answer, char.meta) == (bpe.answer, bpe.meta)
    assert torch.equal(char.prompt.visuals[0].pixel_values, bpe.prompt.visuals[0].pixel_values)


def test_an_index_past_the_end_is_an_index_error(dataset):
    with pytest.raises(IndexError, match="out of range"):
        dataset[40]


def test_mismatched_videos_keep_each_question_and_answer_and_show_another_examples_video():
    preset = PRESETS["colour"].tiny()
    matched = SyntheticVideoQA(preset, CharTokenizer(), seed=1, num_examples=400)
    shown = SyntheticVideoQA(preset, CharTokenizer(), seed=1, num_examples=400, mismatch_videos=True)
    others = []
    for i in range(200):
        a, b = matched[i], shown[i]
        assert torch.equal(a.prompt.input_ids, b.prompt.input_ids) and a.answer == b.answer
        j = shown._shown(i)
        assert j != i
        others.append(matched[j].answer)
        if i < 5:
            layout = preset.layout(1, i)
            scene = shown._scene(j, np.random.default_rng([1, j, 0x5CE7E]))
            frames = render(scene, layout.num_frames, *preset.frame_size(layout))
            expected = preprocess_video(frames, preset.vision, size=preset.frame_size(layout)).pixel_values
            assert torch.equal(b.prompt.visuals[0].pixel_values, expected)
    agree = sum(o == matched[i].answer for i, o in enumerate(others)) / 200
    assert 0.15 < agree < 0.35  # what the video shows answers the question at chance (0.25)
