#!/usr/bin/env python3
"""Reference ids for models/clip_tokenizer_test.cpp, from Hugging Face transformers' slow
CLIPTokenizer (the tokenizer Stable Diffusion 1.5 pipelines and kohya sd-scripts use) built on
the real CLIP vocabulary that ships inside open_clip_torch (bpe_simple_vocab_16e6.txt.gz).

Usage: clip_tokenizer_reference.py OUT_DIR

Writes, without touching the network:
  OUT_DIR/reference.json        the cases (see below)
  OUT_DIR/tokenizer/vocab.json  the vocabulary derived from open_clip's file, laid out as
  OUT_DIR/tokenizer/merges.txt  openai/clip-vit-large-patch14 and diffusers' tokenizer/ folder
                                are; transformers' CLIPTokenizer is built from these two files.

reference.json holds the path of open_clip's gz file, the tokenizer's vocab size and special ids,
and lists of cases. Each case is {name, text, ids, fixed_text, padded_77, long_150, long_225,
weighted_75, weighted_150, weighted_225, ftfy_gap[, ids_without_fix_encoding]}:
  ids        tokenizer.encode(text, add_special_tokens=False)
  fixed_text ftfy.fix_text(text, fix_encoding=False): the ftfy subset the C++ tokenizer implements
  padded_77  tokenizer(text, padding="max_length", truncation=True, max_length=77).input_ids,
             as diffusers' StableDiffusionPipeline and kohya (without --max_token_length) call it
  long_150, long_225  kohya sd-scripts' BaseDataset.get_input_ids with --max_token_length 150 /
             225, flattened (n_chunks * 77), transcribed below from library/train_util.py
  weighted_75, weighted_150, weighted_225  {ids, weights} of kohya's --weighted_captions at that
             max_token_length (kohya_weighted_input_ids), or null where a weight is no number
  ftfy_gap   true when ftfy's mojibake repair (fix_encoding, which the C++ side does not
             implement) changes the ids; then ids_without_fix_encoding holds the ids transformers
             gives with that one ftfy step disabled.
"sweep" cases cover the Unicode tables (every code point of planes 0 and 1 that Python's
unicodedata knows, in runs, and every code point the regex module knows but unicodedata does
not, one at a time); their ids come from the tokenizer with fix_encoding disabled, because
arbitrary code point soup is not mojibake and is not what those cases test.

All strings are typed in below or generated from a fixed seed; no expected id is typed in.
"""

import functools
import gzip
import importlib.metadata
import importlib.util
import json
import logging
import os
import random
import sys
import tempfile
import unicodedata

import ftfy
import regex
import transformers
from transformers import CLIPTokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from prompt_attention import prompt_attention  # noqa: E402  (kohya's parse of the syntax)

MODEL_MAX_LENGTH = 77  # openai/clip-vit-large-patch14's tokenizer_config.json
NUM_MERGES = 49152 - 256 - 2  # open_clip SimpleTokenizer and transformers CLIPTokenizer


