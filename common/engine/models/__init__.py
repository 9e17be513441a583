"""Model definitions: one decoder for the Llama family and Gemma 3."""
