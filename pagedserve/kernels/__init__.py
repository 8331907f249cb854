"""Triton kernels: input preparation, slot mapping, the KV-cache write and paged attention."""

from pagedserve.kernels import interpreter_compat

interpreter_compat.apply()
