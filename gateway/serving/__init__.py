"""The request path: the calibrated service and its request context, planning, prompting, scoring's wire shapes, batch and Responses API, hand-off, escalation, labels, capture, deployments."""
