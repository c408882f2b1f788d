"""Linear layer + cross-entropy (the LM head's loss) without the full logits."""
