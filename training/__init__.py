"""Offline half of CALM Gateway: scoring, evaluation and (later) the CALM trainer and baselines."""
