"""Generated wire contract (python -m maskd.protogen); do not edit."""
