"""PieceEncoder gives exactly the tokenizer's ids, and declines tokenizers where it could not."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers

from liveloop.server.tools import ChatTemplate
from liveloop.server.tools.pieces import PieceEncoder
from tests.server_proc import model_dir


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir()))


def random_texts(specials: list[str], count: int, seed: int = 7) -> list[str]:
    """Texts that mix special tokens (whole, glued, cut short) with words, spaces, unicode."""
    rng = random.Random(seed)
    words = ["hello", " world", "\n", "  ", "\t", "naïve", "日本語", "😀", "x" * 40, "123",
             "<", "|>", "<|im", "_start|>", "'s", "don't", " \n\n "]  # fmt: skip
    return [
        "".join(rng.choice(specials + words) for _ in range(rng.randint(0, 30)))
        for _ in range(count)
    ]


def test_pieces_give_the_tokenizers_ids_cached_or_not(tokenizer: Any) -> None:
    encoder = PieceEncoder.for_tokenizer(tokenizer)
    assert encoder is not None
    backend = tokenizer.backend_tokenizer
    specials = [t.content for t in backend.get_added_tokens_decoder().values()]
    template = ChatTemplate(tokenizer)
    chats = [
        template.render_text([{"role": "system", "content": "Be brief."},
                              {"role": "user", "content": f"Question {i}?"}], None)
        for i in range(5)
    ]  # fmt: skip
    texts = [*random_texts(specials, 300), *chats, "", "<|im_start|><|im_end|>"]
    for _ in range(2):  # the second pass comes from the cache
        for text in texts:
            assert encoder.encode(text) == backend.encode(text, add_special_tokens=False).ids
    assert template.render_ids([{"role": "user", "content": "hi"}], None) == (
        backend.encode(
            template.render_text([{"role": "user", "content": "hi"}], None),
            add_special_tokens=False,
        ).ids
    )


def word_level(pre: Any = None, normalizer: Any = None, added: list[Any] | None = None) -> Any:
    """A small real tokenizer, wrapped as transformers wraps one (`backend_tokenizer`)."""
    backend = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre or pre_tokenizers.Whitespace()
    if normalizer is not None:
        backend.normalizer = normalizer
    backend.add_special_tokens(added or [AddedToken("<s>", special=True)])
    return SimpleNamespace(backend_tokenizer=backend)


@pytest.mark.parametrize(
    "pre",
    [
        pre_tokenizers.Whitespace(),
        pre_tokenizers.Sequence([pre_tokenizers.Digits(), pre_tokenizers.Whitespace()]),
    ],
    ids=["whitespace", "sequence"],
)
def test_a_plain_tokenizer_is_taken_and_encoded_exactly(pre: Any) -> None:
    wrapped = word_level(pre=pre)
    encoder = PieceEncoder.for_tokenizer(wrapped)
    assert encoder is not None
    for text in ["a b<s>b a", "<s><s>a", "ab c <s", "a12b<s>3", ""]:
        assert encoder.encode(text) == wrapped.backend_tokenizer.encode(text).ids


@pytest.mark.parametrize(
    "wrapped",
    [
        word_level(normalizer=normalizers.Lowercase()),
        word_level(added=[AddedToken("<s>", special=True, lstrip=True)]),
        word_level(added=[AddedToken("<s>", special=True, single_word=True)]),
        word_level(pre=pre_tokenizers.Metaspace(prepend_scheme="first")),
        SimpleNamespace(),  # a slow tokenizer: no Rust backend
    ],
    ids=["normalizer", "lstrip", "single-word", "metaspace-first", "no-backend"],
)
def test_tokenizers_whose_pieces_are_not_independent_are_declined(wrapped: Any) -> None:
    assert PieceEncoder.for_tokenizer(wrapped) is None
