"""v12 - structured output: a state machine that says which tokens may come next (card 17).

A request may carry a *constraint*: its completion must be one of a list of strings
(``choice``) or must match a small regular expression (``regex``). The engine cannot ask
the model to comply; it can only forbid. Each step, for each constrained request, the
machine gives a boolean mask over the vocabulary - the tokens that keep a match possible -
and every other token's logit becomes ``-inf`` before temperature and top-k, so sampling
renormalises over the allowed tokens and can never leave the language.

Three layers, smallest first:

1. **characters.** ``parse_regex`` turns a pattern into an NFA over characters (Thompson's
   construction: every piece of the pattern is a fragment with one entry and one exit,
   glued with epsilon edges). A *state* of the machine is the set of NFA states the text so
   far can be in (``CharFSM.start``, ``CharFSM.walk``); the empty set means "no match is
   possible any more", and a set holding the final state means "the text so far matches".
   A ``choice`` is compiled as the alternation of its strings, taken literally.
2. **tokens.** A token is a *string* of the vocabulary (``TOY_VOCAB``: single characters and
   a few multi-character pieces such as ``"green"`` or ``"ue"``). A token is allowed iff
   walking all its characters from the current state leaves a non-empty set. EOS has no
   characters: it is allowed iff the current state is accepting, and it ends the request.
3. **one request.** ``Grammar`` holds a request's current state and the history of states
   before it, so it can ``accept_tokens`` (advance), ``validate_tokens`` (how many of some
   proposed tokens it would accept, without moving), ``rollback`` (undo the last n) and
   ``fill_bitmask`` (write the mask of its current state). It ``is_terminated`` after EOS,
   or when the text matches and nothing can follow (``"blue"`` against red|green|blue):
   then the request is finished without spending a step on a forced EOS.

These are the method names of vLLM's ``StructuredOutputGrammar``
(``vllm/v1/structured_output/backend_types.py``); there a library (xgrammar, llguidance)
compiles JSON schemas and grammars over a real tokenizer's bytes and packs the mask into
32 tokens per int32. Here it is plain Python over 64 toy strings, so the whole idea fits
on a page.

The regex subset (document of record; anything else is a ``ValueError``):

- a literal character: anything except ``\\ ( ) [ ] | * + ?``; ``\\c`` is ``c`` literally;
- a class ``[abc]``, ``[0-9]``, ``[a-z0-9-]`` (ranges by code point; ``-`` first or last
  is literal; no negation);
- ``(...)`` grouping; ``|`` alternation (an empty branch matches the empty string);
- ``?`` (zero or one), ``*`` (zero or more), ``+`` (one or more) after an atom.

The whole completion must match (``re.fullmatch`` semantics). Every character a pattern
can require must be a one-character token of the vocabulary, so a match can always be
finished token by token; ``compile_grammar`` checks that.

In a speculative verify pass (v11) each of the k + 1 rows needs the mask of the state
*after* the drafts before it: ``grammar_bitmask`` advances the machine through the drafts
while it fills the rows, then rolls it back - drafts are guesses, and the machine may
only ever hold the request's accepted tokens between steps.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

# The toy tokenizer's vocabulary: token id -> its text. Id 0 is EOS (no text).
TOY_VOCAB: tuple[str | None, ...] = (
    None,
    *"0123456789",
    *"abcdefghijklmnopqrstuvwxyz",
    " ", "-", ".", ",", ":", "@",
    "yes", "no", "ye", "red", "re", "ed", "green", "gr", "een", "blue", "bl", "ue",
    "00", "10", "19", "20", "25", "-0", "-1", ".5", "ok",
)
EOS_TOKEN_ID = 0

_SPECIAL = set("\\()[]|*+?")


def detokenize(token_ids: Seq[int], vocab: Seq[str | None] = TOY_VOCAB) -> str:
    """The text of some token ids; EOS (and any other text-less token) adds nothing."""
    return "".join(vocab[t] or "" for t in token_ids)


class CharFSM:
    """An NFA over characters: ``edges[s]`` = [(characters, next state)], ``eps[s]`` = [next states]."""

    def __init__(self) -> None:
        self.edges: list[list[tuple[frozenset[str], int]]] = []
        self.eps: list[list[int]] = []
        self.start_state = 0
        self.final_state = 0

    def new_state(self) -> int:
        self.edges.append([])
        self.eps.append([])
        return len(self.edges) - 1

    def closure(self, states: set[int]) -> frozenset[int]:
        """Every state reachable from ``states`` by epsilon edges alone (them included)."""
        stack, seen = list(states), set(states)
        while stack:
            for nxt in self.eps[stack.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        return frozenset(seen)

    @property
    def start(self) -> frozenset[int]:
        return self.closure({self.start_state})

    def walk(self, states: frozenset[int], text: str) -> frozenset[int]:
        """The state after reading ``text`` from ``states``: follow each character's edges,
        then close over epsilon edges. The empty set once no edge takes a character."""
        for char in text:
            if not states:
                break
            states = self.closure({nxt for s in states for chars, nxt in self.edges[s] if char in chars})
        return states

    def accepts(self, states: frozenset[int]) -> bool:
        return self.final_state in states


class _Parser:
    """Recursive descent over the regex subset, building Thompson fragments (entry, exit)."""

    def __init__(self, pattern: str, fsm: CharFSM) -> None:
        self.pattern, self.pos, self.fsm = pattern, 0, fsm

    def error(self, what: str) -> ValueError:
        return ValueError(f"regex {self.pattern!r}: {what} at position {self.pos}")

    def peek(self) -> str | None:
        return self.pattern[self.pos] if self.pos < len(self.pattern) else None

    def alternation(self) -> tuple[int, int]:
        branches = [self.sequence()]
        while self.peek() == "|":
            self.pos += 1
            branches.append(self.sequence())
        if len(branches) == 1:
            return branches[0]
        entry, exit_ = self.fsm.new_state(), self.fsm.new_state()
        for start, end in branches:
            self.fsm.eps[entry].append(start)
            self.fsm.eps[end].append(exit_)
        return entry, exit_

    def sequence(self) -> tuple[int, int]:
        entry = exit_ = self.fsm.new_state()
        while self.peek() is not None and self.peek() not in "|)":
            start, end = self.repeat()
            self.fsm.eps[exit_].append(start)
            exit_ = end
        return entry, exit_

    def repeat(self) -> tuple[int, int]:
        start, end = self.atom()
        while self.peek() is not None and self.peek() in "?*+":
            op = self.pattern[self.pos]
            self.pos += 1
            entry, exit_ = self.fsm.new_state(), self.fsm.new_state()
            self.fsm.eps[entry].append(start)
            self.fsm.eps[end].append(exit_)
            if op in "?*":
                self.fsm.eps[entry].append(exit_)  # zero times
            if op in "*+":
                self.fsm.eps[end].append(start)  # once more
            start, end = entry, exit_
        return start, end

    def atom(self) -> tuple[int, int]:
        char = self.peek()
        if char is None or char in "?*+":
            raise self.error("expected a character, a class or a group")
        self.pos += 1
        if char == "(":
            fragment = self.alternation()
            if self.peek() != ")":
                raise self.error("missing ')'")
            self.pos += 1
            return fragment
        if char == "[":
            return self.edge(self.char_class())
        if char == "\\":
            if self.peek() is None:
                raise self.error("a pattern cannot end in '\\'")
            char = self.pattern[self.pos]
            self.pos += 1
        elif char in _SPECIAL:
            raise self.error(f"unexpected {char!r}")
        return self.edge(frozenset(char))

    def char_class(self) -> frozenset[str]:
        chars: set[str] = set()
        while self.peek() != "]":
            if self.peek() is None:
                raise self.error("missing ']'")
            low = self.pattern[self.pos]
            self.pos += 1
            if self.peek() == "-" and self.pos + 1 < len(self.pattern) and self.pattern[self.pos + 1] != "]":
                high = self.pattern[self.pos + 1]
                self.pos += 2
                if ord(high) < ord(low):
                    raise self.error(f"empty range {low}-{high}")
                chars.update(chr(c) for c in range(ord(low), ord(high) + 1))
            else:
                chars.add(low)
        self.pos += 1
        if not chars:
            raise self.error("empty class '[]'")
        return frozenset(chars)

    def edge(self, chars: frozenset[str]) -> tuple[int, int]:
        start, end = self.fsm.new_state(), self.fsm.new_state()
        self.fsm.edges[start].append((chars, end))
        return start, end


def parse_regex(pattern: str) -> CharFSM:
    """Compile a pattern of the subset above into a ``CharFSM`` (ValueError if malformed)."""
    fsm = CharFSM()
    parser = _Parser(pattern, fsm)
    fsm.start_state, fsm.final_state = parser.alternation()
    if parser.pos != len(pattern):
        raise parser.error("unbalanced ')'")
    return fsm


def choice_to_regex(choice: Seq[str]) -> str:
    """The alternation of ``choice``'s strings, each escaped so it is taken literally."""
    return "|".join("".join("\\" + c if c in _SPECIAL else c for c in option) for option in choice)


