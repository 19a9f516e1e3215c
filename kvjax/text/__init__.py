"""Prompt text: canonicalization and tokenizers."""
