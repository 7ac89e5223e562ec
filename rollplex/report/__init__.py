"""Presentation of a compiled plan: text tables, JSON and the memory plot. No compiler logic here."""
