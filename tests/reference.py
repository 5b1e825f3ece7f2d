"""Slow, obviously-correct pure-Python references for every C++ kernel.

Tests demand exact equality between a kernel and its reference on random inputs. Nothing here
is fast; nothing here is imported by the library.
"""

from __future__ import annotations
