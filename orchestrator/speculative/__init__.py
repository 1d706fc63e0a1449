"""Speculative decoding whose answers equal decoding without it: drafts (`ngram`), how many to verify
(`policy`), and the scheduler's verification step (`verify`). The engine computes; these modules decide."""
