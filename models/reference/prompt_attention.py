"""The A1111 attention syntax as kohya sd-scripts reads it (parse_prompt_attention in
library/lpw_stable_diffusion.py and library/strategy_base.py): the references of the sampler's
prompt conditioning and of the trainer's --weighted_captions tokenization share it."""
import re

ATTENTION = re.compile(r"\\[()\[\]\\]|\\|\(|\[|:([+-]?[.\d]+)\)|\)|]|[^\\()\[\]:]+|:")


def prompt_attention(text):
    """The attention syntax as kohya's lpw_stable_diffusion.parse_prompt_attention reads it:
    (x) x1.1, [x] /1.1, (x:w) xw, backslash escapes; open brackets weigh the rest; equal
    neighbours joined. Pairs [text, weight]."""
    pieces, round_open, square_open = [], [], []

    def scale(start, factor):
        for piece in pieces[start:]:
            piece[1] *= factor

    for m in ATTENTION.finditer(text):
        token, weight = m.group(0), m.group(1)
        if token.startswith("\\"):
            pieces.append([token[1:], 1.0])
        elif token == "(":
            round_open.append(len(pieces))
        elif token == "[":
            square_open.append(len(pieces))
        elif weight is not None and round_open:
            scale(round_open.pop(), float(weight))
        elif token == ")" and round_open:
            scale(round_open.pop(), 1.1)
        elif token == "]" and square_open:
            scale(square_open.pop(), 1 / 1.1)
        else:
            pieces.append([token, 1.0])
    for start in round_open:
        scale(start, 1.1)
    for start in square_open:
        scale(start, 1 / 1.1)
    joined = []
    for piece in pieces or [["", 1.0]]:
        if joined and joined[-1][1] == piece[1]:
            joined[-1][0] += piece[0]
        else:
            joined.append(piece)
    return joined
