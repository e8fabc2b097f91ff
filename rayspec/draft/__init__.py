"""EAGLE-3 draft head, its training objective, the verifier's features it
learns from (``capture``) and the DraftTrainer actor."""
