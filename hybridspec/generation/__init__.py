"""Speculative decoding through transformers' `generate` entry (DESIGN.md section 2)."""
