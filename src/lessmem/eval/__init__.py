"""Evaluation: perplexity, KLD, retrieval, error tables, memory and speed (imports lazily)."""
