"""Tokens as chips, byte-level tokens included (chapter 1).

SmolLM2's tokenizer, like GPT-2's and Llama-3's, is a *byte-level* BPE: its vocabulary is
built on top of the 256 possible byte values of UTF-8 text, so it can write any text at
all. Frequent byte sequences ("the", " Paris") were merged into single tokens during
training; a character that never earned a token of its own (many Korean syllables, most
emoji) is written as several tokens that each carry part of its 2-4 UTF-8 bytes. Such a
token is not a whole character: decoded on its own it prints as '�' (U+FFFD, "not valid
text"), which is what a naive chip shows.

``token_pieces`` gives each token the bytes it stands for and groups consecutive tokens
into the smallest runs that spell whole characters; ``render_token_chips`` shows a byte
token as its bytes in hexadecimal, with the character its group spells under the group and
one explanation line whenever byte tokens appear. ``TokenEditor`` is the live text box.
"""

from __future__ import annotations

import functools
import html
import re
from dataclasses import dataclass

import ipywidgets as W

from translations import tr

#: Light chip colours, one per token in turn.
CHIP_COLOURS = ("#dbeafe", "#fde68a", "#bbf7d0", "#fbcfe8", "#ddd6fe", "#fed7aa", "#a5f3fc")


@dataclass(frozen=True)
class TokenPiece:
    """One token of a tokenized text, with the bytes it stands for."""

    token_id: int
    raw: bytes  # the UTF-8 bytes this token contributes to the text
    text: str | None  # ``raw`` as text when it is whole characters; None for a byte-level fragment
    group_text: str  # what the group of tokens this one belongs to spells
    group_start: int  # index of the group's first token
    group_size: int  # tokens in the group (1 for a token that is whole characters)
    special: bool  # a special token such as <|im_start|>

    @property
    def is_byte_fragment(self) -> bool:
        return self.text is None

    @property
    def hex(self) -> str:
        """The bytes as hexadecimal pairs: b'\\xec\\x95' -> 'EC 95'."""
        return " ".join(f"{b:02X}" for b in self.raw)


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's table from the printable stand-in characters of a byte-level vocabulary to bytes.

    Byte-level BPE vocabularies store each byte as a visible character (the printable
    ASCII and Latin-1 ones as themselves, the other 68 shifted above U+0100, so a space is
    'Ġ'). This is the table the Hugging Face ``tokenizers`` ByteLevel decoder inverts.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes = list(printable)
    shifted = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + shifted)
            shifted += 1
    return {chr(c): b for b, c in zip(printable, codes)}


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The bytes ``token_id`` stands for, read from the tokenizer's vocabulary."""
    piece = tokenizer.convert_ids_to_tokens(int(token_id))
    fallback = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece or "")  # SentencePiece's byte fallback tokens
    if fallback:
        return bytes([int(fallback.group(1), 16)])
    table = _byte_decoder()
    if piece and all(ch in table for ch in piece):
        return bytes(table[ch] for ch in piece)
    # not a byte-level vocabulary entry (e.g. SentencePiece's '▁word'): its decoded text
    return tokenizer.decode([int(token_id)], skip_special_tokens=False).encode("utf-8")


def _whole_text(raw: bytes) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def token_pieces(tokenizer, token_ids: list[int], max_group: int = 8) -> list[TokenPiece]:
    """Every token with its bytes, grouped into the smallest runs that spell whole characters.

    A token whose bytes are whole characters is a group of one. Otherwise the following
    tokens join its group until the bytes decode (a UTF-8 character is at most 4 bytes, so
    a group rarely passes 4 tokens; ``max_group`` stops at broken input, shown with '\ufffd').
    """
    raws = [token_bytes(tokenizer, t) for t in token_ids]
    special = set(getattr(tokenizer, "all_special_ids", None) or ())
    pieces: list[TokenPiece] = []
    start = 0
    while start < len(raws):
        end, joined = start + 1, raws[start]
        while _whole_text(joined) is None and end < len(raws) and end - start < max_group:
            joined += raws[end]
            end += 1
        group_text = joined.decode("utf-8", errors="replace")
        for i in range(start, end):
            pieces.append(TokenPiece(int(token_ids[i]), raws[i], _whole_text(raws[i]), group_text, start,
                                     end - start, int(token_ids[i]) in special))
        start = end
    return pieces


def _visible(text: str) -> str:
    return text.replace(" ", "␣").replace("\n", "↵").replace("\t", "⇥")


def _fragment_label(raw: bytes) -> str:
    """Whole characters as text, the bytes of a partial character as hexadecimal:
    b' \\xec' -> '␣' then 'EC' (a space, then the first byte of a Korean syllable)."""
    parts, pending = [], []
    for ch in raw.decode("utf-8", errors="surrogateescape"):  # undecodable bytes -> U+DC80..U+DCFF
        if 0xDC80 <= ord(ch) <= 0xDCFF:
            pending.append(ord(ch) - 0xDC00)
            continue
        if pending:
            parts.append(f"<span class='ne-token-bytes'>{' '.join(f'{b:02X}' for b in pending)}</span>")
            pending = []
        parts.append(html.escape(_visible(ch)))
    if pending:
        parts.append(f"<span class='ne-token-bytes'>{' '.join(f'{b:02X}' for b in pending)}</span>")
    return "".join(parts)


