"""v11 - the sampler: logits in, one token id per sequence out (cards 12, 16).

A separate layer, because it is the one place that differs per request while the model
forward pass is shared by the whole batch. The steps, for a batch of ``B`` sequences
over a vocabulary of ``V``:

1. divide each row of logits by its request's temperature (greedy rows are left alone);
2. top-k: mask every logit below the row's k-th largest to ``-inf``;
3. softmax to probabilities;
4. draw one token per row with ``torch.multinomial`` - from the request's own
   ``torch.Generator`` if it has a seed (so its draws do not depend on its batch
   neighbours), else from torch's global generator; greedy rows take the argmax.

Steps 1-3 are batched tensor ops; step 4 is a loop because generators are per request
(vLLM also treats seeded requests separately). nano-vLLM's ``layers/sampler.py`` does
temperature-only sampling with the exponential-race trick
(``probs / Exponential(1)`` then argmax) and no per-request generators.

New in v11: steps 1-3 are their own method, ``probs``, because speculative decoding needs
the distribution itself - the acceptance rule weighs each draft by it - not a sample.
"""

import torch


class Sampler:
    """Turns a batch of logits into token ids, each row by its own request's rules."""

    def __call__(self, logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor,
                 generators: list[torch.Generator | None]) -> list[int]:
        """logits (B, V); temperatures (B,) float, 0 = greedy; top_ks (B,) int, -1 = all."""
        batch_size = logits.shape[0]
        logits = logits.float()
        greedy = temperatures == 0  # (B,)
        probs = self.probs(logits, temperatures, top_ks)  # (B, V)
        token_ids = []
        for i in range(batch_size):
            if greedy[i]:
                token_ids.append(int(logits[i].argmax()))
            else:
                token_ids.append(int(torch.multinomial(probs[i], 1, generator=generators[i])))
        return token_ids

    def probs(self, logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor) -> torch.Tensor:
        """Each row's sampling distribution: softmax of logits / temperature over its top k. (B, V).

        A greedy row (temperature 0) is divided by 1; greedy never samples from it."""
        vocab_size = logits.shape[1]
        logits = logits.float()
        scaled = logits / torch.where(temperatures == 0, 1.0, temperatures).unsqueeze(1)  # (B, V)
        k = torch.where(top_ks > 0, top_ks, vocab_size).clamp(max=vocab_size)  # (B,)
        sorted_logits = scaled.sort(dim=-1, descending=True).values  # (B, V)
        kth_largest = sorted_logits.gather(1, (k - 1).unsqueeze(1))  # (B, 1)
        scaled = scaled.masked_fill(scaled < kth_largest, float("-inf"))  # ties are kept
        return torch.softmax(scaled, dim=-1)  # (B, V)
