"""A model's building blocks: linear layers, attention over the paged cache, norms, rotary, sampler (chapters 3-10)."""
