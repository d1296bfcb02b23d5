"""Published shapes of models the course talks about (chapters 1, 3 and 11), and tiny ones.

Only shapes, from each model's published ``config.json``: ``PRESETS`` feed the memory estimator and
let the GPU benchmark build a model of Qwen3-0.6B's real shape with random weights. ``TINY_PRESETS``
are the small random models that tests, widgets and scripts use when only the mechanics matter
(queues, blocks, slots): ``loader.weights.random_model("tiny-llama")`` builds one in milliseconds.
Text a reader sees always comes from the real model.
"""

from __future__ import annotations

from nanoengine.models.config import ModelConfig

# What Llama-3 8B and 70B share (their sizes differ).
_LLAMA_3 = dict(architecture="LlamaForCausalLM", num_key_value_heads=8, head_dim=128, vocab_size=128256,
                rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=False,
                bos_token_id=128000, eos_token_ids=(128001,))

PRESETS: dict[str, ModelConfig] = {
    "SmolLM2-135M": ModelConfig(
        architecture="LlamaForCausalLM", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152, rms_norm_eps=1e-5,
        rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
        bos_token_id=1, eos_token_ids=(2,)),
    "Qwen3-0.6B": ModelConfig(
        architecture="Qwen3ForCausalLM", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=True,
        bos_token_id=151643, eos_token_ids=(151645,)),
    "Llama-3-8B": ModelConfig(**_LLAMA_3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                              num_attention_heads=32),
    "Llama-3-70B": ModelConfig(**_LLAMA_3, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                               num_attention_heads=64),
}


TINY_PRESETS: dict[str, ModelConfig] = {
    # Widgets and chapters: small enough that a step takes a millisecond. No EOS token,
    # so every request runs to max_tokens (ideal for watching blocks and queues).
    "tiny-llama": ModelConfig(
        architecture="LlamaForCausalLM", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=256, max_position_embeddings=1024),
    # Tests and the load report: wider, with an EOS token and tied embeddings like SmolLM2.
    "tiny-llama-eos": ModelConfig(
        architecture="LlamaForCausalLM", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
        max_position_embeddings=1024, tie_word_embeddings=True, eos_token_ids=(2,)),
}
