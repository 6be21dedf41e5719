"""What the gateway measures: Prometheus metrics per domain, drift, online calibration from feedback, the operators' dashboard."""