def bytes_to_unicode():
    """transformers.models.clip.tokenization_clip.bytes_to_unicode (= open_clip's)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(2**8):
        if b not in bs:
            bs.append(b)
            cs.append(2**8 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def write_tokenizer_files(gz_path, folder):
    """vocab.json + merges.txt exactly as open_clip's SimpleTokenizer builds its vocabulary."""
    merges = gzip.open(gz_path).read().decode("utf-8").split("\n")[1:NUM_MERGES + 1]
    merges = [tuple(m.split()) for m in merges]
    vocab = list(bytes_to_unicode().values())
    vocab = vocab + [v + "</w>" for v in vocab]
    vocab.extend("".join(m) for m in merges)
    vocab.extend(["<|startoftext|>", "<|endoftext|>"])
    os.makedirs(folder, exist_ok=True)
    vocab_file = os.path.join(folder, "vocab.json")
    merges_file = os.path.join(folder, "merges.txt")
    with open(vocab_file, "w", encoding="utf-8") as f:
        json.dump({token: i for i, token in enumerate(vocab)}, f, ensure_ascii=False)
    with open(merges_file, "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
        for m in merges:
            f.write(" ".join(m) + "\n")
    return vocab_file, merges_file


def kohya_get_input_ids(tokenizer, caption, max_token_length):
    """kohya sd-scripts library/train_util.py BaseDataset.get_input_ids, both branches (SD1.x's
    tokenizer pads with its EOS; SDXL's second with id 0), torch.cat/torch.stack written as list
    operations. tokenizer_max_length
    is set in BaseDataset.__init__ as model_max_length (None) or max_token_length + 2."""
    tokenizer_max_length = (tokenizer.model_max_length if max_token_length is None
                            else max_token_length + 2)
    input_ids = tokenizer(caption, padding="max_length", truncation=True,
                          max_length=tokenizer_max_length).input_ids
    if tokenizer_max_length > tokenizer.model_max_length:
        iids_list = []
        for i in range(1, tokenizer_max_length - tokenizer.model_max_length + 2,
                       tokenizer.model_max_length - 2):  # (1, 152, 75)
            ids_chunk = ([input_ids[0]] + input_ids[i:i + tokenizer.model_max_length - 2]
                         + [input_ids[-1]])
            if tokenizer.pad_token_id != tokenizer.eos_token_id:
                # The "v2 / SDXL" branch (SDXL's second tokenizer pads with "!", id 0): a chunk
                # ending inside the caption ends in EOS; one starting in the padding starts
                # BOS EOS.
                if ids_chunk[-2] not in (tokenizer.eos_token_id, tokenizer.pad_token_id):
                    ids_chunk[-1] = tokenizer.eos_token_id
                if ids_chunk[1] == tokenizer.pad_token_id:
                    ids_chunk[1] = tokenizer.eos_token_id
            iids_list.append(ids_chunk)
        input_ids = iids_list  # n_chunks x 77
    else:
        input_ids = [input_ids]
    return [i for chunk in input_ids for i in chunk]


def kohya_weighted_input_ids(tokenizer, caption, max_token_length):
    """kohya sd-scripts' --weighted_captions ids and weights for SD1.x (library/strategy_base.py
    TokenizeStrategy._get_weighted_input_ids and the chunking of _get_input_ids; max_length is
    max_token_length + 2): every piece of the attention syntax tokenized on its own, the ids cut at
    max_length - 2, laid out as BOS + ids + EOS + padding with weight 1 at BOS, EOS and padding,
    then cut into chunks as kohya_get_input_ids does, each chunk's ends weighing 1. Flattened."""
    max_length = max_token_length + 2
    ids, weights = [], []
    for piece, weight in prompt_attention(caption):
        piece_ids = tokenizer(piece).input_ids[1:-1]
        ids += piece_ids
        weights += [weight] * len(piece_ids)
        if len(ids) > max_length - 2:
            break
    ids, weights = ids[:max_length - 2], weights[:max_length - 2]
    ids = [tokenizer.bos_token_id] + ids + [tokenizer.eos_token_id] + [tokenizer.pad_token_id] * (
        max_length - 2 - len(ids))
    weights = [1.0] + weights + [1.0] * (max_length - 1 - len(weights))
    if max_length <= tokenizer.model_max_length:
        return ids, weights
    chunk = tokenizer.model_max_length - 2
    out_ids, out_weights = [], []
    for i in range(1, max_length - tokenizer.model_max_length + 2, chunk):
        out_ids += [ids[0]] + ids[i:i + chunk] + [ids[-1]]
        out_weights += [1.0] + weights[i:i + chunk] + [1.0]
    return out_ids, out_weights


# ---------------------------------------------------------------------------------------------
# Test strings.

HAND_WRITTEN = [
    # Plain prompts.
    ("plain/empty", ""),
    ("plain/one_word", "cat"),
    ("plain/sentence", "A photograph of an astronaut riding a horse on the moon."),
    ("plain/upper", "A PHOTO OF A DOG, HIGHLY DETAILED, 8K UHD"),
    ("plain/mixed_case", "McDonald's iPhone eBay YouTube LaTeX"),
    ("plain/booru", "1girl, solo, long hair, blue eyes, looking at viewer, smile, school uniform, "
     "outdoors, cherry blossoms, depth of field"),
    ("plain/underscores", "1girl solo long_hair blue_eyes looking_at_viewer :d ^_^ >_<"),
    ("plain/photo", "portrait of a woman, 85mm, f/1.8, ISO 100, 1/250s, golden hour, bokeh"),
    ("plain/numbers", "12345 3.14159 1,000,000 2024-06-01 16:9 4k 8K 1080p 0.5 -3 +7 1e-4 #42"),
    ("plain/version", "stable diffusion v1.5 sd1.5 sdxl_1.0 v2-1_768-ema-pruned.safetensors"),
    ("plain/url", "https://example.com/path?q=a+b&x=1#frag user@example.org"),
    ("plain/code", "def f(x): return x**2 if x > 0 else -x  # comment"),
    ("plain/path", "C:\\Users\\me\\Pictures\\img_001.png /home/me/data/10_cat/a.jpg"),
    # Contractions.
    ("contraction/basic", "don't can't won't it's I'm we'll they've you're he'd she's"),
    ("contraction/upper", "DON'T IT'S I'M WE'LL THEY'VE YOU'RE HE'D"),
    ("contraction/odd", "rock'n'roll o'clock 'tis y'all ma'am '90s 'S 'T 'Re 'LL 'd 'x ''s"),
    ("contraction/long_s", "it'\u017f the '\u017f <|\u017ftartoftext|> '\u017ft"),
    ("contraction/curly", "don\u2019t it\u2019s \u2018quoted\u2019 \u201cdouble\u201d "
     "\u201bodd\u201f \u02bcmodifier"),
    ("contraction/alone", "' '' ''' 's 't 're 've 'm 'll 'd"),
    # Weighting syntax (A1111, kohya, NovelAI, ComfyUI).
    ("weight/a1111", "(masterpiece:1.2), (best quality:1.1), [bad hands], ((detailed eyes)), "
     "[[blurry]], {{best quality}}, {{{absurdres}}}"),
    ("weight/lora", "<lora:foo:0.8> <lora:my_style-v2:1> <lyco:bar:0.5:0.3> <hypernet:x:1>, "
     "a cat BREAK a dog BREAK"),
    ("weight/escapes", "\\(parentheses\\) \\[brackets\\] a \\\\ b (tag:1.5)(other:.5)"),
    ("weight/alternation", "[cat|dog] [cow:horse:0.5] [from:to:10] (a AND b) a : 1.2"),
    ("weight/embedding", "embedding:EasyNegative, (embedding:bad_prompt_version2:0.8)"),
    ("weight/break_runs", "BREAK BREAKBREAK break Break, BREAK,BREAK"),
    # Punctuation runs.
    ("punct/runs", "!!! ??? ... ,,, ;;; ::: --- ___ *** ### $$$ %%% ^^^ &&& ||| ~~~ ``` @@@"),
    ("punct/mixed", "wow!!!?!? ...and... --> <-- <=> =/= !== (((( )))) [[[ ]]] {{{ }}}"),
    ("punct/emoticons", ":) :( :D ;) :-P xD <3 </3 ^^ T_T o_O \\o/ (\u256f\u00b0\u25a1\u00b0)"
     "\u256f\ufe35 \u253b\u2501\u253b \u00af\\_(\u30c4)_/\u00af"),
    ("punct/unicode", "\u2014 \u2013 \u2026 \u00ab\u00bb \u2039\u203a \u00a1\u00bf \u00b7 "
     "\u2022 \u2020\u2021 \u00a7\u00b6 \u00a9\u00ae\u2122 \u00b0 \u2030 \u2032\u2033"),
    ("punct/math", "\u2211 \u221a2 \u2248 \u2260 \u2264 \u2265 \u00b1 \u00d7 \u00f7 \u221e "
     "\u2202 \u222b \u03c0r\u00b2 x\u00b3 H\u2082O \u00bd \u00bc \u2153"),
    ("punct/currency", "$100 \u20ac50 \u00a330 \u00a5500 \u20b91000 \u20a9 \u20bf \u00a2"),
    # Numbers in many scripts.
    ("number/scripts", "\u0663\u0664\u0665 \u06f1\u06f2 \u0967\u0968\u0969 \u0e51\u0e52 "
     "\uff11\uff12\uff13 \u2160\u2161\u216b \u2460\u2461 \u00b2\u00b3 \u2070 \u3007\u4e00"),
    ("number/glued", "abc123def 1st 2nd 3rd 4th 100x 3d2d a1b2c3 x86_64 h264"),
    # Accents and Latin.
    ("latin/accents", "caf\u00e9 na\u00efve \u00c5ngstr\u00f6m cr\u00e8me br\u00fbl\u00e9e "
     "S\u00e3o Paulo Z\u00fcrich Ni\u00f1o \u0141\u00f3d\u017a \u0159\u00edzek \u00e6sir "
     "\u00f8l"),
    ("latin/german", "Stra\u00dfe STRASSE \u1e9e Gr\u00fc\u00dfe \u00c4rger \u00d6l \u00dcber"),
    ("latin/turkish", "\u0130stanbul \u0131\u015f\u0131k I\u011fd\u0131r \u0130I\u0131i"),
    ("latin/nfd", "cafe\u0301 na\u0308ive A\u030angstro\u0308m n\u0303 e\u0301\u0301 "
     "a\u0323\u0302 q\u0307\u0323"),
    ("latin/vietnamese", "Ti\u1ebfng Vi\u1ec7t ph\u1edf b\u00e1nh m\u00ec \u0111\u1eb9p"),
    ("latin/ipa", "\u0283\u0292\u014b\u0251\u0254\u0259\u025b\u026a\u028a \u02b0\u02b2 "
     "\u1d00\u1d07"),
    # Other scripts.
    ("script/greek", "\u039f\u0394\u039f\u03a3 \u03a3\u0399\u03a3\u03a5\u03a6\u039f\u03a3 "
     "\u0391\u0398\u0397\u039d\u0391 \u03a3 \u03a3\u03a3 \u03b1\u03a3. A\u03a3 \u0391\u03a3'"
     " \u03b1\u0345 \u1fb3 \u1f88 b\u0345c \u0345x"),
    ("script/cyrillic", "\u041c\u043e\u0441\u043a\u0432\u0430 \u041f\u0440\u0438\u0432\u0435"
     "\u0442, \u043c\u0438\u0440! \u0401\u0436 \u0406\u0457 \u0490"),
    ("script/arabic", "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644"
     "\u0645 \u0627\u0644\u0652\u0639\u064e\u0631\u064e\u0628\u0650\u064a\u064e\u0651\u0629"),
    ("script/hangul_jamo", "\u1100\u1161 \u1100\u1161\u11a8 \u1112\u1161\u11ab\u1100"
     "\u1173\u11af \uac00\u11a8 \u3131\u314f"),
    ("script/hebrew", "\u05e9\u05dc\u05d5\u05dd \u05e2\u05d5\u05dc\u05dd \u05d1\u05bc"),
    ("script/cjk", "\u4e2d\u6587\u63d0\u793a\u8bcd \u65e5\u672c\u8a9e\u306e\u30d7\u30ed\u30f3"
     "\u30d7\u30c8 \u3072\u3089\u304c\u306a \u30ab\u30bf\u30ab\u30ca \ud55c\uad6d\uc5b4 "
     "\u7f8e\u5c11\u5973\u3001\u9ed2\u9aea\u3002"),
    ("script/cjk_ext", "\U00020000\U0002a6d6 \U00030000 \u9fff \u3400 \uf900 \U0002f800"),
    ("script/indic", "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f"
     "\u093e \u0bb5\u0ba3\u0b95\u0bcd\u0b95\u0bae\u0bcd \u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35"),
    ("script/misc", "\u10e5\u10d0\u10e0\u10d7\u10e3\u10da\u10d8 \u0540\u0561\u0575\u0565"
     "\u0580\u0565\u0576 \u12a0\u121b\u122d\u129b \u1780\u1798\u17d2\u1796\u17bb\u1787\u17b6"),
    # Emoji.
    ("emoji/basic", "\U0001f600 \U0001f431 \U0001f525\U0001f525\U0001f525 \u2764 \u2764\ufe0f "
     "\u2b50 \U0001f308"),
    ("emoji/zwj", "\U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466 "
     "\U0001f3f3\ufe0f\u200d\U0001f308 \U0001f9d1\u200d\U0001f4bb \U0001f441\ufe0f\u200d"
     "\U0001f5e8\ufe0f"),
    ("emoji/modifiers", "\U0001f44d\U0001f3fd \U0001f44b\U0001f3ff \U0001f9d1\U0001f3fb\u200d"
     "\U0001f91d\u200d\U0001f9d1\U0001f3fe"),
    ("emoji/flags", "\U0001f1ef\U0001f1f5 \U0001f1fa\U0001f1f8\U0001f1e9\U0001f1ea "
     "\U0001f3f4\U000e0067\U000e0062\U000e0077\U000e006c\U000e0073\U000e007f"),
    ("emoji/keycaps", "1\ufe0f\u20e3 #\ufe0f\u20e3 *\u20e3 \u00a9\ufe0f \u2122\ufe0f"),
    ("emoji/in_prompt", "a cute cat \U0001f431 sitting on a \U0001f6cb\ufe0f, cozy vibes \u2728"
     "\u2728, (\U0001f338:1.2)"),
    # Whitespace oddities.
    ("space/leading_trailing", "   leading and trailing   "),
    ("space/only", " \t\n\r  \u00a0\u3000 "),
    ("space/tabs_newlines", "line one\nline two\r\nline three\rline four\t\ttabbed"),
    ("space/unicode", "a\u00a0b\u2002c\u2003d\u2009e\u200af\u202fg\u205fh\u3000i\u1680j"),
    ("space/line_separators", "para\u2028next\u2029third\x85fourth\x0bfifth\x0csixth"),
    ("space/zero_width", "zero\u200bwidth\u200cnon\u200djoiner\u2060word\ufeffbom "
     "\u200e\u200f\u202a\u202e"),
    ("space/info_separators", "a\x1cb\x1dc\x1ed\x1fe"),
    # ftfy: HTML entities.
    ("html/basic", "Fish &amp; Chips &lt;3 &gt;_&lt; &quot;quoted&quot; &#39;single&#39; "
     "&apos; &nbsp;x"),
    ("html/named", "&hellip; &mdash; &ndash; &eacute;t&eacute; &copy; &reg; &trade; &deg; "
     "&frac12; &euro; &pound; &yen; &times; &divide; &hearts; &larr;&rarr; &alpha;&Omega;"),
    ("html/uppercase", "P&EACUTE;REZ BUNDESSTRA&SZLIG;E &ntilde; &Ntilde; &NTILDE; &nTILDE; "
     "&AMP; &Amp; &LT;"),
    ("html/numeric", "&#65;&#x42;&#X43; &#x1F600; &#128512; &#0; &#1; &#13; &#59; &#x3b; "
     "&#128; &#x85; &#x9f; &#xD800; &#1114112; &#99999999999; &#65a; &#x; &#xyz; &#;"),
    ("html/double", "&amp;amp; &amp;lt;b&amp;gt; &amp;#39; &amp;amp;amp;"),
    ("html/unknown", "&notanentity; &amp &lt &; &&amp; &#38;amp; AT&T R&D "
     "&abcdefghijklmnopqrstuvwxyz; &abcdefghijklmnopqrstuvwx;"),
    ("html/with_lt", "&lt;b&gt; bold < &amp; not unescaped"),
    ("html/lt_later_line", "first &amp; line\nsecond < line &amp;\nthird &amp; line"),
    ("html/lt_first_line", "< first\n&amp; later lines stay escaped"),
    ("html/special_tokens", "&lt;|endoftext|&gt; &lt;|startoftext|&gt;"),
    # ftfy: quotes, ligatures, width, controls.
    ("ftfy/quotes", "\u201cHello,\u201d she said, \u2018it\u2019s fine\u2019 \u201e\u201f "
     "\u201a\u201b \u2039not\u203a \u00abthese\u00bb \u300cnor\u300d"),
    ("ftfy/ligatures", "\ufb01ne \ufb02ow \ufb03ce \ufb04e \ufb05 \ufb06 \ufb00 \u0132\u0133 "
     "\u0149 \u01c4\u01c5\u01c6 \u01c7\u01c8\u01c9 \u01ca\u01cb\u01cc \u01f1\u01f2\u01f3 "
     "\u00e6 \u0153"),
    ("ftfy/fullwidth", "\uff2c\uff2f\uff35\uff24\u3000\uff2e\uff2f\uff29\uff33\uff25\uff33 "
     "\uff48\uff45\uff4c\uff4c\uff4f\uff01 \uff08\uff11\uff12\uff13\uff09 \uff3b\uff5c\uff3d "
     "\uff1c\uff5cendoftext\uff5c\uff1e"),
    ("ftfy/halfwidth", "\uff73\uff80\uff70\uff9d \uff76\uff9e \uffa1\uffa4 \uffe0\uffe1\uffe5"
     "\uffe6 \uffe8\uffe9\uffed"),
    ("ftfy/c1_controls", "a\x80b\x81c\x82d\x83e\x84f\x85g\x86h\x87i\x88j\x89k\x8al\x8bm\x8cn"
     "\x8do\x8ep\x8fq\x90r\x91s\x92t\x93u\x94v\x95w\x96x\x97y\x98z\x99A\x9aB\x9bC\x9cD\x9dE"
     "\x9eF\x9fG"),
    ("ftfy/c0_controls", "a\x00b\x01c\x02d\x07e\x08f\x0eg\x1bh\x7fi\u206aj\u206fk\ufff9l"
     "\ufffcm\ufffdn"),
    ("ftfy/terminal", "\x1b[36;44mblue text\x1b[0m \x1b[1mbold\x1b[22m \x1b[2J\x1b[H "
     "\x1b[38;5;196mred\x1b[m \x1b[\u0663mx \x1b[12;"),
    ("ftfy/nfc_compat", "\u212b \u2126 \u212a K \u00b5 \u1e9b\u0323 \u0958 \u2000 \u2001 "
     "\u2fcf \ufa10"),
    # Special tokens.
    ("special/bos_eos", "<|startoftext|>a photo<|endoftext|>"),
    ("special/inline", "a <|endoftext|> b <|startoftext|> c"),
    ("special/adjacent", "<|endoftext|><|endoftext|><|startoftext|><|startoftext|>"),
    ("special/upper", "<|STARTOFTEXT|> <|EndOfText|> <|endoftext|>"),
    ("special/partial", "<|endoftext <|endoftext| <|endof text|> <| endoftext |> <|<|endoftext|>"
     " <|endoftext|<|endoftext|> endoftext|> <|startoftext"),
    ("special/html_split", "a &amp; <|endoftext|> b &amp; c <|startoftext|> &lt;|endoftext|&gt;"),
    ("special/ftfy_split", "\u201cq\u201d<|endoftext|>\u201cq\u201d \ufb01<|startoftext|>\ufb01"),
    ("special/spaces", "  <|endoftext|>  <|startoftext|>\n<|endoftext|>\t"),
    # Long prompts (more below, generated).
    ("long/lorem", " ".join(["Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do "
                             "eiusmod tempor incididunt ut labore et dolore magna aliqua."] * 20)),
    ("long/no_spaces", "a" * 500 + "b" * 300 + "\u00e9" * 100),
    ("long/one_token_repeated", " ".join(["cat"] * 400)),
    # A1111 attention syntax (what --weighted_captions reads; every case is also tokenized
    # weighted, these are the ones whose weights are not all 1).
    ("weights/documented", "a (((house:1.3)) [on] a (hill:0.5), sun, (((sky)))."),
    ("weights/booru", "(masterpiece:1.2), (best quality), 1girl, [blurry], (red hair:1.4), "
     "((blue eyes)), [[lowres]], (smile:0.8)"),
    ("weights/escapes", "\\(literal\\] a \\\\ b (unbalanced [open"),
    ("weights/glued", "(red)(blue)cat(dog:1.5)fish[x]"),
    ("weights/negative", "(ugly:-0.5) (odd:+1.25) (zero:0) (tiny:.5)"),
    # Weighted tags across the 75- and 150-token chunk boundaries.
    ("weights/long", ", ".join(f"({TAG}:1.{i % 9 + 1})" if i % 3 else f"[{TAG}]"
                               for i, TAG in enumerate(["scarlet cloak", "tall tower",
                                                        "green field"] * 30))),
]

TAGS = [
    "1girl", "1boy", "solo", "long hair", "short hair", "blonde hair", "silver hair", "red eyes",
    "blue eyes", "smile", "open mouth", "blush", "looking at viewer", "upper body", "full body",
    "school uniform", "kimono", "armor", "hoodie", "glasses", "hat", "outdoors", "indoors",
    "night", "sunset", "city", "forest", "beach", "rain", "snow", "cherry blossoms", "sky",
    "clouds", "masterpiece", "best quality", "highres", "absurdres", "ultra detailed",
    "8k wallpaper", "photorealistic", "raw photo", "cinematic lighting", "volumetric fog",
    "depth of field", "bokeh", "film grain", "studio ghibli style", "oil painting",
    "watercolor", "concept art", "trending on artstation", "by greg rutkowski", "octane render",
    "unreal engine 5", "sharp focus", "intricate details", "dramatic pose", "dynamic angle",
    "from above", "from below", "close-up", "wide shot", "hands on hips", "holding sword",
    "cat ears", "animal ears", "tail", "wings", "halo", "bad anatomy", "bad hands",
    "extra fingers", "lowres", "worst quality", "jpeg artifacts", "watermark", "signature",
    "text", "blurry", "deformed", "mutated", "sks person", "ohwx woman", "zwx style",
    "looking_at_viewer", "thighhighs", "white_background", "simple_background", ":d", ";)",
    "^_^", "o_o", "x x", "@_@", "0_0",
]

WORDS_NATURAL = [
    "a", "the", "an", "of", "in", "on", "with", "and", "photo", "painting", "portrait",
    "landscape", "beautiful", "old", "young", "woman", "man", "dog", "cat", "castle", "mountain",
    "river", "ancient", "futuristic", "neon", "glowing", "misty", "vibrant", "detailed",
    "highly", "intricate", "elegant", "epic", "serene", "dark", "bright", "colorful", "golden",
    "silver", "wooden", "stone", "glass", "crystal", "dragon", "knight", "wizard", "robot",
    "spaceship", "garden", "street", "cafe", "library", "ocean", "desert", "jungle", "tower",
    "bridge", "lantern", "candle", "mirror", "reflection", "shadow", "light", "dawn", "dusk",
    "it's", "don't", "we're", "they'll", "I've", "she'd", "who's",
]

WORDS_UNICODE = [
    "caf\u00e9", "na\u00efve", "fa\u00e7ade", "\u00fcber", "ma\u00f1ana", "co\u00f6perate",
    "\u00e5sk\u00e5dare", "\u017c\u00f3\u0142w", "\u0161\u010d\u0159", "\u00f0\u00fe",
    "\u041f\u0440\u0438\u0432\u0435\u0442", "\u043a\u043e\u0442", "\u0441\u043e\u0431\u0430"
    "\u043a\u0430", "\u0393\u03b5\u03b9\u03ac", "\u039a\u0391\u039b\u0397\u039c\u0395\u03a1"
    "\u0391", "\u03c3\u03bf\u03c6\u03af\u03b1\u03c2", "\u732b", "\u72ac", "\u6a31\u306e\u82b1",
    "\u304b\u308f\u3044\u3044", "\u30a2\u30cb\u30e1", "\uc0ac\ub791", "\u0645\u0631\u062d"
    "\u0628\u0627", "\u05e9\u05dc\u05d5\u05dd", "\u0928\u092e\u0938\u094d\u0924\u0947",
    "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35", "\U0001f600", "\U0001f431", "\u2728", "\u2764\ufe0f",
    "\U0001f468\u200d\U0001f469\u200d\U0001f467", "\U0001f44d\U0001f3fd", "\U0001f1ef\U0001f1f5",
    "\u201cquoted\u201d", "it\u2019s", "\ufb01ne", "\uff21\uff22\uff23", "&amp;", "&eacute;t",
    "\u00bd", "\u2163", "\u0663", "x\u00b2", "\u2014", "\u2026", "\u00a9", "\u00b0C",
]

PUNCT = list("!?.,;:-_*#$%^&|~`@/\\+=()[]{}<>'\"") + ["...", "!!", "?!", "--", "->", "=>"]

WEIGHT_WRAPPERS = [
    "{}", "({})", "(({}))", "((({})))", "[{}]", "[[{}]]", "{{{}}}", "{{{{{}}}}}", "({}:1.2)",
    "({}:0.8)", "({}:1.05)", "[{}:0.5]", "\\({}\\)", "{} BREAK", "<lora:{}:0.7>",
]

SPACES = [" ", " ", " ", "  ", "\t", "\n", "\u00a0", "\u3000", "\r\n", " \u2009", ""]


def random_tag_prompt(rng):
    tags = []
    for _ in range(rng.randint(1, 25)):
        tag = rng.choice(TAGS)
        if rng.random() < 0.35:
            tag = rng.choice(WEIGHT_WRAPPERS).format(tag.replace(" ", rng.choice([" ", "_"])))
        if rng.random() < 0.1:
            tag = tag.upper()
        tags.append(tag)
    sep = rng.choice([", ", ",", " ", ",  ", " , ", "\n"])
    return sep.join(tags)


def random_natural_prompt(rng, n_words):
    words = []
    for _ in range(n_words):
        r = rng.random()
        if r < 0.75:
            w = rng.choice(WORDS_NATURAL)
        elif r < 0.9:
            w = rng.choice(WORDS_UNICODE)
        else:
            w = rng.choice(PUNCT)
        if rng.random() < 0.05:
            w = w.capitalize()
        words.append(w)
    out = []
    for w in words:
        out.append(w)
        out.append(rng.choice(SPACES) if rng.random() < 0.2 else " ")
    return "".join(out)


def random_unicode_mix(rng):
    parts = []
    for _ in range(rng.randint(1, 12)):
        r = rng.random()
        if r < 0.5:
            parts.append(rng.choice(WORDS_UNICODE))
        elif r < 0.7:
            parts.append(rng.choice(WORDS_NATURAL))
        elif r < 0.85:
            parts.append("".join(rng.choice(PUNCT) for _ in range(rng.randint(1, 5))))
        else:
            parts.append(str(rng.randint(0, 10**rng.randint(1, 8))))
    return "".join(p + rng.choice(SPACES) for p in parts)


# Code point pools for character soup: real prompt characters, no arbitrary Latin-1 mixes (those
# are what ftfy's mojibake detector exists for; that path has its own explicit cases).
SOUP_POOLS = [
    [chr(c) for c in range(0x20, 0x7F)],
    [chr(c) for c in range(0x3040, 0x30FF)],
    [chr(c) for c in range(0x4E00, 0x4F00)],
    [chr(c) for c in range(0xAC00, 0xAD00)],
    [chr(c) for c in range(0x0400, 0x0460)],
    [chr(c) for c in range(0x0390, 0x03CF)],
    [chr(c) for c in range(0x0600, 0x064B)],
    [chr(c) for c in range(0x0300, 0x0316)],
    [chr(c) for c in range(0x1F300, 0x1F64F)],
    ["\u200d", "\ufe0f", "\u20e3", "\U0001f3fb", "\U0001f3ff"],
    [chr(c) for c in range(0x2010, 0x2030)],
    [chr(c) for c in range(0xFF01, 0xFF5F)],
    [chr(c) for c in range(0x2460, 0x2474)],
    [chr(c) for c in range(0x2190, 0x21A0)],
    [" ", "\t", "\n", "\u00a0", "\u3000"],
]


def random_soup(rng):
    pools = rng.sample(SOUP_POOLS, rng.randint(1, 4))
    return "".join(rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 60)))


