"""Typed settings, one section per stage (see base.Section); config.py composes them."""
