import torch

from rollplex.data.chat import build_prompt, num_pad_tokens, num_text_tokens, render_prompt
from rollplex.data.tokenizer import CharTokenizer, HFTokenizer
from rollplex.models.inputs import Visual


def visual(grid: tuple[int, int, int], is_video: bool = True) -> Visual:
    t, h, w = grid
    return Visual(pixel_values=torch.zeros(t * h * w, 1176), grid_thw=grid, is_video=is_video)


def test_rendered_prompt_is_the_qwen_chat_template():
    text = render_prompt("How many?", [visual((1, 2, 4))], system="Be brief.")
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|video_pad|><|video_pad|><|vision_end|>How many?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_pad_count_is_the_patch_grid_over_the_merge_window():
    v = visual((3, 4, 6))
    assert num_pad_tokens(v) == 3 * 4 * 6 // 4
    ids = build_prompt(CharTokenizer(), "q", [v]).input_ids
    assert int((ids == CharTokenizer().special.video).sum()) == 18
    assert int((ids == CharTokenizer().special.image).sum()) == 0


def test_an_image_uses_image_pads_and_visuals_appear_in_order():
    tok = CharTokenizer()
    sp = tok.special
    prompt = build_prompt(tok, "q", [visual((1, 2, 2), is_video=False), visual((2, 2, 2))])
    ids = prompt.input_ids.tolist()
    starts = [i for i, t in enumerate(ids) if t == sp.vision_start]
    assert [ids[s + 1] for s in starts] == [sp.image, sp.video]
    assert ids[starts[0] + 2] == sp.vision_end and ids[starts[1] + 3] == sp.vision_end
    assert prompt.visuals[0].is_video is False and prompt.visuals[1].grid_thw == (2, 2, 2)


def test_prompt_ids_equal_encoding_the_rendered_text_whole_with_the_char_tokenizer():
    tok = CharTokenizer()
    visuals = [visual((2, 4, 4))]
    prompt = build_prompt(tok, "Which colour?\nA. red", visuals)
    assert prompt.input_ids.dtype == torch.int64
    assert prompt.input_ids.tolist() == tok.encode(render_prompt("Which colour?\nA. red", visuals))


def test_prompt_ids_equal_encoding_the_rendered_text_whole_with_a_bpe_tokenizer(tokenizer_json):
    tok = HFTokenizer.from_dir(tokenizer_json)
    for visuals in ([], [visual((2, 2, 4))]):
        for system in (None, "You are a helpful assistant."):
            text = render_prompt("How many squares are in the video?", visuals, system)
            prompt = build_prompt(tok, "How many squares are in the video?", visuals, system)
            assert prompt.input_ids.tolist() == tok.encode(text)


def test_without_a_system_prompt_the_user_turn_comes_first():
    tok = CharTokenizer()
    ids = build_prompt(tok, "q", system=None).input_ids.tolist()
    assert tok.decode(ids) == "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"


def test_text_tokens_are_the_prompt_minus_its_vision_blocks():
    tok = CharTokenizer()
    prompt = build_prompt(tok, "q?", [visual((2, 4, 4))])
    assert prompt.num_tokens == num_text_tokens(tok, "q?") + 2 + 8
