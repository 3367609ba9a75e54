#!/usr/bin/env python3
"""Reference ids of transformers' T5 tokenizers for models/t5_tokenizer_test.cpp.

    t5_tokenizer_reference.py OUT_DIR

Trains a small SentencePiece unigram model as T5's is made (pad 0, end 1, unknown 2, no begin
token, nmt_nfkc normalisation) on a generated caption corpus: OUT_DIR/spiece.model. Then, for 200+
strings (runs of spaces, leading and trailing spaces, tabs and newlines, full-width and
NFKC-folded characters, literal </s> and <extra_id_N>, characters outside the vocabulary),
OUT_DIR/ids.json holds, per string:
  slow          T5Tokenizer(legacy=True)(s).input_ids (SentencePiece's own behaviour)
  fast          T5TokenizerFast(s).input_ids with the backend T5's and Flux's tokenizer.json
                configure: Precompiled + Replace(" {2,}", " ") normalisers, WhitespaceSplit +
                Metaspace(prepend_scheme="always") pre-tokenisers
  fast_457      T5TokenizerFast(vocab_file=...) as transformers 4.57 converts a bare spiece.model
                (prepend_scheme "never"), for the record
  padded        the fast tokenizer's (s, max_length=16, padding="max_length", truncation=True)
  padded_mask   its attention_mask's ones
"""
import base64
import json
import os
import random
import sys

import sentencepiece as spm
from tokenizers import Regex, normalizers, pre_tokenizers
from transformers import T5Tokenizer, T5TokenizerFast

WORDS = ("a photo of the cat dog sitting on red blue green chair table sky over under with and in "
         "portrait painting anime style highly detailed girl boy man woman standing running city "
         "night day light shadow 1girl solo long hair short eyes smile masterpiece best quality "
         "landscape mountain river forest tree flower sunset beach ocean wave sword armor").split()

EDGE = [
    "", " ", "   ", "a cat", "A Cat", "a  cat", "a   cat", " a cat", "  a cat", "a cat ", "a cat  ",
    "   a   cat   ", "\ta cat", "a\tcat", "a\ncat", "a cat\n", "\n\na cat\n\n", "a \t\n cat",
    "ＡＢＣ cat", "ｈｅｌｌｏ ｗｏｒｌｄ", "１２３", "ﬁne ﬂower", "① ② ③", "㎏ ㎞", "Ⅻ", "½ cup",
    "café naïve", "e\u0301", "\u3000a\u3000cat\u3000", "a\u00a0cat", "a\u2003cat",
    "cat</s>dog", "cat </s> dog", "</s>", "</s></s>", "a cat</s>", "<pad> a", "<unk>", "x <extra_id_3> y",
    "<extra_id_0><extra_id_99>", "<extra_id_100>", "</s", "<s>", "< /s>",
    "☃ snow", "☃☃ cat", "🐱 cat 🐶", "猫 cat", "Ωmega", "zzz qqq", "xyzzy", "QUALITY", "1girl, solo",
    "(masterpiece:1.2), best quality", "a, b. c! d? e: f; g", "long hair - short", "a_b_c", "a/b\\c",
    "\"quoted\" 'single'", "100% 200$ #tag @user", "~!@#$%^&*()", "...", "a--b", "a\u200bcat",
]


def corpus(path):
    r = random.Random(4)
    with open(path, "w") as f:
        for _ in range(3000):
            s = " ".join(r.choice(WORDS) for _ in range(r.randint(3, 14)))
            if r.random() < 0.3:
                s = s.capitalize()
            if r.random() < 0.3:
                s += r.choice([".", ",", "!", "?", ":", ";"])
            if r.random() < 0.1:
                s += " " + str(r.randint(0, 2000))
            if r.random() < 0.05:
                s += " (" + r.choice(WORDS) + ":1.2)"
            f.write(s + "\n")


def strings():
    r = random.Random(7)
    out = list(EDGE)
    pads = ["", " ", "  ", "\t", "\n", "\u3000"]
    while len(out) < 240:
        words = [r.choice(WORDS + EDGE[18:]) for _ in range(r.randint(1, 6))]
        seps = [r.choice([" ", " ", " ", "  ", "\t", ", ", " </s> "]) for _ in words]
        s = "".join(w + sep for w, sep in zip(words, seps))[:-1]
        out.append(r.choice(pads) + s + r.choice(pads))
    return out


def train_spiece(out):
    """Trains the test's T5-style unigram model into OUT/spiece.model and returns its path."""
    text = os.path.join(out, "corpus.txt")
    corpus(text)
    spm.SentencePieceTrainer.train(
        input=text, model_prefix=os.path.join(out, "spiece"), vocab_size=300, model_type="unigram",
        pad_id=0, eos_id=1, unk_id=2, bos_id=-1, pad_piece="<pad>", eos_piece="</s>",
        unk_piece="<unk>", normalization_rule_name="nmt_nfkc", character_coverage=1.0,
        num_threads=1, minloglevel=2)
    os.remove(text)
    os.remove(os.path.join(out, "spiece.vocab"))
    return os.path.join(out, "spiece.model")


def t5_tokenizer_fast(model):
    """T5TokenizerFast over `model` with the backend T5's and Flux's tokenizer.json configure."""
    fast = T5TokenizerFast(vocab_file=model, extra_ids=100, legacy=True)
    backend = json.loads(fast.backend_tokenizer.to_str())
    charsmap = base64.b64decode(backend["normalizer"]["normalizers"][0]["precompiled_charsmap"])
    fast.backend_tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Precompiled(charsmap), normalizers.Replace(Regex(" {2,}"), " ")])
    fast.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")])
    return fast


def main() -> None:
    out = sys.argv[1]
    model = train_spiece(out)
    slow = T5Tokenizer(vocab_file=model, extra_ids=100, legacy=True)
    fast_457 = T5TokenizerFast(vocab_file=model, extra_ids=100, legacy=True)
    fast = t5_tokenizer_fast(model)

    cases = []
    for s in strings():
        padded = fast(s, max_length=16, padding="max_length", truncation=True)
        cases.append({"text": s, "slow": slow(s).input_ids, "fast": fast(s).input_ids,
                      "fast_457": fast_457(s).input_ids, "padded": padded.input_ids,
                      "padded_mask": sum(padded.attention_mask)})
    with open(os.path.join(out, "ids.json"), "w") as f:
        json.dump({"vocab_size": len(slow), "cases": cases}, f, ensure_ascii=False, indent=0)


if __name__ == "__main__":
    main()
