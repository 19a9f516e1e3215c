"""Configuration: frozen settings dataclasses built from mappings (TOML sections, JSON)."""
