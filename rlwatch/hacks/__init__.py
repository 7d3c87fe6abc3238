"""Reward-hack detectors: ``register`` / ``detector`` your own, or use the built-ins."""

from .builtin import BUILTINS, use_checker
from .monitor import HackMonitor
from .registry import REGISTRY, Detector, Episode, Verdict, detector, register, resolve, unregister

__all__ = ["BUILTINS", "REGISTRY", "Detector", "Episode", "HackMonitor", "Verdict", "detector", "register",
           "resolve", "unregister", "use_checker"]
