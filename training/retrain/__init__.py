"""The retraining worker: a job's data from captured traffic, training, the free-form and labelled stages, and the gate that decides promotion."""
