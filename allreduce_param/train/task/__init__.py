"""The fit's task side: the training loop in each barrier task, and its batching."""
