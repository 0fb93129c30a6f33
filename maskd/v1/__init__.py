"""Generated wire contract (python -m maskd.tools.protogen); do not edit."""
