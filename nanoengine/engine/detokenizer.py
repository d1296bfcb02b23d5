"""Incremental detokenization: token ids -> text deltas for streaming (chapter 12).

A byte-level BPE token may hold half of a multi-byte UTF-8 character, so decoding one token at a
time would print broken characters, and decoding the whole output every step costs ever more. So
the detokenizer decodes a *window*: the tokens since ``prefix_offset``, compared with the same
window without the unread tokens (``prefix_offset:read_offset``); what the unread tokens add is the
new text, held while it ends in U+FFFD (an incomplete character). The few tokens of context keep
spacing right for tokenizers whose decoding of a token depends on what precedes it. vLLM's
detokenizer uses the same two offsets.

It also finds stop strings, cuts the text before them, and holds back a tail that could still grow
into one, so a stream never shows text that the final result drops: the deltas always concatenate
to the final text. A token that ends the request by its id (``stop_token_ids``) is counted but not
decoded, like a stop string (vLLM without ``include_stop_str_in_output``, an option nanoengine does
not have); its id stays in the output's ``token_ids``. EOS needs no such care: special tokens are
skipped when decoding.
"""

from __future__ import annotations

from typing import Callable

REPLACEMENT_CHAR = "\ufffd"

# decode(token ids, skip_special_tokens) -> text
Decoder = Callable[[list[int], bool], str]


def token_decoder(tokenizer) -> Decoder:
    """``tokenizer.decode`` without tokenization clean-up, made as cheap as it can be: for a Hugging Face
    fast tokenizer that decodes the library's own way (neither ``decode`` nor ``_decode`` replaced), the
    ``tokenizers`` library's Rust ``decode`` itself, since the Python around it costs more than it for a
    stream's few tokens per step (``results/README.md``)."""
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:  # no transformers: whatever this tokenizer is, ask it
        PreTrainedTokenizerFast = None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if PreTrainedTokenizerFast is not None and isinstance(tokenizer, PreTrainedTokenizerFast) \
            and getattr(tokenizer.decode, "__func__", None) is PreTrainedTokenizerFast.decode \
            and getattr(tokenizer._decode, "__func__", None) is PreTrainedTokenizerFast._decode \
            and backend is not None:
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.decode_ids: Decoder | None = None if tokenizer is None else token_decoder(tokenizer)
        self.stop = stop
        self.token_ids: list[int] = []
        self.decoded = ""  # the text of the tokens before read_offset (held-back tails included)
        self.prefix_offset = 0  # start of the decoding window
        self.read_offset = 0  # tokens before this are in ``decoded``
        self.text = ""  # everything emitted so far
        self.stop_hit: str | None = None
        self.flushed = False  # an update with finished=True has released everything held back
        self.stop_token_id: int | None = None  # the stop token that ended the text, seen but not decoded

    @property
    def num_tokens(self) -> int:
        """How many of the request's tokens this detokenizer has seen (a stop token included)."""
        return len(self.token_ids) + (0 if self.stop_token_id is None else 1)

    def update(self, new_token_ids: list[int], finished: bool, ends_on_stop_token: bool = False) -> str:
        """Add tokens; return the text delta that became safe to show. Sets ``stop_hit`` when a stop string
        appeared (the caller then ends the request). ``ends_on_stop_token``: the last new token is a stop
        token id, which ends the request: it is seen but left out of the text."""
        if ends_on_stop_token:
            if not new_token_ids or self.stop_token_id is not None:
                raise ValueError("ends_on_stop_token needs a new last token, and a request ends only once")
            *new_token_ids, self.stop_token_id = new_token_ids
        self.token_ids.extend(new_token_ids)
        self.flushed = self.flushed or finished
        if self.tokenizer is None:
            return ""
        full = self._decode_new(finished)
        visible = full
        search_from = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
        for stop in self.stop:
            index = full.find(stop, search_from)
            if index != -1 and (self.stop_hit is None or index < len(visible)):
                visible, self.stop_hit = full[:index], stop
        if not finished and self.stop_hit is None:
            visible = visible.rstrip(REPLACEMENT_CHAR)
            visible = visible[:len(visible) - self._partial_stop_len(visible)]
        if not visible.startswith(self.text):
            # The tokenizer re-rendered earlier text; keep what was already emitted.
            visible = self.text + visible[len(self.text):]
        delta = visible[len(self.text):]
        self.text += delta
        return delta

    def _decode_new(self, finished: bool) -> str:
        """``decoded`` extended by the unread tokens, decoding only the window since ``prefix_offset``."""
        if self.read_offset < len(self.token_ids):
            window = self.token_ids[self.prefix_offset:]
            before = self._decode(window[:self.read_offset - self.prefix_offset])
            after = self._decode(window)
            if finished or not after.endswith(REPLACEMENT_CHAR):  # else wait for the rest of a character
                self.decoded += after[len(before):]
                self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return self.decoded

    def _decode(self, token_ids: list[int]) -> str:
        return self.decode_ids(token_ids, True) if token_ids else ""

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:n]):
                    longest = max(longest, n)
                    break
        return longest
