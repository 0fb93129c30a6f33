"""Development tools: conformance, the demo, benchmarks, protogen.

They import the runtime packages (``maskd.server``, ``maskd_client``); nothing at runtime imports
them (checked by the import contracts in pyproject.toml).
"""
