"""Generated wire contract (python -m maskd_tools.protogen); do not edit."""
