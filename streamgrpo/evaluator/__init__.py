"""The evaluator role: held-out accuracy at the learner's weight versions, while it trains."""
