"""Structured output: grammars that constrain what a request may generate.

    StructuredOutput (spec.py)      what a request asks for: a JSON schema, any JSON object, a regex,
                                    one of some strings, or a Lark/GBNF grammar; travels inside
                                    SamplingParams, so prefill and decode workers compile the same
    GrammarCompiler (compiler.py)   compiles off the engine thread and the event loop, cached by spec,
                                    with a time limit
    GrammarBackend (backend.py)     llguidance (default) or xgrammar (optional extra): compiled
                                    grammars, per-request matchers, the token bitmask
    apply_token_masks (masking.py)  the sampler's step: fill each constrained row's bitmask, apply
                                    them to the batch's logits at once
"""
