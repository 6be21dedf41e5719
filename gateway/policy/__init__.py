"""Abstention policies, the policy book in force, guaranteed thresholds, and the operator's targets they may call."""
