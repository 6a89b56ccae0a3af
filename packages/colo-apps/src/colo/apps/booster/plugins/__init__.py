"""Booster plugins: one module per plugin."""
