"""Scorers: one typed part per way of scoring an answer (calm_core/scorers/base.py), chosen by calm_core/scorers/registry.py."""
