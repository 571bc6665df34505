"""Speculative decoding through transformers' `generate` entry (docs/design.md, "One round")."""
