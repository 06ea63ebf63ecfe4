"""The configuration: `settings` (the typed settings, loaded and checked) and `sources`
(where they come from: the TOML file, its drop-ins, the environment).

Others import `volutectl.config.settings`; `sources` is its helper. Nothing is
re-exported here, so importing one does not import pydantic for the other.
"""