class Grammar:
    """One request's state machine over the vocabulary: advance, validate, roll back, mask.

    Invariant: ``num_processed_tokens == len(self._history) - 1``, and between engine steps it
    equals the number of tokens the request has generated - drafts never stay in it."""

    def __init__(self, fsm: CharFSM, vocab: Seq[str | None], eos_token_id: int) -> None:
        self.fsm = fsm
        self.vocab = tuple(vocab)
        self.eos_token_id = eos_token_id
        self._history: list[frozenset[int] | None] = [fsm.start]  # None: EOS was accepted
        self._masks: dict[frozenset[int] | None, torch.Tensor] = {}  # state -> allowed tokens

    @property
    def state(self) -> frozenset[int] | None:
        return self._history[-1]

    @property
    def num_processed_tokens(self) -> int:
        return len(self._history) - 1

    def next_state(self, state: frozenset[int] | None, token_id: int) -> frozenset[int] | None:
        """Where ``token_id`` takes the machine from ``state``; the empty set if it is not allowed."""
        if state is None:
            return frozenset()  # nothing follows EOS
        if token_id == self.eos_token_id:
            return None if self.fsm.accepts(state) else frozenset()
        text = self.vocab[token_id]
        return self.fsm.walk(state, text) if text else frozenset()

    def allowed(self, state: frozenset[int] | None) -> torch.Tensor:
        """The tokens allowed in ``state``, a bool mask (V,). A terminated machine allows only EOS,
        so a row that is never sampled from still has a token to put its probability on."""
        if state not in self._masks:
            mask = torch.tensor([state is not None and self.next_state(state, t) != frozenset()
                                 for t in range(len(self.vocab))])  # (V,)
            if not mask.any():
                mask[self.eos_token_id] = True
            self._masks[state] = mask
        return self._masks[state]

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the current state's allowed tokens into ``bitmask[row]`` ((R, V) bool)."""
        bitmask[row] = self.allowed(self.state)

    def accept_tokens(self, token_ids: Seq[int]) -> bool:
        """Advance through ``token_ids``; if any is not allowed, undo this call and return False."""
        for i, token_id in enumerate(token_ids):
            state = self.next_state(self.state, token_id)
            if state == frozenset():
                self.rollback(i)
                return False
            self._history.append(state)
        return True

    def validate_tokens(self, token_ids: Seq[int]) -> list[int]:
        """The longest prefix of ``token_ids`` the machine would accept. The state does not move."""
        valid, state = [], self.state
        for token_id in token_ids:
            state = self.next_state(state, token_id)
            if state == frozenset():
                break
            valid.append(token_id)
        return valid

    def rollback(self, num_tokens: int) -> None:
        """Forget the last ``num_tokens`` accepted tokens."""
        if not 0 <= num_tokens <= self.num_processed_tokens:
            raise ValueError(f"cannot roll back {num_tokens} of {self.num_processed_tokens} tokens")
        del self._history[len(self._history) - num_tokens:]

    def is_terminated(self) -> bool:
        """After EOS, or when the text matches and no token can extend it."""
        state = self.state
        if state is None:
            return True
        allowed = self.allowed(state)
        return self.fsm.accepts(state) and int(allowed.sum()) == 1 and bool(allowed[self.eos_token_id])


