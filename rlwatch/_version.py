"""The distribution's version, in a module of its own so that any layer can read it without importing the
package root (pyproject.toml reads it too)."""

__version__ = "0.1.0"
