"""v12 - the scheduler, deciding who gets KV-cache blocks, drafts, and what a constraint allows (cards 8-9, 12, 16-17).

Continuous batching as in v04 (prefill first, otherwise decode every running request),
plus memory: a request can only run if its KV has somewhere to go.

- **admission** (prefill) needs ``block_manager.can_allocate``: a free block for every
  ``block_size`` tokens of the request; ``allocate`` then fills its block table.
- **decode** needs ``can_append``: if the token about to be written starts a new block,
  one free block must exist; ``may_append`` takes it.
- if a running request cannot get its block, the scheduler **preempts** the newest
  running request: its blocks go back to the pool and it returns to the *front* of the
  waiting queue with all its tokens (prompt + generated so far). When it is admitted
  again its KV is recomputed by a prefill ("recompute" preemption, as in nano-vLLM and
  vLLM v1). Its output does not change; only work is repeated.
- ``postprocess`` returns a finished request's blocks immediately, so the next step can
  admit someone else.

New in v08: ``postprocess`` honours ``ignore_eos`` from the request's ``SamplingParams``.

New in v11, speculative decoding: when a decode step secures a running request's slot it
also asks the n-gram proposer for up to ``num_speculative_tokens`` drafts
(``propose_drafts``) and gives them slots; the runner verifies them in the same pass.
``postprocess`` then takes 1 to k+1 tokens per request: each one accepted
(``accept_token``) makes every token before it computed; after the last one,
``release_rejected_slots`` rolls the block table back to the request's own tokens and
hashes the blocks accepted drafts filled. So the invariant below holds again after every
step, whatever was rejected.

New in v12, structured output: the scheduler owns each constrained request's state machine
(vLLM's ``StructuredOutputManager`` sits beside its scheduler for the same reason: the
machine must follow exactly the tokens the scheduler accepts).
- ``get_grammar_bitmask``: after scheduling, the allowed-token mask of every logits row the
  runner will sample from (``structured_output.grammar_bitmask``);
- ``propose_drafts`` cuts the n-gram drafts to the prefix the machine accepts
  (``Grammar.validate_tokens``): a draft the constraint forbids could never be kept, so it
  is not worth a slot;
- ``postprocess`` advances the machine with each *accepted* token (``advance_grammar``), never
  with a draft, and finishes the request when the machine terminates. A sampled token the
  machine refuses means the mask was wrong: an engine bug, raised, not logged.

Invariant: a sequence is in exactly one of ``waiting`` / ``running``, or is finished; a
running sequence has ``num_computed_tokens == num_tokens - 1`` between steps, and holds
blocks for its computed tokens and at most one more for its last token's slot: between
``ceil(num_computed_tokens / block_size)`` and ``ceil(num_tokens / block_size)``; a
constrained one's grammar has processed exactly its completion tokens.
"""

from collections import deque
from dataclasses import dataclass

import torch

from block_manager import BlockManager
from ngram_proposer import propose_ngram
from sequence import Sequence, SequenceStatus
from structured_output import grammar_bitmask


@dataclass(frozen=True)
class ScheduledBatch:
    """The scheduler's decision for one step: which sequences, which kind, who was evicted."""

    seqs: tuple[Sequence, ...]
    is_prefill: bool
    preempted: tuple[Sequence, ...] = ()
    num_drafts_cut: tuple[int, ...] = ()  # per scheduled sequence: drafts its grammar refused


