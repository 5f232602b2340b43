"""The runner's model code: the Llama-family transformer, MTP heads, tokenizer."""
