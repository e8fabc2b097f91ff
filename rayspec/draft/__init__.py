"""EAGLE-3 draft head, its training objective and the DraftTrainer actor."""
