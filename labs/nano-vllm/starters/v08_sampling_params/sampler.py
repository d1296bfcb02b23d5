"""v08 - the sampler: logits in, one token id per sequence out (card 12).

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
"""

import torch


class Sampler:
    """Turns a batch of logits into token ids, each row by its own request's rules."""

    def __call__(self, logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor,
                 generators: list[torch.Generator | None]) -> list[int]:
        """logits (B, V); temperatures (B,) float, 0 = greedy; top_ks (B,) int, -1 = all."""
        # TODO(v08): Divide each row by its temperature (greedy rows, temperature 0, by 1);
        # set every logit below the row's k-th largest to -inf (top_k -1 keeps all);
        # softmax. Then per row: the argmax of the raw logits if greedy, else
        # torch.multinomial(probs[i], 1, generator=generators[i]).
        raise NotImplementedError("TODO(v08): write Sampler.__call__ (see NOTES.md)")
