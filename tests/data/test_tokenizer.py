import random
import string

import pytest
from transformers import PreTrainedTokenizerFast

from rollplex.data.tokenizer import CHAR_SPECIALS, CharTokenizer, HFTokenizer
from rollplex.models.config import load_model_config


def test_char_tokenizer_special_ids_are_the_tiny_configs():
    cfg = load_model_config("tiny")
    tok = CharTokenizer()
    sp = tok.special
    assert (sp.pad, tok.token_id("<|bos|>")) == (0, 1)
    assert (sp.eos, sp.vision_start, sp.vision_end, sp.image, sp.video) == (
        cfg.tokens.eos,
        cfg.tokens.vision_start,
        cfg.tokens.vision_end,
        cfg.tokens.image,
        cfg.tokens.video,
    )
    assert tok.token_id("<|vision_pad|>") == 5
    assert [tok.token_id(t) for t in ("<|im_start|>", "<think>", "</think>", "<answer>", "</answer>")] == [
        8,
        9,
        10,
        11,
        12,
    ]


def test_char_tokenizer_fits_in_the_tiny_vocabulary():
    assert CharTokenizer().vocab_size <= load_model_config("tiny").text.vocab_size


def test_every_special_string_encodes_to_one_id():
    tok = CharTokenizer()
    for special in CHAR_SPECIALS:
        assert tok.encode(special) == [tok.token_id(special)]


def test_text_with_specials_round_trips_through_encode_and_decode():
    tok = CharTokenizer()
    rng = random.Random(0)
    for _ in range(50):
        parts = [rng.choice([*CHAR_SPECIALS, *string.printable]) for _ in range(40)]
        text = "".join(parts)
        assert tok.decode(tok.encode(text)) == text
        ids = [rng.randrange(tok.vocab_size) for _ in range(40)]
        assert tok.encode(tok.decode(ids)) == ids


def test_characters_outside_printable_ascii_encode_as_a_question_mark():
    tok = CharTokenizer()
    assert tok.decode(tok.encode("café ✓")) == "caf? ?"


def test_for_model_moves_the_special_ids_to_a_real_configs_and_keeps_text_ids():
    tokens = load_model_config("qwen2_5_vl_7b").tokens
    tok = CharTokenizer.for_model(tokens.eos, tokens.vision_start, tokens.vision_end, tokens.image, tokens.video)
    assert (tok.special.eos, tok.special.video, tok.special.image) == (tokens.eos, tokens.video, tokens.image)
    assert tok.encode("abc") == CharTokenizer().encode("abc")
    assert (
        tok.decode(tok.encode("<|vision_start|><|video_pad|>x<|im_end|>")) == "<|vision_start|><|video_pad|>x<|im_end|>"
    )


def test_for_model_of_the_tiny_config_is_the_default_layout():
    t = load_model_config("tiny").tokens
    tok = CharTokenizer.for_model(t.eos, t.vision_start, t.vision_end, t.image, t.video)
    assert tok.special == CharTokenizer().special and tok.vocab_size == CharTokenizer().vocab_size


def test_hf_tokenizer_special_ids_are_those_of_tokenizer_json(tokenizer_json):
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(tokenizer_json))
    sp = HFTokenizer.from_dir(tokenizer_json.parent).special
    assert sp.pad == raw.token_to_id("<|endoftext|>")
    assert sp.eos == raw.token_to_id("<|im_end|>")
    assert sp.video == raw.token_to_id("<|video_pad|>") and sp.image == raw.token_to_id("<|image_pad|>")


def test_hf_tokenizer_encodes_like_transformers_fast_tokenizer(tokenizer_json):
    ours = HFTokenizer.from_dir(tokenizer_json.parent)
    oracle = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json))
    text = "<|im_start|>user\n<|vision_start|><|video_pad|><|video_pad|><|vision_end|>How many squares?<|im_end|>\n"
    assert ours.encode(text) == oracle.encode(text, add_special_tokens=False)
    assert ours.decode(ours.encode(text)) == text
    assert ours.vocab_size == len(oracle)


def test_a_checkpoint_without_tokenizer_json_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"no tokenizer\.json"):
        HFTokenizer.from_dir(tmp_path)


def test_a_tokenizer_without_qwen_special_tokens_is_a_clear_error(tmp_path):
    from tokenizers import Tokenizer, models

    path = tmp_path / "tokenizer.json"
    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(path))
    with pytest.raises(ValueError, match="has no token <\\|im_end\\|>"):
        HFTokenizer.from_dir(tmp_path)
