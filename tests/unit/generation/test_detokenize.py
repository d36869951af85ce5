"""A finished completion decoded at once gives the text vLLM's incremental detokenizer gives
(`tokenizers.decoders.DecodeStream` primed with the prompt, stepped token by token), on the
tiny model's byte-level BPE and on a SentencePiece-style one, which drops a text's leading
space. Real vLLM's own text is compared in tests/integration/test_engine.py."""

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers.decoders import DecodeStream

from pipeline.generation.detokenize import decode_outputs, fast_tokenizer

TEXT = ["the quick brown fox jumps over the lazy dog", "Ünïcödé ✓ 日本語 naïve café", "a summary, in brief: done."]


def streamed(tokenizer: Tokenizer, prompt: list[int], output: list[int]) -> str:
    """What vLLM's `FastIncrementalDetokenizer` writes for `output` after `prompt`."""
    stream = DecodeStream(ids=prompt, skip_special_tokens=True)
    return "".join(stream.step(tokenizer, token) or "" for token in output)


def random_pairs(tokenizer: Tokenizer, seed: int, count: int = 300) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts that are real text, and outputs of random ids: special tokens, byte pieces
    that leave a character unfinished, and tokens that begin a word."""
    rng = random.Random(seed)
    vocab = tokenizer.get_vocab_size()
    prompts, outputs = [], []
    for k in range(count):
        prompts.append(tokenizer.encode(rng.choice(TEXT) * (k % 3 + 1)).ids)
        outputs.append([rng.randrange(vocab) for _ in range(rng.randrange(0, 40))])
    return prompts, outputs


def sentencepiece_like() -> Tokenizer:
    """BPE over Metaspace with byte fallback, decoded as Llama's: the first word's space stripped."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>", *bytes_], show_progress=False)
    tok.train_from_iterator(TEXT * 50, trainer=trainer)
    return tok


def test_the_tiny_models_outputs_decode_as_vllm_streams_them(tiny_model: Path):
    tokenizer = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    prompts, outputs = random_pairs(tokenizer, seed=1)

    texts = decode_outputs(tokenizer, prompts, outputs)

    assert texts == [streamed(tokenizer, p, o) for p, o in zip(prompts, outputs)]
    assert any("\ufffd" in t for t in texts)  # characters left unfinished mid-output were met, and kept


def test_a_sentencepiece_output_keeps_its_first_space_as_vllm_streams_it():
    tokenizer = sentencepiece_like()
    prompts, outputs = random_pairs(tokenizer, seed=2)
    word = tokenizer.encode("the").ids  # "▁the": a word after the prompt

    texts = decode_outputs(tokenizer, prompts + [prompts[0]], outputs + [word])

    assert texts == [streamed(tokenizer, p, o) for p, o in zip(prompts + [prompts[0]], outputs + [word])]
    assert texts[-1] == " the"
    assert tokenizer.decode(word) == "the"  # decoded on its own, the space would be lost


def test_an_empty_output_and_an_empty_prompt_decode(tiny_model: Path):
    tokenizer = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    hello = tokenizer.encode("hello world").ids

    assert decode_outputs(tokenizer, [hello, []], [[], hello]) == ["", "hello world"]


def test_only_a_fast_tokenizer_is_decoded_here(tiny_model: Path):
    from transformers import AutoTokenizer

    fast = AutoTokenizer.from_pretrained(tiny_model)

    assert isinstance(fast_tokenizer(fast), Tokenizer)
    assert fast_tokenizer(fast._tokenizer) is fast._tokenizer
    assert fast_tokenizer(object()) is None  # vLLM then detokenizes, as by default


@pytest.mark.parametrize("ids", [[], [1, 2, 3]])
def test_an_unfinished_last_character_is_left_out(ids: list[int]):
    tokenizer = sentencepiece_like()
    check = tokenizer.token_to_id("<0xE2>")  # the first of "✓"'s three bytes

    (text,) = decode_outputs(tokenizer, [ids], [tokenizer.encode("done").ids + [check]])

    assert text == streamed(tokenizer, ids, tokenizer.encode("done").ids + [check])
    assert not text.endswith("\ufffd")
