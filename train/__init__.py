"""Head training (Medusa-1/2, self-distillation)."""