def _chip(piece: TokenPiece, index: int) -> str:
    colour = CHIP_COLOURS[index % len(CHIP_COLOURS)]
    if piece.is_byte_fragment:
        label = _fragment_label(piece.raw)
        border = "1px dashed #555"
        title = tr("token {id}: a byte-level token, the UTF-8 bytes {hex}; with the other {others} token(s) of "
                   "its group it spells '{text}'", id=piece.token_id, hex=piece.hex, others=piece.group_size - 1,
                   text=piece.group_text)
    else:
        label = html.escape(_visible(piece.text))
        border = "1px solid transparent"
        title = tr("token {id}: '{text}', UTF-8 bytes {hex}", id=piece.token_id, text=piece.text, hex=piece.hex)
    return (f"<span class='ne-token{' ne-byte-token' if piece.is_byte_fragment else ''}' "
            f"data-token='{piece.token_id}' title='{html.escape(title, quote=True)}' "
            f"style='display:inline-block;margin:2px;padding:2px 5px;border-radius:4px;border:{border};"
            f"background:{colour};font-family:monospace;font-size:14px;color:#111'>"
            f"{label}<sub style='color:#555;font-size:10px;margin-left:2px'>{piece.token_id}</sub></span>")


def render_token_chips(pieces: list[TokenPiece]) -> str:
    """Chips in a line; a group of byte tokens carries the character it spells underneath."""
    parts, i = [], 0
    while i < len(pieces):
        group = pieces[i:i + pieces[i].group_size]
        chips = "".join(_chip(p, i + k) for k, p in enumerate(group))
        if any(p.is_byte_fragment for p in group):
            spelled = html.escape(_visible(group[0].group_text))
            all_hex = " ".join(p.hex for p in group)
            parts.append(
                f"<span class='ne-byte-group' style='display:inline-flex;flex-direction:column;align-items:center;"
                f"vertical-align:top;margin:0 2px'><span>{chips}</span><span class='ne-byte-group-text' "
                f"style='font-size:11px;line-height:1.3;color:#333;border-top:1px solid #888;padding:0 4px'>"
                f"{all_hex} = <b style='font-size:14px'>{spelled}</b></span></span>")
        else:
            parts.append(chips)
        i += len(group)
    note = (f"<div class='ne-byte-note' style='font-size:12px;color:#444;max-width:900px;line-height:1.4;"
            f"margin-top:4px'>{_byte_token_note()}</div>" if any(p.is_byte_fragment for p in pieces) else "")
    return "<div class='ne-token-chips' style='line-height:2.2'>" + "".join(parts) + "</div>" + note


def _byte_token_note() -> str:
    """The explanation under chips that include byte-level tokens, in the notebook's language."""
    return tr(
        "Chips with a dashed border are <b>byte-level tokens</b>. This tokenizer's vocabulary is built on the "
        "256 byte values of UTF-8 text, so it can write any text; a character that has no token of its own "
        "(many Korean syllables, most emoji) is written as several tokens, each carrying some of the "
        "character's 2-4 UTF-8 bytes. Such a token is not a whole character (decoded alone it prints as "
        "U+FFFD, the question mark in a diamond), so its chip shows the bytes it stands for in hexadecimal, "
        "and the line under the group shows the character those bytes spell together.")


def token_chips(tokenizer, text: str) -> tuple[list[int], str]:
    """(token ids, chips HTML) for ``text``, through the same call the engine makes on a prompt."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids, render_token_chips(token_pieces(tokenizer, ids))


class TokenEditor(W.VBox):
    """A text box whose tokens are redrawn as chips while you type."""

    def __init__(self, tokenizer, text: str = "", description: str | None = None) -> None:
        self.tokenizer = tokenizer
        description = tr("sentence") if description is None else description
        self.box = W.Text(value=text, description=description, layout=W.Layout(width="95%"))
        self.view = W.HTML()
        self.box.observe(self.retokenize, names="value")
        super().__init__([self.box, self.view])
        self.add_class("ne-token-editor")
        self.retokenize()

    def retokenize(self, _=None) -> None:
        text = self.box.value
        if not text:
            self.view.value = f"<div style='color:#555'>{tr('type some text: 0 tokens')}</div>"
            return
        ids, chips = token_chips(self.tokenizer, text)
        count = tr("{chars} characters, {nbytes} UTF-8 bytes, {tokens} tokens", chars=len(text),
                   nbytes=len(text.encode("utf-8")), tokens=len(ids))
        self.view.value = chips + f"<div class='ne-token-count' style='color:#555'>{count}</div>"