class Scheduler:
    """Chooses the batch for each step and applies each step's results."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 eos_token_id: int, num_speculative_tokens: int = 0, prompt_lookup_max: int = 3,
                 prompt_lookup_min: int = 1) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1, got "
                             f"{max_num_seqs} and {max_num_batched_tokens}")
        if num_speculative_tokens < 0 or not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError("need num_speculative_tokens >= 0 and 1 <= prompt_lookup_min <= prompt_lookup_max, "
                             f"got {num_speculative_tokens}, {prompt_lookup_min}, {prompt_lookup_max}")
        self.num_speculative_tokens = num_speculative_tokens  # k; 0 = plain decoding, as v09
        self.prompt_lookup_max, self.prompt_lookup_min = prompt_lookup_max, prompt_lookup_min
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_id = eos_token_id
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()

    def add(self, seq: Sequence) -> None:
        if len(seq) > self.max_num_batched_tokens:
            raise ValueError(f"prompt of {len(seq)} tokens can never fit the per-step budget "
                             f"max_num_batched_tokens={self.max_num_batched_tokens}")
        max_blocks = -(-(len(seq) + seq.max_tokens) // self.block_manager.block_size)
        if max_blocks > self.block_manager.num_blocks:
            # Otherwise the request could preempt itself forever.
            raise ValueError(f"request may need {max_blocks} blocks; the pool has "
                             f"{self.block_manager.num_blocks}")
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> ScheduledBatch:
        """Admit waiting requests for a prefill if any fit; otherwise decode all running."""
        scheduled: list[Sequence] = []
        num_batched_tokens = 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if (num_batched_tokens + len(seq) > self.max_num_batched_tokens
                    or not self.block_manager.can_allocate(seq)):
                break
            self.block_manager.allocate(seq)
            num_batched_tokens += len(seq)
            seq.status = SequenceStatus.RUNNING
            self.waiting.popleft()
            self.running.append(seq)
            scheduled.append(seq)
        if scheduled:
            return ScheduledBatch(tuple(scheduled), is_prefill=True)

        preempted: list[Sequence] = []
        num_drafts_cut: list[int] = []
        while self.running:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                victim = self.running.pop() if self.running else seq  # the newest request
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                self.block_manager.may_append(seq)
                num_drafts_cut.append(self.propose_drafts(seq))
                scheduled.append(seq)
        assert scheduled, "add() guarantees a lone request always fits"
        self.running.extend(scheduled)
        return ScheduledBatch(tuple(scheduled), is_prefill=False, preempted=tuple(preempted),
                              num_drafts_cut=tuple(num_drafts_cut))

    def propose_drafts(self, seq: Sequence) -> int:
        """Up to k drafts for a decoding request, each with a slot; as many as fit, maybe none.

        A verify pass emits one token more than it keeps drafts, so a request with r tokens
        left to generate gets at most r - 1 drafts. A constrained request keeps only the
        drafts its grammar accepts, in order (vLLM's ``validate_tokens``). Drafts never
        preempt anyone: if the pool cannot hold them all, fewer are verified. Returns how
        many drafts the grammar cut."""
        room = min(self.num_speculative_tokens, seq.max_tokens - seq.num_completion_tokens - 1)
        drafts = propose_ngram(seq.token_ids, max(room, 0), self.prompt_lookup_max, self.prompt_lookup_min)
        num_proposed = len(drafts)
        if seq.grammar is not None:
            drafts = seq.grammar.validate_tokens(drafts)
        num_cut = num_proposed - len(drafts)
        while drafts and not self.block_manager.can_append_drafts(seq, len(drafts)):
            drafts.pop()
        self.block_manager.append_draft_slots(seq, len(drafts))
        seq.draft_token_ids = drafts
        return num_cut

    def get_grammar_bitmask(self, batch: ScheduledBatch) -> torch.Tensor | None:
        """The mask of allowed tokens for every row the runner samples this step (R, V); None if
        no scheduled request is constrained."""
        return grammar_bitmask(batch.seqs, batch.is_prefill)

    def _preempt(self, seq: Sequence) -> None:
        """Evict: free the blocks, go back to the front of the queue, recompute later."""
        seq.status = SequenceStatus.WAITING
        self.block_manager.deallocate(seq)
        seq.num_computed_tokens = 0
        seq.draft_token_ids = []
        self.waiting.appendleft(seq)

    def accept_token(self, seq: Sequence, token_id: int) -> None:
        """One emitted token: every token before it now has valid KV, then it joins the request.

        After a prefill that is the whole prompt; after a verify pass, the input token and
        each draft kept before this one. The token itself is not computed yet: its KV is
        written when it is fed, next step."""
        seq.num_computed_tokens = len(seq)
        seq.append_token(token_id)

    def release_rejected_slots(self, seq: Sequence) -> None:
        """After a step: drop the blocks past the request's tokens, hash the blocks now computed.

        The rejected drafts' KV lies at positions >= num_computed_tokens: in blocks that go
        back to the pool, or in the last kept block, where the next steps overwrite it."""
        self.block_manager.release_slots_after(seq, len(seq))
        self.block_manager.cache_full_blocks(seq)

    def advance_grammar(self, seq: Sequence, token_id: int) -> None:
        """Move a constrained request's machine past one accepted token; refuse loudly if it cannot.

        Only tokens the request keeps come here (after the verify pass decided), so the machine
        never holds a draft between steps. The mask made every sampled token legal: a refusal
        is a bug in the engine, not in the model."""
        # TODO(v12): If the sequence has a grammar, accept the one token; if the grammar
        # refuses it raise RuntimeError saying which token and request (the mask should have
        # forbidden it).
        raise NotImplementedError("TODO(v12): write Scheduler.advance_grammar (see NOTES.md)")

    def postprocess(self, seqs: tuple[Sequence, ...], token_ids: list[list[int]]) -> list[Sequence]:
        """Accept each request's emitted tokens; stop at EOS, a complete constraint or max_tokens;
        roll back the rest."""
        finished = []
        for seq, emitted in zip(seqs, token_ids, strict=True):
            for token_id in emitted:
                self.accept_token(seq, token_id)
                self.advance_grammar(seq, token_id)
                hit_eos = token_id == self.eos_token_id and not seq.ignore_eos
                complete = seq.grammar is not None and seq.grammar.is_terminated()
                if hit_eos or complete or seq.num_completion_tokens >= seq.max_tokens:
                    seq.finish_reason = "stop" if hit_eos or complete else "length"
                    seq.status = SequenceStatus.FINISHED
                    self.block_manager.deallocate(seq)
                    self.running.remove(seq)
                    finished.append(seq)
                    break  # tokens after the stop are dropped
            else:
                self.release_rejected_slots(seq)
            seq.draft_token_ids = []
        return finished