def compile_grammar(choice: Seq[str] | None, regex: str | None, vocab: Seq[str | None] = TOY_VOCAB,
                    eos_token_id: int = EOS_TOKEN_ID) -> Grammar:
    """A fresh ``Grammar`` for a ``choice`` list or a ``regex`` (exactly one of them)."""
    if (choice is None) == (regex is None):
        raise ValueError("give exactly one of choice and regex")
    fsm = parse_regex(choice_to_regex(choice) if choice is not None else regex)
    singles = {text for text in vocab if text is not None and len(text) == 1}
    for edges in fsm.edges:
        for chars, _ in edges:  # each edge must be crossable by a one-character token
            if not chars & singles:
                raise ValueError(f"{'choice' if regex is None else 'regex'} needs one of {sorted(chars)}, "
                                 "which have no token of their own in the vocabulary")
    return Grammar(fsm, vocab, eos_token_id)


def grammar_bitmask(seqs: Seq, is_prefill: bool) -> torch.Tensor | None:
    """The allowed-token mask of every logits row of a step, (R, V) bool; None if no request is constrained.

    A prefill has one row per sequence; a verify pass k + 1 (its drafts, then the bonus row).
    Row i of a sequence is the mask after its drafts 1..i: advance through each draft, fill
    the next row, and roll every draft back at the end. Unconstrained rows allow everything."""
    grammars = [seq.grammar for seq in seqs if seq.grammar is not None]
    if not grammars:
        return None
    vocab_size = len(grammars[0].vocab)
    rows = [1 if is_prefill else len(seq.draft_token_ids) + 1 for seq in seqs]
    bitmask = torch.ones(sum(rows), vocab_size, dtype=torch.bool)  # (R, V)
    row = 0
    for seq, num_rows in zip(seqs, rows):
        grammar = seq.grammar
        if grammar is not None:
            drafts = [] if is_prefill else seq.draft_token_ids
            for i in range(num_rows):
                grammar.fill_bitmask(bitmask, row + i)
                if i < len(drafts) and not grammar.accept_tokens([drafts[i]]):
                    raise RuntimeError(f"seq {seq.seq_id}: draft {drafts[i]} was not validated")
            grammar.rollback(len(drafts))
        row += num_rows
    return bitmask


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor | None) -> torch.Tensor:
    """Forbidden tokens' logits to -inf, before temperature and top-k. logits (R, V), bitmask (R, V) bool."""
    if bitmask is None:
        return logits
    if bitmask.shape != logits.shape:
        raise ValueError(f"bitmask {tuple(bitmask.shape)} does not fit logits {tuple(logits.shape)}")
    return logits.masked_fill(~bitmask, float("-inf"))  # (R, V)
