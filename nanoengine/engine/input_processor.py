"""The input processor: a prompt and its sampling parameters in, a checked request out (chapter 2).

Every way into the engine (``LLM.generate``, ``LLM.chat``, ``LLM.stream``, ``LLMEngine.add_request``,
the server) goes through here, so a prompt is rendered once (chat messages through the model's chat
template), tokenized once (``encode``) and checked once against what only the engine knows
(``check_params``; ``SamplingParams`` checked the rest). ``LLM.generate`` and the server refuse
alike (a ``ValueError`` naming the field; a 400) but for one case, vLLM's too: a ``max_tokens`` the
prompt leaves no room for ends the request at the window ("length") here, while the server refuses
it before it starts (``protocol.fit_to_context``).

The result, a ``ProcessedPrompt``, is what ``LLMEngine.add_request`` accepts (vLLM v1:
vllm/v1/engine/processor.py). The processor reads only its tokenizer and fixed limits, so a server
may tokenize a large prompt on another thread while the engine keeps serving others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from nanoengine.sampling_params import SamplingParams, shown

Message = dict[str, str]
PromptInput = str | Sequence[int] | Sequence[Message]  # text, token ids, or a chat conversation


@dataclass(frozen=True)
class ProcessedPrompt:
    """A prompt that passed every check: ready to become requests."""

    prompt: str | None  # the text (a conversation's rendered chat template); None for token ids
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams


class InputProcessor:
    """Tokenizes, renders and checks prompts for one engine's limits."""

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, max_num_seqs: int,
                 check_constraint: Callable[[SamplingParams], None] | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.check_constraint = check_constraint  # refuses a constraint that does not compile (chapter 14)

    def process(self, prompt: PromptInput | ProcessedPrompt,
                sampling_params: SamplingParams | None = None) -> ProcessedPrompt:
        """Any prompt (text, token ids, chat messages) and its parameters, checked; a
        ``ProcessedPrompt`` is returned as it is when no other parameters are given."""
        if isinstance(prompt, ProcessedPrompt):
            if sampling_params is None or sampling_params is prompt.sampling_params:
                return prompt
            return self.process_tokens(prompt.prompt_token_ids, sampling_params, prompt.prompt)
        if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):  # a conversation
            params = self.check_params(sampling_params)
            text = self.apply_chat_template(prompt)  # refuses malformed messages by name
            return ProcessedPrompt(text, self.check_length(self.encode(text, rendered_chat=True)), params)
        if isinstance(prompt, (list, tuple)):
            return self.process_tokens(prompt, sampling_params)
        text, token_ids = self.tokenize(prompt)
        return ProcessedPrompt(text, tuple(token_ids), self.check_params(sampling_params))

    def process_tokens(self, token_ids: Sequence[int], sampling_params: SamplingParams | None = None,
                       prompt: str | None = None) -> ProcessedPrompt:
        """A prompt that is already token ids (``prompt`` optionally its text), checked."""
        params = self.check_params(sampling_params)
        if not isinstance(token_ids, (list, tuple)):
            raise TypeError(f"prompt token ids must be a list of integers, got {token_ids!r:.80} "
                            f"({type(token_ids).__name__})")
        vocab = self.vocab_size
        bad = [t for t in token_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got "
                             f"[{', '.join(shown(t, 20) for t in bad[:5])}]")
        return ProcessedPrompt(prompt, self.check_length(token_ids), params)

    def encode(self, text: str, rendered_chat: bool = False) -> list[int]:
        """The token ids of a text, unchecked: the one tokenizing rule of every entry. Plain text gets the
        special tokens its tokenizer adds (a BOS for Llama-3, none for SmolLM2); a rendered chat template
        already holds them (``rendered_chat``)."""
        return self.tokenizer.encode(text, add_special_tokens=not rendered_chat)

    def tokenize(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) of a text or token-id prompt, checked."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass the prompt as a list of token ids")
            if not prompt:
                raise ValueError("prompt is empty: give at least one character or token id")
            return prompt, list(self.check_length(self.encode(prompt)))
        if isinstance(prompt, (list, tuple)):
            return None, list(self.process_tokens(prompt, SamplingParams()).prompt_token_ids)
        raise TypeError(f"prompt must be a string or a list of token ids (or a list of chat messages), "
                        f"got {prompt!r:.80} ({type(prompt).__name__})")

    def apply_chat_template(self, messages: Sequence[Message]) -> str:
        """The conversation as the model's chat template renders it, ending with the assistant's turn."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template; use generate() with a plain prompt")
        if not is_conversation(messages):
            raise ValueError("messages must be a non-empty list of {'role': str, 'content': str} dicts, "
                             f"got {messages!r:.200}")
        return self.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)

    def check_params(self, params: SamplingParams | None) -> SamplingParams:
        """The request's parameters against this engine: what SamplingParams cannot know alone."""
        if params is None:
            return SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {params!r:.80} ({type(params).__name__})")
        if params.n > self.max_num_seqs:
            raise ValueError(f"n={shown(params.n)} completions must run at once, but max_num_seqs is "
                             f"{self.max_num_seqs}: lower n or raise max_num_seqs")
        if params.top_k > self.vocab_size:  # the sampler keeps top_k of the vocabulary's logits
            raise ValueError(f"top_k must be 0 (disable), or at least 1 and at most the vocabulary size "
                             f"({self.vocab_size}), got {shown(params.top_k)}")
        if params.logprobs is not None and params.logprobs > self.vocab_size:
            raise ValueError(f"logprobs must be at most the vocabulary size ({self.vocab_size}), got {params.logprobs}")
        for t in params.stop_token_ids:
            if t >= self.vocab_size:
                raise ValueError(f"stop_token_ids holds {shown(t)}, outside the vocabulary [0, {self.vocab_size})")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop={list(params.stop)!r} needs a tokenizer to find the strings in the text, and "
                             f"this engine has none: use stop_token_ids, or build the engine with a tokenizer")
        if params.structured_outputs is not None and self.check_constraint is not None:
            self.check_constraint(params)
        return params

    def check_length(self, token_ids: Sequence[int]) -> tuple[int, ...]:
        """A ``ValueError`` for a prompt that is empty or longer than ``max_model_len``; else its ids as a tuple."""
        if not token_ids:
            raise ValueError("prompt is empty: it has no tokens")
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens but max_model_len is {self.max_model_len}; "
                             f"shorten it or raise max_model_len")
        return tuple(token_ids)


def is_conversation(prompt: object) -> bool:
    """True for a non-empty list of ``{'role': str, 'content': str}`` messages."""
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt)
