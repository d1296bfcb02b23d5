"""v12 - the engine step loop, driving a tiny Transformer, with speculative decoding and constraints (cards 10-17).

Same three phases as v04-v05, now each owned by one object:

1. ``Scheduler.schedule``  - which requests ride, prefill or decode (engine core);
2. ``ModelRunner.run``     - flat batch in, one token per request out (worker);
3. ``Scheduler.postprocess`` - tokens into request state, finished requests out.

The engine itself only wires them together and reports. These are the layers of card
1: ``LLMEngine`` is the API, ``Scheduler`` + ``BlockManager`` the scheduler core,
``ModelRunner`` the GPU worker. ``StepOutput`` now also carries the ``ModelInput`` the
runner built, so a trace can show exactly what the model saw.

New in v08: ``add_request`` and ``generate`` take ``SamplingParams`` (temperature,
top-k, seed, max_tokens, ignore_eos) instead of a bare ``max_tokens``.

New in v09: the runner holds a ``TinyTransformer`` configured by ``TinyConfig``; the EOS
id comes from that config, and ``add_request`` refuses requests longer than the model's
position table. Nothing else in the engine changed - that was the point of the runner
contract.
New in v11: ``num_speculative_tokens`` (k, vLLM's name; 0 turns speculation off) and the
prompt-lookup window ``prompt_lookup_min`` .. ``prompt_lookup_max`` go to the scheduler. A
decode step may now emit several tokens per request, so ``new_tokens`` can hold several
pairs for one request, and ``StepOutput`` reports each request's drafts and how many of
them were accepted.

New in v12: ``add_request`` compiles a constrained request's grammar (``compile_grammar``
over ``TOY_VOCAB``, which must be the model's vocabulary: one string per token id), so a
bad pattern fails when the request is made, not mid-generation. ``step`` asks the
scheduler for the step's grammar bitmask and hands it to the runner, and reports it;
``RequestOutput`` says why a request finished (``"stop"`` or ``"length"``).
"""

from dataclasses import dataclass

import torch

from block_manager import BlockManager
from model_runner import ModelInput, ModelRunner
from sampling_params import SamplingParams
from scheduler import Scheduler
from sequence import Sequence
from structured_output import TOY_VOCAB, compile_grammar
from tiny_transformer import TinyConfig


@dataclass(frozen=True)
class RequestOutput:
    """A finished request, as handed back to the caller."""

    seq_id: int
    completion_token_ids: tuple[int, ...]
    finish_reason: str = "length"  # "stop": EOS or a complete constraint; "length": max_tokens


@dataclass(frozen=True)
class StepOutput:
    """What one ``step`` did. ``new_tokens`` is the output stream: (seq_id, token_id)."""

    is_prefill: bool
    num_input_tokens: int
    scheduled_seq_ids: tuple[int, ...]
    new_tokens: tuple[tuple[int, int], ...]
    finished: tuple[RequestOutput, ...]
    block_tables: dict[int, tuple[int, ...]]
    context_lens: dict[int, int]
    preempted_seq_ids: tuple[int, ...]
    model_input: ModelInput
    draft_token_ids: dict[int, tuple[int, ...]]  # the drafts each request's verify pass checked
    num_accepted_drafts: dict[int, int]  # ... and how many of them it kept
    num_drafts_cut: dict[int, int]  # drafts the request's grammar refused before verification
    grammar_bitmask: torch.Tensor | None  # (R, vocab) allowed tokens per logits row; None: unconstrained


class LLMEngine:
    """add_request -> step (schedule, run, postprocess) until idle."""

    def __init__(self, num_blocks: int = 16, block_size: int = 4, max_num_seqs: int = 4,
                 max_num_batched_tokens: int = 64, model_config: TinyConfig | None = None,
                 num_speculative_tokens: int = 3, prompt_lookup_max: int = 3, prompt_lookup_min: int = 1) -> None:
        self.model_config = model_config or TinyConfig()
        self.block_size = block_size
        self.model_runner = ModelRunner(num_blocks, block_size, self.model_config)
        self.block_manager = BlockManager(num_blocks, block_size)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens,
                                   self.model_config.eos_token_id, num_speculative_tokens,
                                   prompt_lookup_max, prompt_lookup_min)
        self._next_seq_id = 0

    def add_request(self, prompt_token_ids: list[int], sampling_params: SamplingParams) -> int:
        """Queue a new request (status WAITING) and return its id."""
        config = self.model_config
        if len(prompt_token_ids) + sampling_params.max_tokens > config.max_position:
            raise ValueError(f"prompt + max_tokens exceeds max_position={config.max_position}")
        if not all(0 <= t < config.vocab_size for t in prompt_token_ids):
            raise ValueError(f"token ids must be in [0, {config.vocab_size})")
        seq = Sequence(self._next_seq_id, prompt_token_ids, sampling_params, self.block_size)
        if sampling_params.is_constrained:
            if len(TOY_VOCAB) != config.vocab_size:
                raise ValueError(f"a constraint needs the toy vocabulary ({len(TOY_VOCAB)} tokens) as the "
                                 f"model's; this model has {config.vocab_size}")
            seq.grammar = compile_grammar(sampling_params.choice, sampling_params.regex, TOY_VOCAB,
                                          config.eos_token_id)
        self._next_seq_id += 1
        self.scheduler.add(seq)
        return seq.seq_id

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

    def step(self) -> StepOutput:
        batch = self.scheduler.schedule()
        drafts = {seq.seq_id: tuple(seq.draft_token_ids) for seq in batch.seqs}
        bitmask = self.scheduler.get_grammar_bitmask(batch)
        emitted = self.model_runner.run(list(batch.seqs), batch.is_prefill, bitmask)
        model_input = self.model_runner.last_input
        block_tables = {seq.seq_id: tuple(seq.block_table) for seq in batch.seqs}
        context_lens = {seq.seq_id: len(seq) for seq in batch.seqs}
        finished = self.scheduler.postprocess(batch.seqs, emitted)
        return StepOutput(
            is_prefill=batch.is_prefill,
            num_input_tokens=len(model_input.input_ids),
            scheduled_seq_ids=tuple(seq.seq_id for seq in batch.seqs),
            new_tokens=tuple((seq.seq_id, tok) for seq in batch.seqs
                             for tok in seq.token_ids[context_lens[seq.seq_id]:]),  # after any stop: dropped
            finished=tuple(RequestOutput(s.seq_id, tuple(s.completion_token_ids), s.finish_reason)
                           for s in finished),
            block_tables=block_tables,
            context_lens=context_lens,
            preempted_seq_ids=tuple(seq.seq_id for seq in batch.preempted),
            model_input=model_input,
            draft_token_ids=drafts,
            num_accepted_drafts={seq.seq_id: len(tokens) - 1 for seq, tokens in zip(batch.seqs, emitted)},
            num_drafts_cut=dict(zip((seq.seq_id for seq in batch.seqs), batch.num_drafts_cut)),
            grammar_bitmask=bitmask,
        )

    def generate(self, prompts: list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Add every prompt, step until idle, return completions in prompt order."""
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        seq_ids = [self.add_request(p, sp) for p, sp in zip(prompts, sampling_params, strict=True)]
        outputs: dict[int, list[int]] = {}
        while not self.is_finished():
            for request_output in self.step().finished:
                outputs[request_output.seq_id] = list(request_output.completion_token_ids)
        return [outputs[seq_id] for seq_id in seq_ids]
