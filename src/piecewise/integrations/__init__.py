"""Adapters that run other libraries' models under piecewise."""
