"""What the learner writes in each lab: the functions left as stubs in the starters.

Each version's starter (``starters/vNN_*/``) is that version's snapshot with exactly the
functions below replaced by a stub: the signature and docstring stay, the body becomes a
comment saying what to write and ``raise NotImplementedError("TODO(vNN): ...")``. Only
the version's *new idea* is stubbed; everything it builds on is there, finished, as in
the snapshot. ``make_starters.py`` generates the starters from this table, and a test
checks that the committed starters are exactly what it generates.

A task lists its stubs in the order worth writing them; ``part`` groups them when a
version does more than one thing (v05).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stub:
    file: str  # file name inside the version folder
    qualname: str  # 'function' or 'Class.method'
    todo: str  # what to write, in a few sentences
    part: str = ""  # for versions with several parts: 'A', 'B', ...


TASKS: dict[str, tuple[Stub, ...]] = {
    "v01": (
        Stub("sequence.py", "Sequence.__init__",
             "Reject bad input with ValueError (an empty prompt, max_tokens < 1), then store seq_id, "
             "token_ids (a copy of the prompt: prompt and completion share this one list), "
             "num_prompt_tokens and max_tokens."),
        Stub("sequence.py", "Sequence.completion_token_ids",
             "Return the generated part of token_ids: everything after the first num_prompt_tokens."),
        Stub("sequence.py", "Sequence.is_finished",
             "True once max_tokens tokens were generated, or once the last *generated* token is "
             "EOS_TOKEN (a prompt that ends in EOS does not count)."),
        Stub("sequence.py", "Sequence.append_token",
             "Raise RuntimeError if the sequence is already finished; otherwise append token_id."),
    ),
    "v02": (
        Stub("llm_engine.py", "LLMEngine.add_request",
             "Make a Sequence with the next id (self._next_seq_id, then increment it), queue it on "
             "self.waiting (its status is WAITING) and return its id."),
        Stub("llm_engine.py", "LLMEngine.step",
             "If nothing runs, move the oldest waiting request to self.running with status RUNNING. "
             "Run toy_next_token on the running request's whole context and append the token. On EOS "
             "or max_tokens set FINISHED and remove it from running. Return StepOutput((seq_id,), "
             "((seq_id, token),), finished) where finished holds a RequestOutput if it finished."),
        Stub("llm_engine.py", "LLMEngine.generate",
             "Add every prompt, call step() until is_finished(), collect the RequestOutputs from each "
             "StepOutput.finished, and return the completions (lists) in prompt order."),
    ),
    "v03": (
        Stub("toy_model.py", "ToyModel.prefill",
             "Cache token_feature(t, position) for every prompt token as kv_cache[seq_id], add their "
             "number to num_features_computed, and return _next_token(cache, last token)."),
        Stub("toy_model.py", "ToyModel.decode",
             "Append the feature of the one new token (its position is len(cache)) to the request's "
             "cache, count 1 feature, and return _next_token(cache, token_id)."),
        Stub("llm_engine.py", "LLMEngine.step",
             "Nothing running: prefill the oldest waiting request (it becomes RUNNING; its whole "
             "prompt goes in). Otherwise decode the running one (only its last token goes in). "
             "Append the token; on EOS or max_tokens finish it, remove it and free its cache with "
             "self.model.free. Return StepOutput(is_prefill, num_input_tokens, ...)."),
    ),
    "v04": (
        Stub("scheduler.py", "Scheduler.schedule",
             "Prefill first: while requests wait and fewer than max_num_seqs run, admit the oldest "
             "waiting request if its tokens fit what is left of max_num_batched_tokens this step "
             "(status RUNNING, waiting -> running). If any were admitted, return them as a prefill "
             "batch. Otherwise return a decode batch of every running request. Admitting as soon as "
             "a slot frees, while others are still decoding, is what makes the batching continuous."),
        Stub("scheduler.py", "Scheduler.postprocess",
             "For each (seq, token_id): append the token; on EOS or max_tokens set FINISHED and "
             "remove the sequence from running. Return the finished sequences."),
    ),
    "v05": (
        Stub("sequence.py", "Sequence.num_blocks",
             "Blocks needed to hold num_tokens tokens: ceil(num_tokens / block_size).", "A"),
        Stub("block_manager.py", "BlockManager.can_allocate",
             "Are at least seq.num_blocks blocks free?", "A"),
        Stub("block_manager.py", "BlockManager.allocate",
             "Append seq.num_blocks blocks to seq.block_table, each taken from the FRONT of "
             "free_block_ids and recorded in used_block_ids (_allocate_block does one).", "A"),
        Stub("block_manager.py", "BlockManager.deallocate",
             "Walk seq.block_table in REVERSE, moving each block from used_block_ids to the BACK of "
             "free_block_ids; then clear the table.", "A"),
        Stub("block_manager.py", "BlockManager.can_append",
             "Before a decode: if the sequence needs one more block than its table holds "
             "(seq.num_blocks > len(seq.block_table)), is one free?", "A"),
        Stub("block_manager.py", "BlockManager.may_append",
             "If seq.num_blocks > len(seq.block_table), take one more block for it.", "A"),
        Stub("toy_model.py", "ToyModel.slot",
             "The pool index of the token at `position`: "
             "block_table[position // block_size] * block_size + position % block_size.", "A"),
        Stub("scheduler.py", "Scheduler.add",
             "Keep v04's ValueError for a prompt over max_num_batched_tokens, and also refuse (ValueError) "
             "a request whose prompt + max_tokens needs more blocks than the whole pool: it could "
             "never finish, and would preempt itself forever.", "B"),
        Stub("scheduler.py", "Scheduler.schedule",
             "Admission as in v04, plus: stop admitting when block_manager.can_allocate fails, and "
             "allocate each admitted request. Decode: pop running requests oldest first; while "
             "can_append fails for one, preempt the NEWEST running request (self.running.pop()), or "
             "the request itself when no other is left; otherwise may_append and schedule it. Put "
             "the scheduled ones back on running and return them with the preempted ones. (The "
             "roomy-pool check passes before preemption is written.)", "C"),
        Stub("scheduler.py", "Scheduler._preempt",
             "Status back to WAITING, deallocate its blocks, and put it at the FRONT of waiting: a "
             "later prefill recomputes its KV from all its tokens.", "C"),
    ),
    "v06": (
        Stub("model_runner.py", "ModelRunner._slot",
             "block_table[position // block_size] * block_size + position % block_size."),
        Stub("model_runner.py", "ModelRunner.prepare_prefill",
             "Every token of each sequence rides: input_ids, positions 0..n-1 and each token's slot, "
             "sequences back to back; cu_seqlens_q grows by len(seq) per sequence; context_lens is "
             "len(seq); block_tables are tuples. Return ModelInput(is_prefill=True, ...)."),
        Stub("model_runner.py", "ModelRunner.prepare_decode",
             "One row per sequence: its last token, at position len(seq) - 1, and that position's "
             "slot; cu_seqlens_q is 0, 1, ..., B; context_lens and block_tables as in prefill."),
        Stub("toy_model.py", "ToyModel.forward",
             "Store: kv_cache[slot] = token_feature(token, position) for every row. Then for each "
             "sequence gather its context_len features through its block table, take its last input "
             "token (row cu_seqlens_q[i + 1] - 1), and emit (sum(features) + 13 * last) % VOCAB_SIZE."),
    ),
    "v07": (
        Stub("block_manager.py", "compute_hash",
             "Hash parent_hash (8 bytes, little-endian, signed) followed by the token ids, e.g. with "
             "hashlib.blake2b(digest_size=8) over array('q', token_ids).tobytes(); return a "
             "non-negative int below 2**63, so it is never -1 and can itself be a parent."),
        Stub("block_manager.py", "BlockManager._share_block",
             "One more reference to a cached block: if its ref_count is 0, take it out of "
             "free_block_ids and into used_block_ids; then increment ref_count and return it."),
        Stub("block_manager.py", "BlockManager.allocate",
             "Walk the sequence's blocks in order, chaining parent_hash through every full block. "
             "A full block that does not hold the last token, while nothing has missed yet, is "
             "looked up (count num_prefix_queries): a hit needs hash_to_block_id to know "
             "compute_hash(tokens, parent_hash) AND that block's token_ids to match. Hit: "
             "_share_block it, count num_prefix_hits, add block_size to seq.num_cached_tokens. "
             "Miss (and every block after it): _take_free_block, and _register it if it is full."),
        Stub("block_manager.py", "BlockManager.deallocate",
             "Walk the table in reverse and decrement each block's ref_count; at zero move it from "
             "used_block_ids to the BACK of free_block_ids, keeping its hash. Clear the table and "
             "set seq.num_cached_tokens back to 0."),
        Stub("block_manager.py", "BlockManager.may_append",
             "As in v05 take a fresh block when one is needed (_take_free_block). Then, if this token "
             "fills its block (len(seq) % block_size == 0), _register that block with the hash of "
             "the block before it (-1 for the first)."),
        Stub("model_runner.py", "ModelRunner.prepare_prefill",
             "As in v06, but each sequence starts at seq.num_cached_tokens: only the uncached tokens "
             "ride (input_ids, positions, slot_mapping, cu_seqlens_q), while context_lens stays "
             "len(seq) so the model still reads the cached prefix."),
    ),
    "v08": (
        Stub("sampling_params.py", "SamplingParams.__post_init__",
             "ValueError for temperature < 0, a top_k that is neither -1 nor >= 1, a negative seed, "
             "and max_tokens < 1; say in each message what is allowed."),
        Stub("sampler.py", "Sampler.__call__",
             "Divide each row by its temperature (greedy rows, temperature 0, by 1); set every logit "
             "below the row's k-th largest to -inf (top_k -1 keeps all); softmax. Then per row: the "
             "argmax of the raw logits if greedy, else torch.multinomial(probs[i], 1, "
             "generator=generators[i])."),
        Stub("model_runner.py", "ModelRunner.prepare_sample",
             "Return (temperatures as a float32 tensor (B,), top_ks as an int64 tensor (B,), "
             "the list of each sequence's generator)."),
    ),
    "v09": (
        Stub("tiny_transformer.py", "store_kv",
             "View each cache as (num_slots, H, D) and write k and v at the rows slot_mapping names."),
        Stub("tiny_transformer.py", "paged_attention",
             "For each sequence i (rows cu_seqlens_q[i]:cu_seqlens_q[i+1]): gather its context's K "
             "and V through its block table (k_cache[table].flatten(0, 1)[:context_len]), mask "
             "keys after each query's position (causal by position), run "
             "F.scaled_dot_product_attention with `scale` over heads, and write its rows of the output."),
        Stub("tiny_transformer.py", "TinyTransformer.forward",
             "Embed tokens + positions; run every layer with kv_cache[0, i] and kv_cache[1, i]; "
             "then norm and compute_logits on each sequence's last row only (cu_seqlens_q[1:] - 1)."),
        Stub("model_runner.py", "ModelRunner.prepare_block_tables",
             "One int64 tensor (B, longest table), each row a block table padded with -1."),
    ),
    "v11": (
        Stub("ngram_proposer.py", "propose_ngram",
             "For n from min(max_n, len - 1) down to min_n: take the last n tokens and find their "
             "EARLIEST earlier occurrence (a window starting before len - n); return up to k tokens "
             "that follow it. The first n with a match wins; [] if none (or k is 0)."),
        Stub("rejection_sampler.py", "accept_greedy",
             "Walk drafts and row argmaxes together: emit the argmax; stop after the first draft "
             "that differs from it. If every draft matched, also emit the last argmax (the bonus)."),
        Stub("rejection_sampler.py", "accept_sampled",
             "For draft i, judged against row i: draw u ~ U(0, 1) from the generator; u < p(draft) "
             "keeps it. Otherwise copy the row, zero the draft's entry, renormalise, draw one token "
             "from that with torch.multinomial, emit it and stop. All kept: draw a bonus from the "
             "last row."),
        Stub("model_runner.py", "ModelRunner.prepare_decode",
             "Per sequence: its uncomputed tokens (token_ids from num_computed_tokens: the last "
             "token) followed by its draft_token_ids, at positions num_computed_tokens onward, each "
             "with its slot; cu_seqlens_q grows by that many rows; context_lens is len(seq) + drafts; "
             "logits_indices is every row (torch.arange over all rows)."),
        Stub("scheduler.py", "Scheduler.accept_token",
             "An emitted token means every token before it has valid KV: set num_computed_tokens "
             "to the sequence's length before appending, then append the token."),
        Stub("block_manager.py", "BlockManager.release_slots_after",
             "Keep the first ceil(num_tokens / block_size) blocks of the table. Walk the rest in "
             "REVERSE: each must have ref_count 1 and no hash; set ref_count 0, move it from "
             "used_block_ids to the BACK of free_block_ids. Then cut the table to the kept blocks."),
    ),
    "v12": (
        Stub("structured_output.py", "CharFSM.walk",
             "For each character of text: the next set is every target of an edge, from a state in "
             "the set, whose characters contain it, closed over epsilon edges (self.closure). Stop "
             "early once the set is empty, and return it."),
        Stub("structured_output.py", "Grammar.allowed",
             "Memoised in self._masks: a bool tensor (V,) that is True where next_state(state, t) is "
             "not the empty set (nothing is allowed after EOS, state None). If no token is allowed, "
             "allow EOS alone so the row can still be sampled from."),
        Stub("structured_output.py", "Grammar.validate_tokens",
             "Walk the tokens from the current state with next_state, without touching the "
             "history; return the tokens before the first one that leads to the empty set."),
        Stub("structured_output.py", "grammar_bitmask",
             "None if no sequence has a grammar. Else an all-True bool tensor (rows, V): one row "
             "per sequence in a prefill, len(drafts) + 1 in a verify pass. For a constrained "
             "sequence fill row i (fill_bitmask), then accept draft i if there is one (raise if it "
             "is refused); after its last row roll back every draft it accepted."),
        Stub("structured_output.py", "apply_grammar_bitmask",
             "Return logits unchanged for no bitmask; ValueError if the shapes differ; otherwise "
             "logits with -inf wherever the bitmask is False (a new tensor)."),
        Stub("scheduler.py", "Scheduler.advance_grammar",
             "If the sequence has a grammar, accept the one token; if the grammar refuses it raise "
             "RuntimeError saying which token and request (the mask should have forbidden it)."),
    ),
}

PARTS = {
    "v05": {
        "A": "paging: blocks, block tables and slots",
        "B": "refusal: reject at add time a request that can never fit",
        "C": "scheduling with pages: allocate at admission, a block per decode, preempt the "
             "newest request when the pool runs dry",
    },
}
