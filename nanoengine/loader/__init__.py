"""Where a model's weights come from: a Hugging Face checkpoint, a GGUF file or random weights (chapter 2)."""
