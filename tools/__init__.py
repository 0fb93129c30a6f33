"""maskd's development tools: conformance, the demo, benchmarks, soak and chaos, the model builders,
protogen.

Their own distribution, ``maskd-tools`` (``tools/pyproject.toml``), beside the runtime one: the
``maskd`` wheel and the image ship without them, and ``maskd bench``, ``maskd demo``, ... dispatch
here where this package is installed (``make setup`` installs it into ``.venv``). They import the
runtime packages (``maskd.server``, ``maskd_client``, ``maskd_cluster``); nothing in those imports
them (checked by the import contracts in pyproject.toml).
"""
