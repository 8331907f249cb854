"""Speculative decoding (docs/architecture.md#speculative-decoding): proposers of draft tokens,
the rule of when a request drafts, and the verification of drafts in the target model."""
