"""Triton kernels: input preparation and slot mapping (``input_prep``), the KV-cache write
(``kv_write``), paged attention (``paged_attention``, ``paged_attention_split``) and sampling
(``sampling_gumbel``: temperature + seeded Gumbel-max; ``sampling_truncation``: top-k / top-p /
min-p cuts without a sort)."""

from pagedserve.kernels import interpreter_compat

interpreter_compat.apply()
