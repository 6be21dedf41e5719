"""The gateway's edge: limits and backpressure, client keys and engine-work quotas, start-up, the HTTP server's settings, peer hops, the OpenAPI document."""
