"""Structured outputs: constrain a request's tokens to a JSON schema, a regex, a list of
choices or an EBNF grammar (docs/architecture.md#structured-outputs).

``params`` (the public ``StructuredOutputsParams``) and ``grammar`` (parsing, for validation)
are read by the frontend; ``compiler``, ``request`` and ``manager`` live in the engine core
(compiled grammars, per-request matchers, each step's bitmask); ``bitmask`` applies the mask
to the logits in the model runner. Nothing here is imported by ``import pagedserve``.
"""