MOJIBAKE = [
    # ftfy's fix_encoding repairs these; the C++ tokenizer leaves them as they are (listed in
    # kFtfyGaps of models/clip_tokenizer_test.cpp).
    ("mojibake/utf8_as_latin1", "caf\u00c3\u00a9 cr\u00c3\u00a8me br\u00c3\u00bbl\u00c3\u00a9e"),
    ("mojibake/utf8_as_cp1252", "\u00e2\u20ac\u0153smart quotes\u00e2\u20ac\u009d and "
     "\u00e2\u0153\u201d check"),
]


def make_cases(tokenizer):
    rng = random.Random(20240601)
    cases = list(HAND_WRITTEN) + list(MOJIBAKE)
    for i in range(60):
        cases.append((f"random/tags_{i}", random_tag_prompt(rng)))
    for i in range(40):
        cases.append((f"random/natural_{i}", random_natural_prompt(rng, rng.randint(3, 60))))
    for i in range(40):
        cases.append((f"random/unicode_{i}", random_unicode_mix(rng)))
    for i in range(40):
        cases.append((f"random/soup_{i}", random_soup(rng)))
    for i in range(8):
        cases.append((f"random/long_{i}", random_natural_prompt(rng, rng.randint(300, 700))))
    for i in range(4):
        cases.append((f"random/long_tags_{i}",
                      ", ".join(random_tag_prompt(rng) for _ in range(12))))
    # Prompts whose token count lands on the truncation and chunk boundaries of 77, 152 and 227.
    # The words are plain ASCII separated by spaces, so their token counts add up.
    for target in (74, 75, 76, 77, 149, 150, 151, 152, 224, 225, 226, 227, 300):
        words = []
        count = 0
        while count < target:
            words.append(rng.choice(WORDS_NATURAL + TAGS))
            count += len(tokenizer.encode(words[-1], add_special_tokens=False))
        text = " ".join(words)
        while len(tokenizer.encode(text, add_special_tokens=False)) > target:
            text = text[:-1]
        assert len(tokenizer.encode(text, add_special_tokens=False)) == target, target
        cases.append((f"boundary/{target}_tokens", text))
    return cases


