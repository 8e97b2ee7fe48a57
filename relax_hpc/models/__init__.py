"""Models and tokenizers: HF models by path, and built-in tiny models made from config (no download)."""
