"""What the gateway stores: the data layer (responses, feedback, policies, keys), the review and hand-off rows, group commit, cached reads."""