def sweep_cases():
    """Every code point of planes 0 and 1 that Python's unicodedata (which ftfy's NFC and
    str.lower use) has assigned, in runs of 24 separated by spaces; then, one at a time, the
    code points the regex module classifies as letters or numbers but unicodedata does not
    know."""
    known = [c for c in range(0x20000) if not 0xD800 <= c <= 0xDFFF
             and unicodedata.category(chr(c)) != "Cn"]
    cases = []
    per_case = 24 * 64
    for start in range(0, len(known), per_case):
        chunk = known[start:start + per_case]
        runs = ["".join(chr(c) for c in chunk[i:i + 24]) for i in range(0, len(chunk), 24)]
        cases.append((f"sweep/U+{chunk[0]:04X}", " ".join(runs)))
    ln = regex.compile(r"[\p{L}\p{N}]")
    newer = [c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF
             and unicodedata.category(chr(c)) == "Cn" and ln.match(chr(c))]
    for start in range(0, len(newer), 1024):
        chunk = newer[start:start + 1024]
        cases.append((f"sweep/newer_U+{chunk[0]:04X}", " ".join(chr(c) for c in chunk)))
    return cases


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    logging.getLogger("transformers").setLevel(logging.ERROR)  # "sequence longer than 77"

    # Found without importing open_clip (which imports torch and takes seconds).
    open_clip_dir = importlib.util.find_spec("open_clip").submodule_search_locations[0]
    gz_path = os.path.join(open_clip_dir, "bpe_simple_vocab_16e6.txt.gz")
    vocab_file, merges_file = write_tokenizer_files(gz_path, os.path.join(out_dir, "tokenizer"))
    tokenizer = CLIPTokenizer(vocab_file, merges_file, model_max_length=MODEL_MAX_LENGTH)
    assert tokenizer.fix_text is ftfy.fix_text, "transformers did not pick up ftfy"
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    # The same tokenizer with ftfy's mojibake repair (fix_encoding) switched off: the subset of
    # ftfy that the C++ tokenizer implements.
    # SDXL's tokenizer_2 as kohya's strategy_sdxl sets it: the same vocabulary, padding with id 0
    # ("!") by pad_token_id alone, so a "!" in a caption stays text for BPE, as open_clip reads it
    # (diffusers' pad_token="!" would split it out as a special token).
    tokenizer_2 = CLIPTokenizer(vocab_file, merges_file, model_max_length=MODEL_MAX_LENGTH)
    tokenizer_2.pad_token_id = 0
    assert tokenizer_2.pad_token_id == 0
    assert tokenizer_2("wow!!").input_ids[2] != 0, "a caption's '!' must stay text"
    subset = CLIPTokenizer(vocab_file, merges_file, model_max_length=MODEL_MAX_LENGTH)
    subset.fix_text = functools.partial(ftfy.fix_text, fix_encoding=False)

    cases = []
    names = set()
    for name, text in make_cases(tokenizer):
        assert name not in names, name
        names.add(name)
        ids = tokenizer.encode(text, add_special_tokens=False)
        case = {
            "name": name,
            "text": text,
            "ids": ids,
            "fixed_text": ftfy.fix_text(text, fix_encoding=False),
            "padded_77": tokenizer(text, padding="max_length", truncation=True,
                                   max_length=MODEL_MAX_LENGTH).input_ids,
            "long_150": kohya_get_input_ids(tokenizer, text, 150),
            "long_225": kohya_get_input_ids(tokenizer, text, 225),
            "sdxl2_77": tokenizer_2(text, padding="max_length", truncation=True,
                                    max_length=MODEL_MAX_LENGTH).input_ids,
            "sdxl2_150": kohya_get_input_ids(tokenizer_2, text, 150),
            "sdxl2_225": kohya_get_input_ids(tokenizer_2, text, 225),
        }
        for length in (75, 150, 225):
            try:
                ids_w, weights = kohya_weighted_input_ids(tokenizer, text, length)
                case[f"weighted_{length}"] = {"ids": ids_w, "weights": weights}
            except ValueError:  # float() of a weight like "1.2.3": kohya stops there too
                case[f"weighted_{length}"] = None
        subset_ids = subset.encode(text, add_special_tokens=False)
        case["ftfy_gap"] = subset_ids != ids
        if case["ftfy_gap"]:
            case["ids_without_fix_encoding"] = subset_ids
        cases.append(case)

    sweep = [{"name": name, "text": text, "ids": subset.encode(text, add_special_tokens=False)}
             for name, text in sweep_cases()]

    reference = {
        "generator": "models/reference/clip_tokenizer_reference.py",
        "versions": {"transformers": transformers.__version__, "ftfy": ftfy.__version__,
                     "regex": regex.__version__,
                     "open_clip_torch": importlib.metadata.version("open_clip_torch"),
                     "python": sys.version.split()[0]},
        "vocab_gz": gz_path,
        "vocab_size": tokenizer.vocab_size,
        "bos": tokenizer.bos_token_id,
        "eos": tokenizer.eos_token_id,
        "pad": tokenizer.pad_token_id,
        "cases": cases,
        "sweep": sweep,
    }
    with open(os.path.join(out_dir, "reference.json"), "w", encoding="utf-8") as f:
        json.dump(reference, f, ensure_ascii=True)
    print(f"{len(cases)} cases ({sum(c['ftfy_gap'] for c in cases)} ftfy gaps), "
          f"{len(sweep)} sweep cases -> {out_dir}")


if __name__ == "__main__":
    main()
