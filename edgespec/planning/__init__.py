"""Where the models' layers go and what K fits: the memory budget (budget), pricing a layout (placement) and the
plan for a target and draft on this machine (plan)."""
