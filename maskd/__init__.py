"""maskd: a distributed token-mask server for constrained LLM decoding.

This package root stays import-light: GPU workers import ``maskd.v1`` (the wire
contract) and ``maskd.rowcodec`` through ``maskd_client`` without pulling any
grammar engine.
"""
__version__ = "0.1.0"
